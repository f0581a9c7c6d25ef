"""The decode step's layers unrolled (per-layer pools) against scanned (one pool; ``XlaBackend.scan_layers``), side by
side in one process on the device JAX finds: compile seconds, decode tokens per second, and whether the two
sample the same tokens.

A model of the registry (random init, stacked layers, its registered dtype unless ``--dtype``) samples
``--prompts`` x ``--num_generations`` rows of ``--new_tokens`` tokens (temperature 0.9; no stop token, so every
row runs to its budget) from random prompts of ``--prompt_length`` tokens, with the fixed program set (the
accelerators' default). Per arm: the seconds of the first ``generate`` (its programs compiled: prefill and
decode), the seconds of a second one (warm) and its completion tokens per second; then the rows of the two arms
compared: the share of rows with the same tokens, and the largest logprob difference. A greedy pass is compared
too. What ``select_backend`` chooses on this device is printed first.

  python benchmarks/scan_decode_ab.py --model smollm2-135m-Instruct --dtype float32     # the README's job's model
  JAX_PLATFORMS=cpu python benchmarks/scan_decode_ab.py --tiny                          # a CPU proof (seconds)

Usage: python benchmarks/scan_decode_ab.py [--model NAME] [--dtype D] [--prompts 4] [--num_generations 4]
       [--prompt_length 200] [--new_tokens 192] [--tiny] [--json_out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np

from grpax.models.params import init_params
from grpax.models.registry import ModelConfig, get_model_config
from grpax.sampler import engine, program_set
from grpax.sampler.backend import select_backend
from grpax.sampler.keys import SamplerConfig

TINY = ModelConfig(
    vocab_size=61, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
    rope_theta=10000.0,
)  # fmt: skip


def _arm(params, cfg, sc, prompts, G, scan: bool) -> dict:
    chosen = select_backend
    engine.select_backend = lambda *a, **k: dataclasses.replace(chosen(*a, **k), scan_layers=scan)
    program_set.clear_compiled()
    try:
        out, seconds = None, []
        for _ in range(2):  # the first compiles, the second is the warm figure
            start = time.perf_counter()
            out = engine.generate(params, prompts, cfg, sc, jax.random.key(7), num_generations=G)
            seconds.append(time.perf_counter() - start)
        greedy = engine.generate(
            params, prompts, cfg, dataclasses.replace(sc, greedy=True), jax.random.key(7), G
        )
    finally:
        engine.select_backend = chosen
        program_set.clear_compiled()
    tokens = int(out.completion_mask.sum())
    return dict(
        scan=scan, first_s=seconds[0], warm_s=seconds[1], tokens=tokens, tok_per_s=tokens / seconds[1],
        out=out, greedy=greedy,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-Instruct")
    parser.add_argument("--dtype", default="")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--prompt_length", type=int, default=200)
    parser.add_argument("--new_tokens", type=int, default=192)
    parser.add_argument("--tiny", action="store_true", help="a 3-layer toy model, short rows (a CPU proof)")
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()
    cfg = TINY if args.tiny else get_model_config(args.model)
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype, weight_dtype=args.dtype)
    P, C = (40, 24) if args.tiny else (args.prompt_length, args.new_tokens)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, cfg.vocab_size, P))) for _ in range(args.prompts)]
    sc = SamplerConfig(
        max_prompt_length=P, max_completion_length=C, temperature=0.9, backend="xla", programs="fixed"
    )
    chosen = select_backend("xla", params, cfg, sc.cache_dtype)
    print(
        f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}; model {cfg.num_layers} layers, "
        f"{cfg.dtype}; select_backend: scan_layers={chosen.scan_layers}, paged_attention={chosen.paged_attention}"
    )
    arms = [_arm(params, cfg, sc, prompts, args.num_generations, scan) for scan in (False, True)]
    for a in arms:
        name = "scanned" if a["scan"] else "unrolled"
        print(
            f"{name:>9}: first generate {a['first_s']:6.1f} s (compiles), warm {a['warm_s']:6.2f} s, "
            f"{a['tokens']} tokens, {a['tok_per_s']:8.0f} tok/s"
        )
    (u, s) = arms
    same = float(np.mean(np.all(u["out"].completion_ids == s["out"].completion_ids, axis=1)))
    same_greedy = float(np.mean(np.all(u["greedy"].completion_ids == s["greedy"].completion_ids, axis=1)))
    dlog = float(np.abs(u["out"].logprobs - s["out"].logprobs).max())
    print(
        f"rows with the same tokens: sampled {same:.0%}, greedy {same_greedy:.0%}; largest logprob "
        f"difference {dlog:.2e}; scanned / unrolled warm tok/s {s['tok_per_s'] / u['tok_per_s']:.3f}"
    )
    if args.json_out:
        keep = ("scan", "first_s", "warm_s", "tokens", "tok_per_s")
        with open(args.json_out, "w") as f:
            json.dump(dict(arms=[{k: a[k] for k in keep} for a in arms], same_sampled=same,
                           same_greedy=same_greedy, max_logprob_diff=dlog), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
