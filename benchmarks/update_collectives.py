"""The GRPO update's and the reference pass's chip-to-chip traffic on a TPU slice, from the compiled HLO.

Compiles only the two trainer programs of a ``grpax train_rl`` job for ``compile_topology`` (no TPU and no weights
needed: the ``tpu`` extra's libtpu), as ``compile_topology`` does, and prints per chip: each kind of collective
(executions with loop trips counted, bytes), their ICI time at the chip's bandwidth, FSDP's minimum
(``grpax.rl.collectives``), and the compiler's temporaries. Faster than the whole job's compile (no sampler).

To compare with another commit, compile there and count here: the HLO files are saved with ``--save_hlo``, and
``--count DIR`` counts saved files with this tree's counter (the other commit may not have it):

  PYTHONPATH=<other worktree> python benchmarks/update_collectives.py --save_hlo /tmp/before --no_count \\
      model_name=llama3.2-1b compile_topology=v6e-8
  python benchmarks/update_collectives.py --count /tmp/before model_name=llama3.2-1b compile_topology=v6e-8

Usage: python benchmarks/update_collectives.py [--save_hlo DIR] [--no_count] [--update_only] [--count DIR] KEY=VALUE...
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from grpax import sharding
from grpax.config import build_config
from grpax.models.params import abstract_params
from grpax.rl import compile_check
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import make_train_step, token_logprobs
from grpax.topology import get_topology


def compile_programs(cfg: TrainConfig, update_only: bool) -> dict[str, tuple[str, int]]:
    """{program: (its optimised HLO text, temporaries bytes per chip)} compiled for ``cfg.compile_topology``."""
    topology = get_topology(cfg.compile_topology, 1, cfg.chips_per_vm or 0)
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    mesh = sharding.create_mesh(mesh_cfg, topology.devices)
    job = compile_check.build_job(cfg, mesh, sharding.create_rollout_mesh(mesh_cfg, topology.devices))
    grpo = cfg.grpo()
    kwargs = {}
    if "max_completion_length" in make_train_step.__code__.co_varnames:  # absent before issue 29
        kwargs["max_completion_length"] = cfg.max_completion_length
    out = {}
    with jax.set_mesh(job.mesh):
        step = make_train_step(
            job.model_cfg, grpo, job.optimizer, cfg.micro_batches, job.lr_schedule, **kwargs
        )
        start = time.perf_counter()
        compiled = step.lower(job.state, job.batch).compile()
        print(f"update compiled in {time.perf_counter() - start:.0f} s", flush=True)
        out["update"] = (compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes)
        if not update_only:
            start = time.perf_counter()
            args = (job.state.params, job.batch.tokens(), job.model_cfg, grpo.temperature, cfg.micro_batches)
            compiled = token_logprobs.lower(*args).compile()
            print(f"reference compiled in {time.perf_counter() - start:.0f} s", flush=True)
            out["reference"] = (compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes)
    return out


def report(cfg: TrainConfig, texts: dict[str, str]) -> None:
    """Prints each program's collectives per chip, their ICI time and FSDP's minimum."""
    from grpax.rl.collectives import count_collectives, fsdp_minimum
    from grpax.rl.compile_check import model_config

    topology = get_topology(cfg.compile_topology, 1, cfg.chips_per_vm or 0)
    model_cfg = model_config(cfg)
    mesh = sharding.create_mesh(dataclasses.replace(cfg.mesh(), chips_per_vm=0), topology.devices).shape
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(model_cfg)))
    itemsize = jnp.dtype(model_cfg.dtype).itemsize
    ici = topology.chip.ici_bandwidth
    for name, text in texts.items():
        counted, unknown = count_collectives(text, topology.num_chips)
        total = sum(c.bytes_per_chip for c in counted.values())
        passes, grads = (2, True) if name == "update" else (1, False)
        minimum = fsdp_minimum(num_params, itemsize, mesh["fsdp"], mesh["tensor"], passes, grads)
        kinds = ", ".join(f"{k} {c.count} x {c.bytes_per_chip / 1e9:.3f} GB" for k, c in counted.items())
        print(
            f"{name}: {total / 1e9:.2f} GB per chip, {total / ici:.4f} s at {ici / 1e9:.0f} GB/s ICI; FSDP's minimum "
            f"{minimum / 1e9:.2f} GB ({total / minimum:.2f}x); {kinds}"
            + (f" ({unknown} loops of unknown trip count counted once)" if unknown else "")
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save_hlo", default="", help="folder to write update.hlo / reference.hlo into")
    ap.add_argument("--no_count", action="store_true", help="compile and save only (another commit's tree)")
    ap.add_argument("--update_only", action="store_true", help="skip the reference pass")
    ap.add_argument("--count", default="", help="count the .hlo files saved in this folder; compile nothing")
    args, keys = ap.parse_known_args()
    cfg = build_config(TrainConfig, keys)
    if args.count:
        report(cfg, {p.stem: p.read_text() for p in sorted(Path(args.count).glob("*.hlo"))})
        return
    programs = compile_programs(cfg, args.update_only)
    for name, (_, temporaries) in programs.items():
        print(f"{name} temporaries {temporaries / 2**30:.2f} GiB per chip")
    if args.save_hlo:
        Path(args.save_hlo).mkdir(parents=True, exist_ok=True)
        for name, (text, _) in programs.items():
            (Path(args.save_hlo) / f"{name}.hlo").write_text(text)
    if not args.no_count:
        report(cfg, {name: text for name, (text, _) in programs.items()})


if __name__ == "__main__":
    main()
