"""The LoRA sampler's two choices on this machine: decode with the adapters (``lora.apply``: each layer computes
``x @ W + s * (x @ A) @ B``) or with merged weights (``lora.merge`` once per rollout, then the base's decode).

Each choice runs in its own process (peak RSS is per process): a random model of SmolLM2-135M's shape, float32,
rank-16 adapters on all seven modules, one warm-up rollout then ``--repeats`` timed ones (the merge included in
the merged choice's time). Prints one JSON line per choice; docs/benchmarks.md, "LoRA", holds the table.

    python -m benchmarks.lora_sampler_bench            # both, side by side
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run_one(mode: str, backend: str, rows: int, prompt: int, completion: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from grpax.models import lora as lora_lib
    from grpax.models.params import init_params
    from grpax.models.registry import get_model_config
    from grpax.rl.policy import merge_adapters
    from grpax.sampler.engine import generate
    from grpax.sampler.keys import SamplerConfig

    cfg = get_model_config("smollm2-135m-Instruct", weight_dtype="float32", dtype="float32")
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=16, alpha=32.0)
    adapters = jax.tree.map(lambda x: x + 0.01, lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, size=prompt).tolist() for _ in range(rows)]
    sc = SamplerConfig(
        max_prompt_length=prompt, max_completion_length=completion, stop_token_ids=(), backend=backend
    )
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def rollout(key):
        params = (
            merge_adapters(base, adapters, lora) if mode == "merged" else lora_lib.apply(base, adapters, lora)
        )
        out = generate(params, prompts, cfg, sc, key)
        return jax.block_until_ready(out.completion_ids)

    rollout(jax.random.key(0))  # compile
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        rollout(jax.random.key(i + 1))
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": mode,
        "backend": backend,
        "rollout_s_median": float(np.median(times)),
        "tokens_per_s": rows * completion / float(np.median(times)),
        "peak_rss_gib": rss / 2**20,
        "rss_after_init_gib": rss0 / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("adapters", "merged"))
    p.add_argument("--backend", default="xla")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    if a.mode:
        print(json.dumps(run_one(a.mode, a.backend, a.rows, a.prompt, a.completion, a.repeats)), flush=True)
        return
    args = [
        f"--rows={a.rows}",
        f"--prompt={a.prompt}",
        f"--completion={a.completion}",
        f"--repeats={a.repeats}",
    ]
    for mode, backend in (("adapters", "xla"), ("merged", "xla"), ("merged", "auto")):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.lora_sampler_bench",
            f"--mode={mode}",
            f"--backend={backend}",
        ]
        subprocess.run(cmd + args, check=True)


if __name__ == "__main__":
    main()
