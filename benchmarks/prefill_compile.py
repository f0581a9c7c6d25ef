"""The sampler's prefill compiled for a TPU slice: its compile time, temporaries per chip and HLO size.

Compiles only the rollout engine's prefill (``grpax.sampler.program_set.compiled_admit``: a step's prompts prefilled
and written into the page pool) of a ``grpax train_rl`` job for ``compile_topology``
with the real TPU compiler (the ``tpu`` extra's libtpu; no TPU and no weights needed), on the rollout mesh and
with the sampler's own weights (LoRA: the base and its adapters with ``lora_sampler=adapters``), exactly as
``compile_topology`` does, and prints the compile time, the memory per chip and the optimised HLO's line count.
Run it under another commit's tree to compare (the same script, that tree's grpax):

  PYTHONPATH=<other worktree> python benchmarks/prefill_compile.py model_name=llama3.2-1b compile_topology=v6e-8
  PYTHONPATH=. python benchmarks/prefill_compile.py model_name=llama3.2-1b compile_topology=v6e-8

Usage: python benchmarks/prefill_compile.py [--num_layers N] KEY=VALUE...
"""

from __future__ import annotations

import argparse
import time

import jax
from decode_compile import report, topology_job

from grpax.config import build_config
from grpax.rl.train_config import TrainConfig
from grpax.sampler import program_set
from grpax.sampler.backend import select_backend


def compile_prefill(cfg: TrainConfig, num_layers: int = 0):
    """(compile seconds, the compiled prefill) for ``cfg.compile_topology`` (``num_layers`` as in
    ``decode_compile.topology_job``); its arguments as ``compile_check.compile_job`` gives them."""
    job = topology_job(cfg, num_layers)
    model_cfg, sc, mesh, params = job.model_cfg, job.sampler_cfg, job.rollout_mesh, job.rollout_params
    backend = select_backend(sc.backend, params, model_cfg, sc.cache_dtype, concrete=False)
    G = cfg.grpo().num_generations
    fn, args, kwargs = program_set.abstract_programs(params, model_cfg, sc, backend, cfg.batch_size, G)[
        "prefill"
    ]
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        lowered = fn.lower(*args, **kwargs)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
    print(f"prefill lowered in {lowered_at - start:.0f} s, compiled in {end - lowered_at:.0f} s", flush=True)
    return end - start, compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num_layers", type=int, default=0, help="cut the model to this many layers (0 = all)")
    ap.add_argument(
        "--min_mib", type=float, default=16.0, help="list ops whose output is at least this large"
    )
    args, keys = ap.parse_known_args()
    cfg = build_config(TrainConfig, keys)
    seconds, compiled = compile_prefill(cfg, args.num_layers)
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    lines = text.count("\n")
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(
        f"prefill per chip: temporaries {memory.temp_size_in_bytes / 2**30:.3f} GiB "
        f"({memory.temp_size_in_bytes:,} bytes), arguments {memory.argument_size_in_bytes / 2**30:.3f} GiB, "
        f"outputs {memory.output_size_in_bytes / 2**30:.3f} GiB; optimised HLO {lines:,} lines; "
        f"{seconds:.0f} s in all"
    )
    print(
        f"cost analysis per chip: {cost.get('flops', 0) / 1e12:.3f} TFLOP, {cost.get('bytes accessed', 0) / 2**30:.3f} GiB accessed"
    )
    report(text, int(args.min_mib * 2**20), loop_label="inside loops (the scan: per layer)", shown=6)


if __name__ == "__main__":
    main()
