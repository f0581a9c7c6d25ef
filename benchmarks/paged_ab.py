"""The paged, continuously batched engine against the static engine at equal KV memory, on the same completions.

SmolLM2-135M-Instruct (the embedded GGUF, float32, the CPU backend) samples G completions of GSM8K train prompts
(the ``smollm2_demo`` preset, as ``grpo_step_bench.py``), temperature 0.9, top-k 50, the model's stop tokens,
C = ``--new_tokens``. The KV memory is what the static engine needs for ``--static_rows`` rows of P + C slots
(P: the prompt bucket): the static engine (``--static_tree``, a checkout before the paged engine) decodes the rows in waves
of that many rows, one ``generate`` per wave; the paged engine gets a pool of the same bytes (``num_pages``) and
``--slots`` decode slots, and the same waves submitted at once as requests with the same keys, so both sample the
same tokens (each row's noise depends on its key, row and token index) and the same useful tokens. Reported per
arm: wall seconds of the sampling (compile seconds measured by JAX's compile events and subtracted), useful
tokens (the completions' lengths) per second (``--warm``: of a second run of the same sampling in the same
process, its programs compiled, as a GRPO run's engine from its second step on), decode row-steps (slots x steps run) and the fraction past EOS
(1 - sum(length - 1) / row-steps; ``past_eos_empty_slots``: the part on slots no sequence held at a decode call's
start), rows in flight (sum(length - 1) / decode steps), the paged engine's
preemptions, a hash of the completions (equal = the same tokens) and the load average.

One arm per process: the script of this tree under each grpax (``PYTHONPATH=<tree>``), e.g.

  PYTHONPATH=../parent44 python benchmarks/paged_ab.py --new_tokens 512 --json_out static_512.json
  PYTHONPATH=. python benchmarks/paged_ab.py --new_tokens 512 --json_out paged_512.json

or side by side in one run: ``--static_tree DIR`` (a checkout of the static engine whose grpax reads this
script's helpers, e.g. a worktree of main before the merge) runs, for each C of ``--new_tokens``, the static arm
under DIR then the paged arm under this tree, each in its own process, and prints both and their ratios (paged
/ static useful tokens/s; row-steps past EOS; rows in flight).

Usage: python benchmarks/paged_ab.py [--num_prompts 8] [--num_generations 8] [--new_tokens 512 [1024 ...]]
       [--static_rows 16] [--slots 32] [--page_size 32] [--steps_per_call 16] [--slot_count_step 0]
       [--warm] [--json_out FILE] [--gsm8k_dir DIR] [--static_tree DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step_bench import MAX_PROMPT_LENGTH, load_batches  # noqa: E402
from rollout_bench import add_gsm8k_dir_option, gsm8k_file  # noqa: E402

from grpax.checkpoint.gguf import default_gguf_path, read_gguf  # noqa: E402
from grpax.checkpoint.hf import load_params_from_tensors  # noqa: E402
from grpax.data.tokenizer import stop_token_ids  # noqa: E402
from grpax.models.registry import from_hf_config  # noqa: E402
from grpax.sampler import engine as engine_module  # noqa: E402
from grpax.sampler import keys  # noqa: E402

COMPILE_S = [0.0]


def _count_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILE_S[0] += duration


def run_static(params, cfg, sc, waves, G):
    """One ``generate`` per wave (the static engine: every row of a wave holds P + C slots)."""
    outs = []
    for prompts, key in waves:
        outs.append(engine_module.generate(params, prompts, cfg, sc, key, G))
    row_steps = sum(int(o.decode_row_steps) or len(o.lengths) * (int(o.lengths.max()) - 1) for o in outs)
    steps = sum(
        int(o.lengths.max()) - 1 for o in outs
    )  # the static decode runs to its longest row (retiring)
    return outs, {"row_steps": row_steps, "steps": steps}


def run_paged(params, cfg, sc, waves, G, slots, refill_at_once=True):
    """Every wave submitted at once to one engine with ``slots`` decode slots."""
    engine = engine_module.Engine(params, cfg, sc, num_slots=slots)
    engine.scheduler.refill_at_once = refill_at_once
    requests = [engine.submit(prompts, key, G) for prompts, key in waves]
    engine.run()
    outs = [
        r.output(sc.pad_token_id, sc.bucket_for(max(map(len, p))), sc.max_completion_length)
        for r, (p, _) in zip(requests, waves, strict=True)
    ]
    return outs, dict(engine.stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_prompts", type=int, default=8)
    ap.add_argument("--num_generations", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, nargs="+", default=[512])
    ap.add_argument(
        "--static_rows", type=int, default=16, help="rows per wave of the static engine (KV memory)"
    )
    ap.add_argument("--slots", type=int, default=32, help="the paged engine's decode slots")
    ap.add_argument("--page_size", type=int, default=32)
    ap.add_argument("--steps_per_call", type=int, default=16)
    ap.add_argument(
        "--slot_count_step", type=int, default=0, help="the paged engine's slot_count_step (0: ladder)"
    )
    ap.add_argument(
        "--refill_per_call", action="store_true", help="refill freed slots only between calls, not at once"
    )
    ap.add_argument(
        "--warm", action="store_true", help="time a second run of the same sampling (programs compiled)"
    )
    ap.add_argument("--json_out", default="")
    ap.add_argument("--static_tree", default="", help="run both arms side by side (see above)")
    add_gsm8k_dir_option(ap)
    args = ap.parse_args()
    if args.static_tree:
        side_by_side(args)
        return
    if len(args.new_tokens) != 1:
        ap.error("one --new_tokens per arm (several only with --static_tree)")
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    paged = hasattr(engine_module, "Engine")
    source = read_gguf(default_gguf_path())
    cfg = from_hf_config(source.hf_config)
    params = jax.device_put(load_params_from_tensors(source.get_tensor, source.has_tensor, cfg))
    tokenizer = source.tokenizer()
    G, C = args.num_generations, args.new_tokens[0]
    rows = load_batches(tokenizer, args.num_prompts, 1, gsm8k_file(args.gsm8k_dir, "train"))[0]
    prompts = [r["prompt_ids"] for r in rows]
    per_wave = args.static_rows // G
    waves = [
        (prompts[i : i + per_wave], jax.random.fold_in(jax.random.key(7), i))
        for i in range(0, len(prompts), per_wave)
    ]
    stops = stop_token_ids(tokenizer, cfg)
    fields = dict(
        max_prompt_length=MAX_PROMPT_LENGTH, max_completion_length=C, temperature=0.9, top_k=50,
        stop_token_ids=tuple(stops), pad_token_id=stops[0],
    )  # fmt: skip
    bucket = max(keys.SamplerConfig(**fields).bucket_for(max(map(len, p))) for p, _ in waves)
    tokens_of_memory = args.static_rows * (bucket + C)
    if paged:
        fields.update(
            page_size=args.page_size,
            num_pages=1 + tokens_of_memory // args.page_size,
            max_num_seqs=args.slots,
            decode_steps_per_call=args.steps_per_call,
            slot_count_step=args.slot_count_step,
        )
    sc = keys.SamplerConfig(**fields)
    for _ in range(2 if args.warm else 1):  # --warm: the timed run is the second, every program compiled
        load = os.getloadavg()
        start, compile_before = time.perf_counter(), COMPILE_S[0]
        if paged:
            outs, stats = run_paged(params, cfg, sc, waves, G, args.slots, not args.refill_per_call)
        else:
            outs, stats = run_static(params, cfg, sc, waves, G)
        wall = time.perf_counter() - start
    compile_s = COMPILE_S[0] - compile_before
    lengths = np.concatenate([o.lengths for o in outs])
    needed = int(np.maximum(lengths - 1, 0).sum())
    ids = np.concatenate([o.completion_ids * o.completion_mask for o in outs])
    result = {
        "engine": "paged" if paged else "static",
        "new_tokens": C,
        "rows": int(len(lengths)),
        "prompt_bucket": bucket,
        "kv_tokens": tokens_of_memory,
        "static_rows": args.static_rows,
        "slots": args.slots if paged else args.static_rows,
        "wall_s": wall,
        "compile_s": compile_s,
        "useful_tokens": int(lengths.sum()),
        "useful_tokens_per_s": float(lengths.sum() / max(wall - compile_s, 1e-9)),
        "mean_length": float(lengths.mean()),
        "hit_limit": int((lengths == C).sum()),
        "decode_row_steps": int(stats["row_steps"]),
        "decode_steps": int(stats["steps"]),
        "past_eos": 1.0 - needed / max(int(stats["row_steps"]), 1),
        "rows_in_flight": needed / max(int(stats["steps"]), 1),
        "preempted": int(stats.get("preempted", 0)),
        # past-EOS row-steps of slots empty at a call's start (the halving's rounding, or no sequence to put there)
        "past_eos_empty_slots": int(stats.get("row_steps_empty", 0)) / max(int(stats["row_steps"]), 1),
        "steps_per_call": args.steps_per_call if paged else 0,
        "slot_count_step": args.slot_count_step if paged else 0,
        "refill_at_once": paged and not args.refill_per_call,
        "decode_calls": int(stats.get("calls", 0)),
        "warm": args.warm,
        "completions_sha256": hashlib.sha256(ids.tobytes()).hexdigest()[:16],
        "load_average": [load, os.getloadavg()],
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


def _arm(tree: str, args, C: int, out: Path) -> dict:
    """One arm in a process of its own, its grpax the one in ``tree``."""
    cmd = [sys.executable, __file__, "--new_tokens", str(C), "--json_out", str(out)]
    names = (
        "num_prompts",
        "num_generations",
        "static_rows",
        "slots",
        "page_size",
        "steps_per_call",
        "slot_count_step",
    )
    for name in names:
        cmd += [f"--{name}", str(getattr(args, name))]
    cmd += ["--refill_per_call"] if args.refill_per_call else []
    cmd += ["--warm"] if args.warm else []
    cmd += ["--gsm8k_dir", str(args.gsm8k_dir)]
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def side_by_side(args) -> None:
    """Both arms at each C (static first), and the paged / static ratios."""
    here = Path(__file__).resolve().parent.parent
    out = Path(args.json_out or "paged_ab.json")
    results = []
    for C in args.new_tokens:
        static = _arm(args.static_tree, args, C, out.with_suffix(f".static_{C}.json"))
        paged = _arm(str(here), args, C, out.with_suffix(f".paged_{C}.json"))
        if static["engine"] != "static" or paged["engine"] != "paged":
            raise SystemExit(f"--static_tree {args.static_tree} has the paged engine: give a static one")
        ratio = paged["useful_tokens_per_s"] / static["useful_tokens_per_s"]
        results.append({"new_tokens": C, "static": static, "paged": paged, "tokens_per_s_ratio": ratio})
        print(f"C={C}: rows {paged['rows']}, KV memory {paged['kv_tokens']} tokens (both arms)")
        print("  arm     useful tok/s  wall s  compile s  row-steps  past EOS  rows in flight  sha256")
        for r in (static, paged):
            print(
                f"  {r['engine']:<7} {r['useful_tokens_per_s']:>12.1f}  {r['wall_s']:>6.1f}  {r['compile_s']:>9.1f}"
                f"  {r['decode_row_steps']:>9}  {r['past_eos']:>8.3f}  {r['rows_in_flight']:>14.1f}"
                f"  {r['completions_sha256']}"
            )
        same = "same" if static["completions_sha256"] == paged["completions_sha256"] else "different"
        print(f"  paged / static useful tokens/s: {ratio:.2f}x ({same} completions)")
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
