"""The sampler's decode loop compiled for a TPU slice: its temporaries per chip and the copies in its HLO.

Compiles only the rollout engine's decode program (``grpax.sampler.program_set.compiled_decode``, all rows of a step in
flight over the default page pool: the program ``compile_topology`` sizes) of a ``grpax train_rl`` job for
``compile_topology`` with the real TPU compiler (the ``tpu`` extra's libtpu; no TPU and no weights needed), from
abstract page pools placed as the engine places them, and prints per chip
the decode's temporaries and arguments, and the data movement the compiler left in the program: every
``copy`` / ``copy-start`` into HBM (prefetches into on-chip memory, memory space 1, are not counted; write-backs
of a buffer staged there are, and are also shown apart) and every
fusion whose output is at least ``--min_mib`` MiB (weight- or cache-sized),
inside the decode loops (executed at every step) and outside them (once per call), with their bytes. Faster
than the whole job's compile (no update, no prefill).

To compare with another commit, save its HLO there and count it here (the same counter for both):

  PYTHONPATH=<other worktree> python benchmarks/decode_compile.py --save_hlo /tmp/before --no_count \\
      model_name=llama3.2-1b compile_topology=v6e-8
  python benchmarks/decode_compile.py --count /tmp/before/decode.hlo model_name=llama3.2-1b compile_topology=v6e-8

Usage: python benchmarks/decode_compile.py [--save_hlo DIR] [--no_count] [--count FILE] [--min_mib 16] KEY=VALUE...
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path

import jax

from grpax import sharding
from grpax.config import build_config
from grpax.plan import compile_check
from grpax.plan.topology import get_topology
from grpax.rl.train_config import TrainConfig
from grpax.sampler import program_set
from grpax.sampler.backend import select_backend

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8}
_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|f32|s32|u32|f64)\[([0-9,]*)\]")
_COPIES = ("copy", "copy-start", "write-back")  # the kinds counted as copies in HBM
# A fusion that only slices a loop carry (a layer cut out of stacked weights, materialised instead of read in place)
_SLICE = re.compile(r'op_name="[^"]*/while/body/slice"')
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.+?) (copy|copy-start|fusion|dynamic-update-slice)\(")


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def _computations(text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            out[name] = []
        elif name is not None and line.startswith(" "):
            out[name].append(line)
    return out


def count_moves(text: str, min_bytes: int) -> dict[str, list[tuple[str, str, int]]]:
    """The copies and large fusions of the decode's HLO, split into those inside a while loop's body (every
    step) and those outside: {"loop": [(kind, name, bytes)], "once": [...]}. A fusion of the loop body's own
    slices (``while/body/slice``: per-layer weights cut out of stacked ones and written out) is of kind
    "slice"."""
    comps = _computations(text)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    # computations called from a body (fusions, nested calls) belong to it; the kinds are counted where called
    out = {"loop": [], "once": []}
    for name, lines in comps.items():
        if name.startswith(("fused_", "wrapped_")) or ".clone" in name and name not in bodies:
            continue
        where = "loop" if name in bodies else "once"
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            kind, result = m.group(4), m.group(3)
            if kind == "copy-start":  # (destination, source, context), as copy-done's result shows
                destination, source = result.split("}, ")[:2]
                result = destination + "}"
                if "S(1)" in source and "S(1)" not in result:
                    kind = "write-back"  # a buffer staged in VMEM (and changed there) copied back to HBM
            if kind == "fusion" and _SLICE.search(line):
                kind = "slice"
            if kind in ("copy", "copy-start") and "S(1)" in result:
                kind = "to on-chip memory"  # a prefetch into VMEM (memory space 1), not an HBM copy
            size = _bytes(result)
            if kind in _COPIES or size >= min_bytes:
                out[where].append((kind, m.group(2), size))
    return out


def topology_job(cfg: TrainConfig, num_layers: int = 0):
    """``compile_check.build_job`` on ``cfg.compile_topology``'s devices, as ``compile_topology`` builds it
    (``num_layers``: the model cut to that many layers, for a quicker look; 0 = all). Only APIs an older grpax
    has too, so the scripts that import it also run under a parent commit's tree."""
    topology = get_topology(cfg.compile_topology, 1, cfg.chips_per_vm or 0)
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    meshes = sharding.create_meshes(mesh_cfg, topology.devices)
    model_cfg = compile_check.model_config(cfg)
    if num_layers:
        model_cfg = dataclasses.replace(model_cfg, num_layers=num_layers)
    return compile_check.build_job(cfg, *meshes, model_cfg)


