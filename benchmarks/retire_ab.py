"""This tree against a parent commit, side by side in one run: ``grpo_step_bench.py`` alternately under two trees.

Runs this tree's ``benchmarks/grpo_step_bench.py`` (``--skip_trl --stop_tokens`` plus the arguments given after
``--``) with ``PYTHONPATH`` set to each tree in turn, ``--rounds`` times, alternating which goes first (A B, B A,
...), so both see the same load pattern and the same batches (the same arguments draw the same prompts, keys and
weights). The parent is a ``git worktree`` of an older commit, e.g. 00090ef (the commit before finished rows were
retired) or d99b7a0 (before all of issue 29: the vocab-parallel head, the update trimmed to real lengths, spread
prompts, retirement), not this tree with a key turned off. Each run writes its JSON under ``--out``; the summary
gives per arm the median over rounds and steady steps of the step, rollout, reference and update seconds, the
rollout seconds per useful token, the decode row-steps and the fraction past EOS, the programs compiled during
the steps and their compile seconds (JAX's backend-compile events: retirement compiles one decode program per
phase and row count), the load average at each run's start and end, and whether both arms sampled the same
completions at every step (the bench's hash of each step's completion tokens).

What an older grpax cannot report: its sampler does not count decode row-steps, so the bench takes every row for
every step up to the longest completion (exact for a sampler that runs every row to the end, as before
retirement), and the past-EOS fraction follows from the completion lengths; it has no ``grpax.rl.ahead``
(``--max_staleness`` other than 0 is refused).

Usage: python benchmarks/retire_ab.py --parent <parent worktree> [--this .] [--rounds 2] [--out DIR]
       -- --num_prompts 4 --num_generations 8 --new_tokens 256 --warmup_steps 1 --steady_steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KEYS = (
    "step_s",
    "rollout_s",
    "reference_s",
    "update_s",
    "rollout_s_per_useful_token",
    "useful_tokens",
    "decode_row_steps",
)


def run_arm(tree: Path, bench_args: list[str], json_out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    script = Path(__file__).parent / "grpo_step_bench.py"
    cmd = [
        sys.executable,
        str(script),
        "--skip_trl",
        "--stop_tokens",
        "--json_out",
        str(json_out),
        *bench_args,
    ]
    start, load_start = time.perf_counter(), os.getloadavg()
    subprocess.run(cmd, env=env, check=True)
    result = json.loads(json_out.read_text())
    result["wall_s"] = time.perf_counter() - start
    result["load_average_arm"] = [load_start, os.getloadavg()]  # at the run's start and end (1, 5, 15 min)
    print(f"  wall {result['wall_s']:.0f} s, load average {load_start} -> {os.getloadavg()}", flush=True)
    return result


def summarise(runs: list[dict], warmup: int) -> dict:
    steady = [step for run in runs for step in run["grpax"]["steps"][warmup:]]
    out = {k: statistics.median(s[k] for s in steady) for k in KEYS}
    out["past_eos"] = statistics.median(s["past_eos"] for s in steady)
    out["past_eos_mean"] = statistics.mean(s["past_eos"] for s in steady)
    out["decode_row_steps_total"] = sum(s["decode_row_steps"] for s in steady)
    compiled = []
    for run in runs:
        before, last = run["grpax"]["compiled_before_steps"], run["grpax"]["steps"][-1]["compiled"]
        compiled.append(
            (last["programs_so_far"] - before["programs"], last["compile_s_so_far"] - before["seconds"])
        )
    out["programs_compiled"] = [c[0] for c in compiled]
    out["compile_s"] = [round(c[1], 1) for c in compiled]
    out["load_average_start_end"] = [
        [round(x, 1) for x in (r["load_average_arm"][0][0], r["load_average_arm"][1][0])] for r in runs
    ]
    out["wall_s"] = [round(run["wall_s"]) for run in runs]
    out["completions_sha256"] = [[s.get("completions_sha256") for s in run["grpax"]["steps"]] for run in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parent", type=Path, required=True, help="a worktree of the parent commit")
    ap.add_argument("--this", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("retire_ab"))
    args, bench_args = ap.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    warmup = 1
    if "--warmup_steps" in bench_args:
        warmup = int(bench_args[bench_args.index("--warmup_steps") + 1])
    args.out.mkdir(parents=True, exist_ok=True)
    arms = {"parent": args.parent.resolve(), "this": args.this.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            print(f"round {r}: {name} ({arms[name]}), load average {os.getloadavg()}", flush=True)
            runs[name].append(run_arm(arms[name], bench_args, args.out / f"{name}_{r}.json"))
    summary: dict = {name: summarise(rs, warmup) for name, rs in runs.items()}
    hashes = [h for s in summary.values() for h in s["completions_sha256"]]
    summary["same_completions_every_step"] = all(h == hashes[0] for h in hashes)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
