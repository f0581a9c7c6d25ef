"""The chip-to-chip traffic of a compiled program, counted from its optimised HLO text.

``compile_topology`` compiles the GRPO update and the reference pass for a TPU slice; their ``as_text()`` is
the partitioned, per-chip program. This module counts its collectives (all-gather, reduce-scatter, all-reduce,
all-to-all, collective-permute) and the bytes each moves per chip, each multiplied by how many times it runs:
a collective inside a ``while`` loop (scanned layers, micro-batches, logit chunks) runs once per trip, and the
compiler's own ``cost_analysis()`` counts a loop body once. The TPU compiler emits a reduce-scatter as a fusion
named ``all-reduce-scatter...`` holding an all-reduce and a slice: it is counted as the reduce-scatter it is.

The TPU compiler's async collective fusion (the v5e default; ``xla_tpu_enable_async_collective_fusion*``) spreads
one collective over a chain of fusions so that its transfer overlaps compute: a start fusion (custom call
``AsyncCollectiveStart``), continuation fusions that each run a compute op and advance the transfer, and a done
fusion (``AsyncCollectiveDone``). Each fusion of the chain holds a copy of the collective with the same
``channel_id`` and ``async_collective_fusion_config`` in its backend config, the shard and the gathered buffer
are threaded through them (aliased), and only the start's copy has ``flag_start`` -1: the chain is one transfer,
counted once per execution of its start.

Bytes per chip follow the ring algorithms over a group of g chips, for an array of S bytes: an all-gather
receives S (g - 1) / g (S its output), a reduce-scatter sends S (g - 1) / g (S its input), an all-reduce
2 S (g - 1) / g, an all-to-all S (g - 1) / g, a collective-permute S. Their time at the chip's ICI bandwidth is
a lower bound of the time they take (links are shared, latency is left out).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]+[a-z0-9]*|pred)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CONSTANT = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+constant\((-?\d+)\)")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Collective:
    """One kind of collective in a program: executions (loop trips counted) and bytes moved per chip."""

    count: int = 0
    bytes_per_chip: float = 0.0


def _array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (``bf16[8,64]{1,0}`` or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _group_size(attributes: str, num_devices: int) -> int:
    """Chips in each replica group: ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` or ``mesh['axis_0'=8] {'axis_0'}``."""
    if m := re.search(r"replica_groups=\{(\{[0-9,]*\})", attributes):
        return len(m.group(1).strip("{}").split(","))
    if m := re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]", attributes):
        return int(m.group(2))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes):
        sizes = {k.strip().strip("'"): int(v) for k, v in (p.split("=") for p in m.group(1).split(","))}
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
    return num_devices  # no groups: every device


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                computations[current] = []
                entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        else:
            computations[current].append(line)
    return computations, entry


def _trip_count(condition: list[str]) -> int | None:
    """N of a loop condition ``i < N`` (the form ``lax.scan`` / ``fori_loop`` compile to), or None."""
    constants = {m.group(1): int(m.group(2)) for line in condition if (m := _CONSTANT.match(line))}
    for line in condition:  # the compare, or a fusion wrapping it (XLA:CPU)
        less = " compare(" in line and "direction=LT" in line
        if less or (line.lstrip().startswith("ROOT") and "compare" in line and "/lt" in line):
            for ref in re.findall(r"%([\w.\-]+)", line.split("(", 1)[1]):
                if ref in constants:
                    return constants[ref]
    return None


def executed_collectives(hlo_text: str, num_devices: int) -> tuple[list[tuple[str, str, str, int]], int]:
    """Each collective instruction of a compiled program that moves bytes, with how many times it runs.

    Args:
      hlo_text: the optimised, partitioned HLO module (one chip's program).
      num_devices: devices of the program (the group of a collective without replica groups).

    Returns:
      ([(kind, its result type text, the rest of its instruction line, executions)], loops whose trip count was
      not found and were counted once). The copies of an async collective fusion chain are one entry (the
      module docstring); a conditional's branches are all counted (the update's optimizer branch is the one
      that runs).
    """
    computations, entry = _computations(hlo_text)
    callees: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    unknown = 0
    for name, lines in computations.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            op, rest = m.group(3), m.group(4)
            if op == "while":
                body = re.search(r"body=%([\w.\-]+)", rest).group(1)
                trips = _trip_count(computations.get(re.search(r"condition=%([\w.\-]+)", rest).group(1), []))
                unknown += trips is None
                callees[name].append((body, trips or 1))
                continue
            for callee in re.findall(r"(?:calls|true_computation|false_computation)=%([\w.\-]+)", rest):
                callees[name].append((callee, 1))
            if branches := re.search(r"branch_computations=\{([^}]*)\}", rest):
                callees[name] += [(callee, 1) for callee in re.findall(r"%([\w.\-]+)", branches.group(1))]
    runs: collections.Counter[str] = collections.Counter()

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee, trips in callees.get(name, ()):
            visit(callee, times * trips)

    visit(entry, 1)
    out: list[tuple[str, str, str, int]] = []
    # (kind, channel_id) of a chain: (kind, type, rest, runs of its start, runs of its other copies)
    chains: dict[tuple[str, str], tuple[str, str, str, list[int], list[int]]] = {}
    for name, lines in computations.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not runs[name] or not m or m.group(3).removesuffix("-start") not in KINDS:
                continue
            kind = m.group(3).removesuffix("-start")
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # the TPU compiler's reduce-scatter fusion: all-reduce + slice
            type_text, rest = m.group(2), m.group(4)
            if m.group(3).endswith("-start") and type_text.startswith("("):  # (operand, result, ...)
                type_text = max((f"{d}[{s}]" for d, s in _ARRAY.findall(type_text)), key=_array_bytes)
            step = re.search(r'"async_collective_fusion_config":\{"flag_start":"(-?\d+)"', rest)
            channel = re.search(r"channel_id=(\d+)", rest)
            if step and channel:  # one copy of an async collective fusion chain
                chain = chains.setdefault((kind, channel.group(1)), (kind, type_text, rest, [], []))
                chain[3 if step.group(1) == "-1" else 4].append(runs[name])
                continue
            out.append((kind, type_text, rest, runs[name]))
    for kind, type_text, rest, starts, copies in chains.values():
        out.append((kind, type_text, rest, sum(starts) if starts else max(copies)))
    return out, unknown


def bytes_moved(kind: str, type_text: str, rest: str, num_devices: int) -> float:
    """Bytes per chip one execution of a collective moves (the ring algorithms of the module docstring)."""
    size = _array_bytes(type_text)
    g = _group_size(rest, num_devices)
    return {"all-reduce": 2 * size * (g - 1) / g, "collective-permute": size}.get(kind, size * (g - 1) / g)


def count_collectives(hlo_text: str, num_devices: int) -> tuple[dict[str, Collective], int]:
    """The collectives of a compiled program (``compiled.as_text()``), loop trips counted.

    Args:
      hlo_text: the optimised, partitioned HLO module (one chip's program).
      num_devices: devices of the program (the group of a collective without replica groups).

    Returns:
      ({kind: Collective} for the kinds in ``KINDS`` that occur, loops whose trip count was not found and were
      counted once). A conditional's branches are all counted (the update's optimizer branch is the one that
      runs); an async collective fusion chain counts once (the module docstring).
    """
    executed, unknown = executed_collectives(hlo_text, num_devices)
    out: dict[str, Collective] = {}
    for kind, type_text, rest, times in executed:
        c = out.setdefault(kind, Collective())
        c.count += times
        c.bytes_per_chip += times * bytes_moved(kind, type_text, rest, num_devices)
    return {k: out[k] for k in KINDS if k in out}, unknown


def fsdp_minimum(num_params: int, itemsize: int, fsdp: int, tensor: int, passes: int, grads: bool) -> float:
    """Bytes per chip of FSDP's own minimum: each weight gathered once per pass over the ``fsdp`` axis and,
    with ``grads``, its gradient reduce-scattered once, both in the compute dtype (the compiler reduces a
    pass's gradient before converting it to the float32 sum).

    Args:
      num_params: weights of the model.
      itemsize: bytes of the compute dtype (2 for bfloat16).
      fsdp, tensor: the mesh's fsdp and tensor sizes (a chip holds 1 / tensor of each gathered weight).
      passes: weight passes: 1 for a forward (the reference), 2 for forward + backward (the update).
      grads: add the gradient's reduce-scatter.
    """
    per_pass = num_params * itemsize * (fsdp - 1) / fsdp / tensor
    return (passes + grads) * per_pass
