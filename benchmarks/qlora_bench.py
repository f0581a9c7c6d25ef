"""QLoRA's base on this machine: its bytes, the LoRA update step and the sampler's merge, bfloat16 vs int8 vs nf4.

One process, a random model of SmolLM2-135M's shape with a bfloat16 base (compute in float32, as on CPU),
rank-16 adapters on all seven modules. For each base (as loaded, ``lora_base_dtype=int8``, ``nf4``): the bytes
of the layers' projection weights and of the whole base, the quantisation time, and, after a warm-up (compiling)
call each, ``--repeats`` rounds that time one GRPO update step (``make_train_step``, beta = 0.04 so the KL term
runs; the reference pass is not timed) and one ``Policy.sampler_params`` merge per base, the bases alternating
within each round so that a change of machine load hits all three alike. Prints one JSON line per base;
docs/benchmarks.md, "LoRA", holds the table.

    python -m benchmarks.qlora_bench
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpax.models import lora as lora_lib
    from grpax.models.params import init_params
    from grpax.models.registry import get_model_config
    from grpax.rl.batch import Batch
    from grpax.rl.config import GRPOConfig
    from grpax.rl.optim import optimizer_from_config
    from grpax.rl.policy import Policy
    from grpax.rl.train_step import TrainState, make_train_step

    cfg = get_model_config("smollm2-135m-Instruct", weight_dtype="bfloat16", dtype="float32")
    base = init_params(cfg, jax.random.key(0))
    lora = lora_lib.LoraConfig(rank=16, alpha=32.0)
    grpo = GRPOConfig(num_generations=a.generations, beta=0.04, learning_rate=1e-5)
    optimizer, schedule = optimizer_from_config(grpo, 100, "float32")
    m, G, P, C = a.prompts, a.generations, a.prompt, a.completion
    rng = np.random.default_rng(0)
    batch = Batch(
        prompt_ids=jnp.asarray(rng.integers(1, cfg.vocab_size, (m, P)), jnp.int32),
        prompt_mask=jnp.ones((m, P), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(1, cfg.vocab_size, (m * G, C)), jnp.int32),
        completion_mask=jnp.ones((m * G, C), jnp.int32),
        advantages=jnp.asarray(rng.normal(size=m * G), jnp.float32),
        ref_logprobs=jnp.asarray(-rng.uniform(0, 5, (m * G, C)), jnp.float32),
    )

    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    runs = {}
    for qtype in ("", "int8", "nf4"):
        t0 = time.perf_counter()
        policy = Policy(lora, base, "", qtype)
        jax.block_until_ready(policy.base)
        quantize_s = time.perf_counter() - t0 if qtype else 0.0
        adapters = jax.tree.map(lambda x: x + 0.01, lora_lib.init_adapters(cfg, lora, jax.random.key(1)))
        state = TrainState(params=adapters, opt_state=optimizer.init(adapters), step=jnp.zeros((), jnp.int32))
        step = make_train_step(cfg, grpo, optimizer, 1, schedule, lora=lora, base=policy.base)
        t0 = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state.params)
        first_step_s = time.perf_counter() - t0
        jax.block_until_ready(policy.sampler_params(state.params))
        runs[qtype or "bfloat16"] = dict(
            policy=policy,
            step=step,
            state=state,
            record={
                "base": qtype or "bfloat16",
                "layer_weights_mb": nbytes(policy.base["layers"]) / 1e6,
                "base_mb": nbytes(policy.base) / 1e6,
                "quantize_s": quantize_s,
                "first_step_s": first_step_s,
                "step_s": [],
                "merge_s": [],
            },
        )
    for _ in range(a.repeats):
        for run in runs.values():
            t0 = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], batch)
            jax.block_until_ready(run["state"].params)
            run["record"]["step_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            merged = run["policy"].sampler_params(run["state"].params)
            jax.block_until_ready(merged)
            run["record"]["merge_s"].append(time.perf_counter() - t0)
            del merged
    for run in runs.values():
        rec = run["record"]
        rec["step_s_median"] = float(np.median(rec["step_s"]))
        rec["merge_s_median"] = float(np.median(rec["merge_s"]))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
