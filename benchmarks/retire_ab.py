"""Retired rows against the parent commit, side by side in one run: ``grpo_step_bench.py`` alternately under two trees.

Runs this tree's ``benchmarks/grpo_step_bench.py`` (``--skip_trl --stop_tokens`` plus the arguments given after
``--``) with ``PYTHONPATH`` set to each tree in turn, ``--rounds`` times, alternating which goes first (A B, B A,
...), so both see the same load pattern and the same batches (the same arguments draw the same prompts, keys and
weights). The parent is the commit before finished rows were retired (``git worktree add <dir> 00090ef``), not
this tree with ``retire_rows=false``. Each run writes its JSON under ``--out``; the summary gives per arm the
median over rounds and steady steps of the step, rollout and update seconds, the rollout seconds per useful
token, the decode row-steps and the fraction past EOS, and the programs compiled during the steps and their
compile seconds (JAX's backend-compile events: retirement compiles one decode program per phase and row count).

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

KEYS = ("step_s", "rollout_s", "update_s", "rollout_s_per_useful_token", "useful_tokens", "decode_row_steps")


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
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    result = json.loads(json_out.read_text())
    result["wall_s"] = time.perf_counter() - start
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
    out["load_average"] = [run["load_average_start"] for run in runs]
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
    summary = {name: summarise(rs, warmup) for name, rs in runs.items()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
