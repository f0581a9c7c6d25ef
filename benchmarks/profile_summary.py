"""Where the time of a traced call goes, as text: top kernels, kernels per step, idle gaps, shares by scope.

Reads the ``*.xplane.pb`` that ``jax.profiler.trace`` writes with ``jax.profiler.ProfileData``, jaxlib's own
reader (no TensorBoard, no protobuf definitions: what the H200 image's JAX 0.11.2 has; JAX 0.10.2 on CPU reads
it too). The events:

* GPU: the kernels and copies on the device plane's ``Stream`` lines (CUPTI). XLA annotates each kernel launch
  "Thunk:#name=<JAX name stack>,hlo_op=<HLO instruction>#" inside "XlaModule:#hlo_module=<module>,...#"; the
  reader takes these from any stat that carries them (``hlo_op`` / ``hlo_module`` / ``tf_op`` stats or the
  annotation string), so it does not depend on one stat's name;
* TPU: the device plane's "XLA Ops" line, each event named by its HLO instruction's text ("%fusion.3 = bf16[...]
  fusion(...), kind=kOutput, calls=..."; no name stack: the caller's HLO text gives it), inside the "XLA Modules"
  line's module ("jit_step(<id>)"); a ``while``'s event spans its body's, so control flow is left out;
* CPU (no device plane): the host threads' XLA thunks (events with an ``hlo_op`` stat), without the control-flow
  thunks (``while``, ``conditional``, ``call``) that contain the others.

An event without a name stack gets one from the compiled module's HLO text when the caller passes it
(``metadata={op_name=...}`` of its instruction, or the commonest one of the computation a fusion calls).
The name stack gives each event its scope: the innermost of the named scopes in ``SCOPES`` (the model's
``jax.named_scope``s in ``grpax.models.llama``, the sampler's in ``grpax.sampler.engine`` and ``sampling``),
and its pass in an update (forward ``jvp``, backward ``transpose``, recompute ``rematted_computation``). The
kernel's name gives its kind (matmul, sort, copy, ...). With command buffers (CUDA graphs) XLA runs the captured
kernels one by one while a profiler is active, so a trace shows the kernels, not the graph's launch savings.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
from pathlib import Path

# Named scope -> the category its time is reported under (innermost scope of an op's name stack wins).
SCOPES: dict[str, str] = {
    "top_k": "sampling: top-k",
    "top_p": "sampling: top-p",
    "draw": "sampling: draw",
    "rng": "sampling: rng",
    "logprobs": "sampling: logprobs",
    "sampling": "sampling: other",
    "record": "stop bookkeeping",
    "kv_cache": "kv cache write",
    "attention": "attention",
    "qkv": "qkv (norm + matmul)",
    "rope": "rope",
    "attention_out": "attention out (matmul)",
    "mlp": "mlp (norm + matmuls)",
    "logits": "lm head (matmul)",
}
# Kernel kinds, by the kernel's or the HLO instruction's name (first match).
KINDS: tuple[tuple[str, re.Pattern], ...] = (
    (
        "matmul",
        re.compile(r"gemm|gemv|nvjet|cublas|cutlass|xmma|wgmma|matmul|\bdot\b|^dot|convolution", re.I),
    ),
    ("sort / top-k", re.compile(r"sort|radix|topk|top_k|select_k|bitonic", re.I)),
    (
        "copy / scatter",
        re.compile(r"^memcpy|^memset|^copy|copy-start|copy_|dynamic.update.slice|scatter", re.I),
    ),
    ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all-to-all|collective", re.I)),
)
_CONTROL = ("while", "conditional", "call")
_FIELD = {key: re.compile(rf"(?:^|[#,:]){key}=([^,#]+)") for key in ("hlo_op", "hlo_module", "name")}


@dataclasses.dataclass
class Event:
    """One kernel (or XLA thunk, on CPU): its name, times in ns, the line it ran on, and what XLA says of it."""

    name: str
    start_ns: float
    dur_ns: float
    line: str
    hlo_op: str = ""
    module: str = ""
    op_name: str = ""  # the JAX name stack ("" when unknown)
    inside: str = ""  # the opcodes and custom-call targets of its HLO instruction, when the HLO text is known


def find_xplane(folder: str | Path) -> Path | None:
    """The newest ``*.xplane.pb`` under ``folder`` (``jax.profiler.trace``'s plugins/profile/<run>/), or None."""
    found = sorted(Path(folder).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _stat_fields(stats: dict) -> dict[str, str]:
    """hlo_op / hlo_module / op_name of an event from its stats: direct stats first, then any annotation string."""
    out = {}
    for key, stat in (("hlo_op", "hlo_op"), ("hlo_module", "hlo_module"), ("op_name", "tf_op")):
        if isinstance(stats.get(stat), str) and stats[stat]:
            out[key] = stats[stat]
    for value in stats.values():
        if not isinstance(value, str) or "=" not in value:
            continue
        for key, pattern in _FIELD.items():
            found = pattern.findall(value)  # nested annotations "outer::inner": the innermost is the kernel's
            field = "op_name" if key == "name" else key
            if found and field not in out:
                out[field] = found[-1].strip()
    return out


def read_events(path: str | Path) -> tuple[list[Event], str]:
    """``read_events_from`` of one ``.xplane.pb`` file."""
    from jax.profiler import ProfileData  # jaxlib's reader; imported here so the module loads without JAX

    return read_events_from(ProfileData.from_file(str(path)))


def read_events_from(data) -> tuple[list[Event], str]:
    """(events, where they came from) of a ``jax.profiler.ProfileData``: the device's kernels, else the host's
    XLA thunks."""
    planes = list(data.planes)
    devices = [p for p in planes if p.name.startswith("/device:") and not p.name.startswith("/device:CPU")]
    events: list[Event] = []
    if devices:
        plane = devices[0]
        lines = list(plane.lines)
        ops = [line for line in lines if line.name == "XLA Ops"]
        streams = [line for line in lines if line.name.startswith("Stream")]
        chosen = ops or streams or lines
        modules = _module_spans(lines)
        for line in chosen:
            for e in line.events:
                fields = _stat_fields(dict(e.stats))
                name, hlo_op, inside = e.name, fields.get("hlo_op", e.name if ops else ""), ""
                if instruction := _INSTRUCTION.match(e.name):  # a TPU's op: its HLO instruction's text
                    name = hlo_op = instruction.group(1)
                    inside = " ".join(_instruction_ops(instruction.group(2)))
                module = fields.get("hlo_module") or _module_at(modules, e.start_ns)
                events.append(
                    Event(name, e.start_ns, e.duration_ns, line.name, hlo_op, module, fields.get("op_name", ""),
                          inside)
                )  # fmt: skip
        where = f"{plane.name}: {len(chosen)} line(s) ({', '.join(line.name for line in chosen[:4])})"
        return events, where
    for plane in planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" not in stats or e.name.startswith("end: "):
                    continue
                fields = _stat_fields(stats)
                events.append(
                    Event(e.name, e.start_ns, e.duration_ns, line.name, fields.get("hlo_op", e.name),
                          fields.get("hlo_module", ""), fields.get("op_name", ""))
                )  # fmt: skip
    return events, "host XLA thunks (no device plane)"


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")


def _instruction_ops(rest: str) -> list[str]:
    """The opcode and custom-call target of one HLO instruction's text after its ``=`` (a TPU op's event name)."""
    return [m.group(1) for m in (_OPCODE.search(rest), _TARGET.search(rest)) if m]


def _module_spans(lines) -> list[tuple[float, float, str]]:
    """(start ns, end ns, module name) of a device plane's "XLA Modules" line (a TPU's: "jit_step(<id>)" ->
    "jit_step", the name of the module's HLO text), sorted by start."""
    spans = [
        (e.start_ns, e.start_ns + e.duration_ns, e.name.split("(")[0])
        for line in lines
        if line.name == "XLA Modules"
        for e in line.events
    ]
    return sorted(spans)


def _module_at(spans: list[tuple[float, float, str]], t: float) -> str:
    """The module whose span holds time ``t`` ("" if none)."""
    for start, end, name in spans:
        if start <= t <= end:
            return name
    return ""


_OPCODE = re.compile(r" ([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def hlo_instructions(text: str) -> dict[str, tuple[str, str, str]]:
    """{instruction: (opcode, op_name, what it computes)} of an HLO module's text. A fusion without metadata
    takes the commonest op_name of the computation it calls; "what it computes" lists the opcodes and
    custom-call targets inside (for ``kind_of``: a fusion holding a ``dot`` is a matmul)."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            computations[name] = []
        elif name is not None and line.startswith(" "):
            computations[name].append(line)

    def ops(lines: list[str]) -> set[str]:
        found = set()
        for line in lines:
            found.update(m.group(1) for m in [_OPCODE.search(line), _TARGET.search(line)] if m)
        return found

    out = {}
    for lines in computations.values():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            rest = match.group(2)
            opcode, op_name = _OPCODE.search(rest), _OP_NAME.search(rest)
            called = computations.get(m.group(1), []) if (m := _CALLS.search(rest)) else []
            if not op_name and called:  # a fusion: the name its instructions share most
                names = [m.group(1) for line in called if (m := _OP_NAME.search(line))]
                op_name = collections.Counter(names).most_common(1)[0][0] if names else ""
            else:
                op_name = op_name.group(1) if op_name else ""
            inside = " ".join(sorted(ops([line]) | ops(called)))
            out[match.group(1)] = (opcode.group(1) if opcode else "", op_name, inside)
    return out


def module_name(hlo_text: str) -> str:
    """The module's name from its text's ``HloModule <name>, ...`` header (what a trace's events name)."""
    match = re.match(r"\s*HloModule ([\w.\-]+)", hlo_text)
    return match.group(1) if match else ""


def attribute(events: list[Event], hlo_texts: dict[str, str] | None) -> list[Event]:
    """The events with op_names filled from ``hlo_texts`` ({module name: optimised HLO text}) where the trace
    had none, and without the control-flow thunks that contain other events (a CPU trace's ``while``)."""
    tables = {module: hlo_instructions(text) for module, text in (hlo_texts or {}).items()}
    merged: dict[str, tuple[str, str, str]] = {}
    for table in tables.values():
        merged.update(table)
    kept = []
    for e in events:
        table = tables.get(e.module) or merged
        if not e.hlo_op:  # no annotation: XLA names a kernel after its instruction ("loop_fusion.3" -> "_3")
            e.hlo_op = next((n for n in (e.name, re.sub(r"_(\d+)$", r".\1", e.name)) if n in table), "")
        opcode, op_name, inside = table.get(e.hlo_op, ("", "", ""))
        opcode = opcode or (e.inside.split() or [""])[0]  # a TPU op's own text names its opcode
        if opcode in _CONTROL or (not opcode and e.hlo_op.split(".")[0] in _CONTROL):
            continue
        if not e.op_name and op_name:
            e.op_name = op_name
        e.inside = inside or e.inside
        kept.append(e)
    return kept


def scope_of(op_name: str) -> str:
    """The category of an op's name stack: its innermost scope in ``SCOPES``, the loop's condition, or other."""
    parts = [p for p in re.split(r"/", op_name) if p]
    for part in reversed(parts):
        if part in SCOPES:
            return SCOPES[part]
    if "cond" in parts and "while" in parts:
        return "loop condition"
    return "other (no scope)" if op_name else "unattributed"


def pass_of(op_name: str) -> str:
    """forward / backward / recompute (remat) / other, from an update op's name stack."""
    if "rematted_computation" in op_name:
        return "recompute (remat)"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "other (optimizer, loss, ...)"


def kind_of(e: Event) -> str:
    """The kernel's kind (``KINDS``) by its name, its HLO instruction's name, then what that instruction holds."""
    for text in (e.name, e.hlo_op, e.inside):
        for kind, pattern in KINDS:
            if text and pattern.search(text):
                return kind
    return "other kernels"


def _shares(events: list[Event], key) -> list[tuple[str, float]]:
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        totals[key(e)] += e.dur_ns
    whole = sum(totals.values()) or 1.0
    return sorted(((k, v / whole) for k, v in totals.items()), key=lambda kv: -kv[1])


def _gaps(events: list[Event]) -> tuple[float, float, list[float]]:
    """(window ns, busy ns, idle gaps ns) of the events' union of intervals."""
    spans = sorted((e.start_ns, e.start_ns + e.dur_ns) for e in events)
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, t in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, t
        else:
            end = max(end, t)
    busy += end - start
    return spans[-1][1] - spans[0][0] if spans else 0.0, busy, gaps


def summarize(
    events: list[Event], title: str, steps: int = 0, modules: tuple[str, ...] = (), by_pass: bool = False,
    top: int = 12,
) -> tuple[str, dict]:  # fmt: skip
    """A text summary and its figures, of the events whose module contains one of ``modules`` (all if ()).

    Args:
      events: ``attribute``'s events.
      title: the first line.
      steps: loop steps the selected events ran (decode steps), for the per-step figures; 0 = not a loop.
      modules: substrings of the module names to keep (an event without a module is kept inside their window).
      by_pass: add the update's split by pass (forward / backward / recompute).
      top: kernels listed.

    Returns:
      (text, figures): figures holds ``kernels``, ``kernels_per_step``, ``busy_fraction``, ``idle_gap_us_median``,
      ``shares`` {scope: fraction of kernel time}, ``kinds`` {kind: fraction}, ``passes`` when by_pass.
    """
    chosen = [e for e in events if not modules or any(m in e.module for m in modules)]
    if modules and chosen:
        lo, hi = min(e.start_ns for e in chosen), max(e.start_ns + e.dur_ns for e in chosen)
        chosen += [e for e in events if not e.module and lo <= e.start_ns <= hi]
    elif modules and events:  # the trace names no module: every event, said so
        title, chosen = f"{title} (no event names a module of {', '.join(modules)}: all events)", list(events)
    if not chosen:
        return f"{title}: no events in the trace", {"kernels": 0}
    window, busy, gaps = _gaps(chosen)
    total = sum(e.dur_ns for e in chosen)
    figures: dict = {
        "kernels": len(chosen),
        "kernel_ms": total / 1e6,
        "window_ms": window / 1e6,
        "busy_fraction": busy / window if window else 1.0,
        "idle_gaps": len(gaps),
        "idle_gap_us_median": statistics.median(gaps) / 1e3 if gaps else 0.0,
        "shares": dict(_shares(chosen, lambda e: scope_of(e.op_name))),
        "kinds": dict(_shares(chosen, kind_of)),
    }
    lines = [
        f"{title}: {len(chosen):,} kernels, {total / 1e6:,.1f} ms of kernel time in a {window / 1e6:,.1f} ms window"
        f" ({figures['busy_fraction']:.1%} busy); idle: {len(gaps):,} gaps, {(window - busy) / 1e6:,.2f} ms, "
        f"median {figures['idle_gap_us_median']:.1f} us, largest {max(gaps, default=0) / 1e3:,.1f} us"
    ]
    if steps:
        figures["kernels_per_step"] = len(chosen) / steps
        figures["step_ms"] = window / steps / 1e6
        lines.append(
            f"  per step ({steps} steps): {len(chosen) / steps:,.1f} kernels, {window / steps / 1e6:.3f} ms "
            f"({total / steps / 1e6:.3f} ms of kernels, {(window - busy) / steps / 1e3:,.1f} us idle)"
        )
    lines.append("  by scope: " + " | ".join(f"{k} {v:.1%}" for k, v in figures["shares"].items()))
    lines.append("  by kind:  " + " | ".join(f"{k} {v:.1%}" for k, v in figures["kinds"].items()))
    if by_pass:
        figures["passes"] = dict(_shares(chosen, lambda e: pass_of(e.op_name)))
        lines.append("  by pass:  " + " | ".join(f"{k} {v:.1%}" for k, v in figures["passes"].items()))
    groups: dict[tuple[str, str], list[Event]] = collections.defaultdict(list)
    for e in chosen:
        groups[(e.name, e.hlo_op)].append(e)
    ranked = sorted(groups.items(), key=lambda kv: -sum(e.dur_ns for e in kv[1]))
    lines.append(
        f"  top {min(top, len(ranked))} kernels of {len(ranked)}: share, total ms, calls, mean us, kind, scope"
    )
    for (name, hlo_op), group in ranked[:top]:
        t = sum(e.dur_ns for e in group)
        label = name if not hlo_op or hlo_op == name else f"{name} [{hlo_op}]"
        lines.append(
            f"    {t / total:6.1%} {t / 1e6:9.2f} {len(group):7d} {t / len(group) / 1e3:9.1f}  "
            f"{kind_of(group[0]):<13} {scope_of(group[0].op_name):<24} {label[:70]}"
        )
    return "\n".join(lines), figures


def summarize_trace(
    folder: str | Path, title: str, hlo_texts: dict[str, str] | None = None, **kwargs
) -> tuple[str, dict]:
    """``summarize`` of the newest trace under ``folder`` (``read_events`` + ``attribute``); one line when the
    folder holds no trace."""
    path = find_xplane(folder)
    if path is None:
        return f"{title}: no .xplane.pb under {folder}", {"kernels": 0}
    events, where = read_events(path)
    text, figures = summarize(attribute(events, hlo_texts), title, **kwargs)
    return f"{text}\n  (events: {where})", figures
