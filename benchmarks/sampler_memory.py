"""The rollout engine's memory per chip, compiled for a TPU slice beside the NVIDIA estimate's model of it.

Compiles the engine's two programs (``grpax.sampler.program_set.abstract_programs``: the prefill of a step's prompts
into the page pool, a decode call on every slot) of a ``grpax train_rl`` job for ``compile_topology`` with the
real TPU compiler (the ``tpu`` extra's libtpu; no TPU and no weights needed), as ``compile_topology`` does, and
prints each one's arguments, outputs, aliases and temporaries per chip beside the terms
``grpax.plan.memory_estimate.sampler_terms`` counts for the same job on the same mesh. The decode is compiled
with the backend's own paged attention (Pallas's ragged kernel where it takes the model) and with
``--paged_attention xla``, the gathered pages a GPU runs, which the estimate models.

  JAX_PLATFORMS=cpu python benchmarks/sampler_memory.py --paged_attention xla model_name=llama3.2-1b \\
      compile_topology=v6e-8 chips_per_vm=8 rollout_data_parallelism=1 rollout_tensor_parallelism=-1

Usage: python benchmarks/sampler_memory.py [--num_layers N] [--paged_attention backend|xla] KEY=VALUE...
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
from decode_compile import topology_job

from grpax.config import build_config
from grpax.plan import memory_estimate
from grpax.rl.train_config import TrainConfig
from grpax.sampler import program_set

GIB = 2**30


def compile_programs(job, paged_attention: str) -> dict[str, object]:
    """{"prefill", "decode"}: each program's ``memory_analysis()``, compiled for the job's rollout mesh."""
    backend = job.sampler_backend
    if paged_attention == "xla":
        backend = dataclasses.replace(backend, paged_attention="xla")
    cfg = job.cfg
    programs = program_set.abstract_programs(
        job.rollout_params,
        job.model_cfg,
        job.sampler_cfg,
        backend,
        cfg.batch_size,
        cfg.grpo().num_generations,
    )
    out = {}
    with jax.set_mesh(job.rollout_mesh):
        for name, (fn, args, kwargs) in programs.items():
            start = time.perf_counter()
            out[name] = fn.lower(*args, **kwargs).compile().memory_analysis()
            print(f"{name} compiled in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num_layers", type=int, default=0, help="cut the model to this many layers (0 = all)")
    ap.add_argument(
        "--paged_attention", choices=("backend", "xla"), default="xla",
        help="the decode's paged attention: the backend's choice, or the gathered pages (the GPU's)",
    )  # fmt: skip
    args, keys = ap.parse_known_args()
    cfg = build_config(TrainConfig, keys)
    job = topology_job(cfg, args.num_layers)
    if args.paged_attention == "xla":
        job.sampler_backend = dataclasses.replace(job.sampler_backend, paged_attention="xla")
    sc = job.sampler_cfg
    print(
        f"pool: {job.num_pages} pages x {sc.page_size} tokens, {job.kv_cache / GIB:.3f} GiB per chip; rollout "
        f"mesh {dict(job.rollout_mesh.shape)}; paged attention {job.sampler_backend.paged_attention}"
    )
    compiled = compile_programs(job, args.paged_attention)
    terms = memory_estimate.sampler_terms(job)
    for name, memory in compiled.items():
        estimate = sum(terms[name].values())
        temporaries = memory.temp_size_in_bytes
        print(
            f"{name}: compiled temporaries {temporaries / GIB:.3f} GiB ({temporaries:,} B), arguments "
            f"{memory.argument_size_in_bytes / GIB:.3f}, outputs {memory.output_size_in_bytes / GIB:.3f}, aliased "
            f"{memory.alias_size_in_bytes / GIB:.3f}; estimate {estimate / GIB:.3f} GiB "
            f"({100 * (estimate / max(temporaries, 1) - 1):+.0f}%)"
        )
        for term, b in terms[name].items():
            print(f"    {term:<60}{b / GIB:>9.3f} GiB")


if __name__ == "__main__":
    main()
