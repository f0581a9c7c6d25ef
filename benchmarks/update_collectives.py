"""The GRPO update's and the reference pass's chip-to-chip traffic on a TPU slice, from the compiled HLO.

Compiles only the two trainer programs of a ``grpax train_rl`` job for ``compile_topology`` (no TPU and no weights
needed: the ``tpu`` extra's libtpu), as ``compile_topology`` does, and prints per chip: each kind of collective
(executions with loop trips counted, bytes), their ICI time at the chip's bandwidth, FSDP's minimum
(``grpax.plan.collectives``); each program's memory per chip (arguments, outputs, temporaries, its phase beyond the
resident arrays, as ``compile_topology``'s table) and the peak of the two beside the resident arrays; and the counted
lower bound of a step (``grpax.plan.step_cost``) with and without the programs' ICI time as a floor of their phases.
Faster than the whole job's compile (no sampler: the whole job's peak also weighs the rollout phase).

To compare with another commit, compile there and count here: the HLO files are saved with ``--save_hlo``, and
``--count DIR`` counts saved files with this tree's counter (the other commit may not have it; the memory figures
are saved beside them in memory.json):

  PYTHONPATH=<other worktree> python benchmarks/update_collectives.py --save_hlo /tmp/before --no_count \\
      model_name=llama3.2-1b compile_topology=v6e-8
  python benchmarks/update_collectives.py --count /tmp/before model_name=llama3.2-1b compile_topology=v6e-8

Usage: python benchmarks/update_collectives.py [--save_hlo DIR] [--no_count] [--update_only] [--count DIR] [--top N]
    [--compiler_option KEY=VALUE] KEY=VALUE...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from grpax import sharding
from grpax.config import build_config
from grpax.models.params import abstract_params
from grpax.plan import compile_check
from grpax.plan.topology import get_topology
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import make_train_step, token_logprobs


def compile_programs(
    cfg: TrainConfig, update_only: bool, options: dict[str, str] | None = None
) -> tuple[dict[str, tuple[str, dict[str, int]]], dict]:
    """({program: (its optimised HLO text, its memory per chip)}, the resident arrays per chip) compiled for
    ``cfg.compile_topology``; a program's memory: arguments, outputs, aliased, temporaries and its phase's bytes
    beyond the resident arrays (as ``compile_check._extra``)."""
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
        compiled = step.lower(job.state, job.batch).compile(compiler_options=options)
        print(f"update compiled in {time.perf_counter() - start:.0f} s", flush=True)
        out["update"] = (compiled.as_text(), _memory(compiled, sharding.per_chip_bytes(job.state)))
        if not update_only:
            start = time.perf_counter()
            args = (job.state.params, job.batch.tokens(), job.model_cfg, grpo.temperature, cfg.micro_batches)
            compiled = token_logprobs.lower(*args).compile(compiler_options=options)
            print(f"reference compiled in {time.perf_counter() - start:.0f} s", flush=True)
            out["reference"] = (compiled.as_text(), _memory(compiled, job.resident["params"]))
    return out, job.resident


def _memory(compiled, counted: int) -> dict[str, int]:
    """The executable's memory per chip and its phase's bytes beyond ``counted`` (as ``compile_check._extra``)."""
    m = compiled.memory_analysis()
    out = {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
    }
    out["phase"] = out["arguments"] - counted + out["temporaries"] + out["outputs"] - out["aliased"]
    return out


def print_memory(memory: dict[str, dict[str, int]], resident: dict[str, int]) -> None:
    """Each program's memory, the resident arrays and their peak without the rollout (compiled by the whole job)."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    print(f"resident arrays {gib(sum(resident.values()))} per chip: "
          + ", ".join(f"{k} {gib(v)}" for k, v in resident.items()))  # fmt: skip
    for name, m in memory.items():
        print(f"{name}: " + ", ".join(f"{k} {gib(v)}" for k, v in m.items() if k != "phase")
              + f"; phase beyond the resident arrays {gib(m['phase'])} ({m['phase']:,} bytes)")  # fmt: skip
    resident, phase = sum(resident.values()), max(m["phase"] for m in memory.values())
    print(f"peak of the update and the reference pass: {gib(resident + phase)} per chip (resident + largest "
          "phase; the whole job's peak also weighs the rollout phase: grpax train_rl ... compile_topology=...)")  # fmt: skip


def top_collectives(text: str, num_devices: int, n: int) -> list[str]:
    """The ``n`` collectives that move the most bytes per chip in a program, by kind, array and the JAX op that
    made them (its ``op_name``), loop trips counted and an async collective fusion chain counted once, as
    ``grpax.plan.collectives.count_collectives`` does."""
    import collections
    import re

    from grpax.plan import collectives as c

    executed, _ = c.executed_collectives(text, num_devices)
    rows = collections.defaultdict(lambda: [0, 0.0])
    for kind, type_text, rest, times in executed:
        op = re.search(r'op_name="([^"]*)"', rest)
        key = (kind, type_text.split("{")[0], c._group_size(rest, num_devices), op.group(1) if op else "")
        rows[key][0] += times
        rows[key][1] += times * c._array_bytes(type_text)
    top = sorted(rows.items(), key=lambda r: -r[1][1])[:n]
    return [f"  {k[0]} {k[1]} over {k[2]} chips: {count} x, {size / 1e9:.3f} GB (arrays), {k[3][-90:]}"
            for k, (count, size) in top]  # fmt: skip


