"""The update's layers with and without the attention's optimization barrier, timed on this machine's accelerator.

``grpax.models.attention.attention`` passes the softmax's output through ``jax.lax.optimization_barrier`` (an
identity) so the TPU compiler cannot fuse both einsums and the softmax into one nested fusion (issue 53: that
fusion's cost model overflowed a compiler thread's stack). This times what the barrier costs where the program
runs: the gradient of the trainer's forward (``forward_grouped``, the update's) over ``--num_layers`` layers of a
model's shapes (a 256-token vocabulary: the layers, not the head), at the seed's global batch on one device
(4 prompts of 256 tokens, 4 completions each of 256), with each remat policy, the barrier on and off (the
barrier replaced by an identity while tracing), in turns over ``--rounds`` rounds; the best time of each.
Figures: docs/scaling.md, "2026-12-06: v6e-8 compile of the update with remat auto".

Usage: python benchmarks/attention_barrier.py [--model_name llama3.2-1b] [--num_layers 2] [--remat none,full]
    [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from grpax.models import llama
from grpax.models.params import init_params
from grpax.models.registry import get_model_config


def timed(fn, *args) -> float:
    """Seconds of one call of ``fn`` (compiled and warmed first by the caller)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model_name", default="llama3.2-1b")
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--remat", default="none,full")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    base = get_model_config(args.model_name, dtype="bfloat16", weight_dtype="float32")
    base = dataclasses.replace(base, num_layers=args.num_layers, vocab_size=256)
    params = init_params(base, jax.random.key(0))
    prompts = jax.random.randint(jax.random.key(1), (4, 256), 0, 256)
    mask = jnp.ones((4, 256), jnp.int32)
    completions = jax.random.randint(jax.random.key(2), (16, 256), 0, 256)
    barrier = jax.lax.optimization_barrier
    programs = {}
    for remat in args.remat.split(","):
        cfg = dataclasses.replace(base, remat_policy=remat)
        for on in (True, False):
            jax.lax.optimization_barrier = barrier if on else (lambda x: x)

            def loss(p, c=cfg):
                return llama.forward_grouped(p, prompts, mask, completions, c).astype(jnp.float32).mean()

            fn = jax.jit(jax.grad(loss))
            jax.block_until_ready(fn(params))  # traced and compiled with the barrier as set now
            programs[remat, on] = fn
    jax.lax.optimization_barrier = barrier
    best = {key: float("inf") for key in programs}
    for _ in range(args.rounds):
        for key, fn in programs.items():
            best[key] = min(best[key], timed(fn, params))
    print(
        f"{jax.devices()[0].device_kind}, {args.model_name} cut to {args.num_layers} layers, best of {args.rounds}:"
    )
    for remat in args.remat.split(","):
        on, off = best[remat, True], best[remat, False]
        print(
            f"  remat {remat:8s} barrier {on * 1e3:8.2f} ms   without {off * 1e3:8.2f} ms   ratio {on / off:.3f}"
        )


if __name__ == "__main__":
    main()
