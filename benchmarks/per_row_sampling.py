"""The sampling step with each row's own rule (``Engine.submit``'s per-request settings) against the static one.

The engine samples with ``grpax.sampler.decode.sample``: where every row of a call has the ``SamplerConfig``'s
rule, the rule is static (the GRPO rollout's program, unchanged); where rows differ (``grpax serve``'s mixed
requests), each row's temperature, top-k and top-p are arrays read as data. This times one call of each
(jitted, on float32 logits [S, V], the draw and the logprobs included) for the mixes the engine meets:

- static: every row at the engine's rule (temperature 0.9; greedy; top-p 0.9; top-k 50);
- per-row, no filter: temperatures 0.6..1.4 across the rows (the same work whatever the values);
- per-row, greedy: every row greedy (the draw skipped), and half the rows greedy;
- per-row, top-p 0.9 on every row (the static program's bisection, per row);
- per-row, top-k: every row at the engine's k (``lax.top_k``'s path) or rows of two k's (bisection for all).

The cases run in turn in each of ``--rounds`` rounds (one untimed call first: its compile), each round timing
the median of ``--reps`` calls; the best round of each case is kept, so a shared machine's drift hits them
alike. Printed: ms per call and each case's ratio to the static program of the same settings. Timings are this
machine's (CPU unless JAX has another device).

Usage: python benchmarks/per_row_sampling.py [--rows 32] [--vocab 49152] [--reps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpax.sampler.decode import RULE_FIELDS, sample
from grpax.sampler.keys import SamplerConfig, SamplingRule


def rule_arrays(rules: list[SamplingRule]) -> dict[str, jax.Array]:
    """The programs' ``rule`` of rows with these rules."""
    dtypes = (jnp.float32, jnp.int32, jnp.float32)
    columns = zip(*rules, strict=True)
    return {name: jnp.asarray(c, d) for name, c, d in zip(RULE_FIELDS, columns, dtypes, strict=True)}


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    S, V = args.rows, args.vocab
    logits = 4.0 * jax.random.normal(jax.random.key(0), (S, V))
    keys = jax.random.split(jax.random.key(1), S)
    n, rows = jnp.arange(S) + 1, jnp.arange(S)
    run = jax.jit(sample, static_argnums=4)

    def static(**fields):
        sc = SamplerConfig(**fields)
        return lambda: run(logits, keys, n, rows, sc)

    def per_row(rules, static_top_k=0):
        sc, rule = SamplerConfig(top_k=static_top_k), rule_arrays(rules)
        return lambda: run(logits, keys, n, rows, sc, rule)

    temperatures = np.linspace(0.6, 1.4, S).tolist()
    cases = [
        ("static, temperature 0.9", static(temperature=0.9), None),
        ("per-row, temperatures 0.6..1.4", per_row([SamplingRule(t, 0, 1.0) for t in temperatures]), 0),
        ("static, greedy", static(greedy=True), None),
        ("per-row, every row greedy", per_row([SamplingRule(0.0, 0, 1.0)] * S), 2),
        (
            "per-row, half greedy",
            per_row([SamplingRule(0.0 if i % 2 else 0.9, 0, 1.0) for i in range(S)]),
            0,
        ),
        ("static, top-p 0.9", static(temperature=0.9, top_p=0.9), None),
        ("per-row, top-p 0.9", per_row([SamplingRule(t, 0, 0.9) for t in temperatures]), 5),
        ("static, top-k 50", static(temperature=0.9, top_k=50), None),
        (
            "per-row, top-k 50 = the engine's",
            per_row([SamplingRule(t, 50, 1.0) for t in temperatures], 50),
            7,
        ),
        (
            "per-row, top-k 20 / 50 (bisection)",
            per_row([SamplingRule(t, (20, 50)[i % 2], 1.0) for i, t in enumerate(temperatures)], 50),
            7,
        ),
    ]
    for _, fn, _ in cases:
        jax.block_until_ready(fn())  # the compiles
    best = [timed(fn, args.reps) for _, fn, _ in cases]
    for _ in range(args.rounds - 1):
        best = [min(b, timed(fn, args.reps)) for b, (_, fn, _) in zip(best, cases, strict=True)]
    print(
        f"S = {S} rows, V = {V}, device {jax.devices()[0].platform}, best of {args.rounds} rounds x median of "
        f"{args.reps} calls"
    )
    print("| case | ms per call | / its static program |")
    print("|---|---|---|")
    for (name, _, base), seconds in zip(cases, best, strict=True):
        ratio = "" if base is None else f"{seconds / best[base]:.2f}"
        print(f"| {name} | {seconds * 1e3:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