def report(cfg: TrainConfig, texts: dict[str, str], top: int = 0) -> None:
    """Prints each program's collectives per chip, their ICI time and FSDP's minimum."""
    from grpax.plan.collectives import count_collectives, fsdp_minimum
    from grpax.plan.compile_check import model_config

    topology = get_topology(cfg.compile_topology, 1, cfg.chips_per_vm or 0)
    model_cfg = model_config(cfg)
    mesh = sharding.create_mesh(dataclasses.replace(cfg.mesh(), chips_per_vm=0), topology.devices).shape
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(model_cfg)))
    itemsize = jnp.dtype(model_cfg.dtype).itemsize
    ici = topology.chip.ici_bandwidth
    ici_seconds = {}
    for name, text in texts.items():
        counted, unknown = count_collectives(text, topology.num_chips)
        total = sum(c.bytes_per_chip for c in counted.values())
        passes, grads = (2, True) if name == "update" else (1, False)
        minimum = fsdp_minimum(num_params, itemsize, mesh["fsdp"], mesh["tensor"], passes, grads)
        kinds = ", ".join(f"{k} {c.count} x {c.bytes_per_chip / 1e9:.3f} GB" for k, c in counted.items())
        ici_seconds[name] = total / ici
        print(
            f"{name}: {total / 1e9:.2f} GB per chip, {total / ici:.4f} s at {ici / 1e9:.0f} GB/s ICI; FSDP's minimum "
            f"{minimum / 1e9:.2f} GB ({total / minimum:.2f}x); {kinds}"
            + (f" ({unknown} loops of unknown trip count counted once)" if unknown else "")
        )
        if top:
            print("\n".join(top_collectives(text, topology.num_chips, top)))
    print_step_bound(cfg, topology, ici_seconds)


def print_step_bound(cfg: TrainConfig, topology, ici_seconds: dict[str, float]) -> None:
    """The counted lower bound of a step (``compile_check.step_count``: FLOPs and HBM bytes from the shapes), and
    the same bound with each counted program's ICI time as a third floor of its phase."""
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    meshes = (
        sharding.create_mesh(mesh_cfg, topology.devices),
        sharding.create_rollout_mesh(mesh_cfg, topology.devices),
    )
    job = compile_check.build_job(cfg, *meshes)
    chip = topology.chip
    phases = compile_check.step_count(job, topology.num_chips, chip.peak_flops, chip.hbm_bandwidth)
    names = {"update": "update", "reference": "reference logprobs"}
    with_ici = {names.get(k, k): v for k, v in ici_seconds.items()}
    counted = sum(p.seconds for p in phases)
    bound = sum(max(p.seconds, with_ici.get(p.name, 0.0)) for p in phases)
    print(
        "step lower bound: " + ", ".join(f"{p.name} {p.seconds:.3f} s" for p in phases)
        + f"; total {counted:.3f} s at the chips' peak FLOP/s and HBM bandwidth; {bound:.3f} s with the ICI time of "
        + " and ".join(with_ici) + " as a floor of their phases"
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--save_hlo", default="", help="folder to write update.hlo, reference.hlo, memory.json into"
    )
    ap.add_argument("--no_count", action="store_true", help="compile and save only (another commit's tree)")
    ap.add_argument("--update_only", action="store_true", help="skip the reference pass")
    ap.add_argument("--top", type=int, default=0, help="also list each program's N largest collectives by op")
    ap.add_argument("--count", default="", help="count the .hlo files saved in this folder; compile nothing")
    ap.add_argument(
        "--compiler_option", action="append", default=[], metavar="KEY=VALUE",
        help="an XLA / libtpu compiler option for both programs (repeatable), e.g. "
        "xla_tpu_enable_async_collective_fusion=false: an experiment, not what a run compiles",
    )  # fmt: skip
    args, keys = ap.parse_known_args()
    cfg = build_config(TrainConfig, keys)
    if args.count:
        if (saved := Path(args.count) / "memory.json").exists():
            print_memory(**json.loads(saved.read_text()))
        report(cfg, {p.stem: p.read_text() for p in sorted(Path(args.count).glob("*.hlo"))}, args.top)
        return
    if bad := [kv for kv in args.compiler_option if "=" not in kv]:
        ap.error(
            f"--compiler_option {bad[0]!r}: write KEY=VALUE, e.g. xla_tpu_enable_async_collective_fusion=false"
        )
    options = dict(kv.split("=", 1) for kv in args.compiler_option) or None
    programs, resident = compile_programs(cfg, args.update_only, options)
    memory = {name: m for name, (_, m) in programs.items()}
    print_memory(memory, resident)
    if args.save_hlo:
        Path(args.save_hlo).mkdir(parents=True, exist_ok=True)
        for name, (text, _) in programs.items():
            (Path(args.save_hlo) / f"{name}.hlo").write_text(text)
        (Path(args.save_hlo) / "memory.json").write_text(json.dumps({"memory": memory, "resident": resident}))
    if not args.no_count:
        report(cfg, {name: text for name, (text, _) in programs.items()}, args.top)


if __name__ == "__main__":
    main()