def compile_decode(cfg: TrainConfig, num_layers: int = 0) -> tuple[str, object]:
    """(the decode's optimised HLO text, its memory analysis) compiled for ``cfg.compile_topology``
    (``num_layers`` as in ``topology_job``): the rollout engine's decode program on every row of a step at once,
    over the default page pool (``grpax.sampler.program_set.abstract_programs``)."""
    job = topology_job(cfg, num_layers)
    model_cfg, sc, mesh = job.model_cfg, job.sampler_cfg, job.rollout_mesh
    params = job.rollout_params
    backend = select_backend(sc.backend, params, model_cfg, sc.cache_dtype, concrete=False)
    rows = cfg.grpo().num_generations
    fn, args, kwargs = program_set.abstract_programs(params, model_cfg, sc, backend, cfg.batch_size, rows)[
        "decode"
    ]
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = fn.lower(*args, **kwargs).compile()
        print(f"decode compiled in {time.perf_counter() - start:.0f} s", flush=True)
    return compiled.as_text(), compiled.memory_analysis()


def report(
    text: str, min_bytes: int, loop_label: str = "inside the decode loops (every step)", shown: int = 12
) -> None:
    """Prints ``count_moves``'s copies and large ops inside the program's loops and outside them."""
    moves = count_moves(text, min_bytes)
    for where, label in (("loop", loop_label), ("once", "outside them (once)")):
        items = moves[where]
        copies = [m for m in items if m[0] in _COPIES]
        backs = [m for m in items if m[0] == "write-back"]
        big = sorted((m for m in items if m[2] >= min_bytes), key=lambda m: -m[2])
        slices = [m for m in big if m[0] == "slice"]
        print(
            f"{label}: {len(copies)} copies, {sum(m[2] for m in copies) / 2**30:.3f} GiB (write-backs from VMEM: "
            f"{len(backs)}, {sum(m[2] for m in backs) / 2**30:.3f} GiB); "
            f"{len(big)} ops with an output >= {min_bytes / 2**20:g} MiB, {sum(m[2] for m in big) / 2**30:.3f} GiB "
            f"(slices: {len(slices)}, {sum(m[2] for m in slices) / 2**30:.3f} GiB)"
        )
        for kind, name, size in big[:shown]:
            print(f"    {kind:<22}{name:<48}{size / 2**20:>10.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save_hlo", default="", help="folder to write decode.hlo into")
    ap.add_argument("--no_count", action="store_true", help="compile and save only (another commit's tree)")
    ap.add_argument("--count", default="", help="count this saved .hlo file; compile nothing")
    ap.add_argument("--num_layers", type=int, default=0, help="cut the model to this many layers (0 = all)")
    ap.add_argument(
        "--min_mib", type=float, default=16.0, help="list ops whose output is at least this large"
    )
    args, keys = ap.parse_known_args()
    cfg = build_config(TrainConfig, keys)
    min_bytes = int(args.min_mib * 2**20)
    if args.count:
        report(Path(args.count).read_text(), min_bytes)
        return
    text, memory = compile_decode(cfg, args.num_layers)
    print(
        f"decode per chip: temporaries {memory.temp_size_in_bytes / 2**30:.3f} GiB "
        f"({memory.temp_size_in_bytes:,} bytes), arguments {memory.argument_size_in_bytes / 2**30:.3f} GiB, "
        f"outputs {memory.output_size_in_bytes / 2**30:.3f} GiB, aliased {memory.alias_size_in_bytes / 2**30:.3f} GiB"
    )
    if args.save_hlo:
        Path(args.save_hlo).mkdir(parents=True, exist_ok=True)
        (Path(args.save_hlo) / "decode.hlo").write_text(text)
    if not args.no_count:
        report(text, min_bytes)


if __name__ == "__main__":
    main()
