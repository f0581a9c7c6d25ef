"""The device check's profile reader (benchmarks/profile_summary.py) on a real CPU trace and on a GPU-shaped one."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_summary as ps  # noqa: E402

# A GPU trace as CUPTI and XLA write it: kernels on a stream line, each launch annotated by XLA with its module,
# JAX name stack and HLO instruction; a copy of the loop's predicate to the host without one. Times in ps.
KERNELS = (  # (kernel, start ps, duration ps, name stack, HLO instruction)
    ("nvjet_tst_64x8_64x16", 0, 6000000, "while/body/mlp/dot_general", "gemm_fusion.3"),
    ("sort_4", 7000000, 2000000, "while/body/sampling/top_k/sort", "sort.4"),
    ("MemcpyD2H", 9500000, 500000, "", ""),
    ("nvjet_tst_64x8_64x16", 12000000, 6000000, "while/body/mlp/dot_general", "gemm_fusion.3"),
    ("loop_add_fusion", 18000000, 1000000, "while/body/record/scatter", "loop_add_fusion"),
)


def _event_metadata(names: list[str]) -> list[str]:
    """An XSpace text proto's event_metadata entries: ``names[i]`` (quotes escaped) under id i + 1."""
    return [
        f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{n.replace(chr(34), chr(92) + chr(34))}" }} }}'
        for i, n in enumerate(names)
    ]


def _gpu_xspace() -> str:
    names = sorted({k[0] for k in KERNELS})
    events = []
    for kernel, start, duration, stack, op in KERNELS:
        annotation = (
            f"XlaModule:#hlo_module=jit__retire_phase,program_id=7#::Thunk:#name={stack},hlo_op={op}#"
        )
        stats = f'stats {{ metadata_id: 100 str_value: "{annotation}" }}' if op else ""
        events.append(
            f"events {{ metadata_id: {names.index(kernel) + 1} offset_ps: {start} duration_ps: {duration} {stats} }}"
        )
    metadata = _event_metadata(names)
    return "\n".join(
        [
            'planes { id: 1 name: "/device:GPU:0"',
            'lines { id: 13 name: "Stream #13(compute)" timestamp_ns: 1000',
            *events,
            "}",
            *metadata,
            'stat_metadata { key: 100 value { id: 100 name: "kernel_annotation" } }',
            "}",
        ]
    )


def test_a_gpu_trace_is_split_by_scope_kind_and_step():
    events, where = ps.read_events_from(jax.profiler.ProfileData.from_text_proto(_gpu_xspace()))
    assert where.startswith("/device:GPU:0") and len(events) == 5
    gemm = events[0]
    assert (gemm.hlo_op, gemm.module, gemm.op_name) == (
        "gemm_fusion.3",
        "jit__retire_phase",
        "while/body/mlp/dot_general",
    )
    text, figures = ps.summarize(ps.attribute(events, None), "decode", steps=2, modules=("retire_phase",))
    # 15.5 us of kernels in a 19 us window (1000 ns .. 20000 ns): gaps of 1, 0.5 and 2 us
    assert figures["kernels"] == 5 and figures["kernels_per_step"] == 2.5
    assert figures["busy_fraction"] == pytest.approx(15.5 / 19)
    assert figures["idle_gaps"] == 3 and figures["idle_gap_us_median"] == pytest.approx(1.0)
    assert figures["shares"] == pytest.approx(
        {
            "mlp (norm + matmuls)": 12 / 15.5,
            "sampling: top-k": 2 / 15.5,
            "stop bookkeeping": 1 / 15.5,
            "unattributed": 0.5 / 15.5,
        }  # fmt: skip
    )
    assert figures["kinds"]["matmul"] == pytest.approx(12 / 15.5)
    assert figures["kinds"]["sort / top-k"] == pytest.approx(2 / 15.5)
    assert "nvjet_tst_64x8_64x16 [gemm_fusion.3]" in text and "per step (2 steps)" in text
    # a trace whose events name no module of those asked for: all its events, and the title says so
    text, figures = ps.summarize(ps.attribute(events, None), "decode", steps=2, modules=("prefill",))
    assert figures["kernels"] == 5 and "no event names a module of prefill" in text


_TRACE_A_LOOP = """
import sys
import jax
import jax.numpy as jnp


def body(i, x):
    with jax.named_scope("mlp"):
        x = jnp.tanh(x @ x)
    with jax.named_scope("sampling"), jax.named_scope("top_k"):
        kth = jax.lax.top_k(x, 8)[0][..., -1:]
    return jnp.where(x >= kth, x, 0.0)


step = jax.jit(lambda x: jax.lax.fori_loop(0, 6, body, x))
x = jax.random.normal(jax.random.key(0), (128, 128))
step(x).block_until_ready()
with jax.profiler.trace(sys.argv[1]):
    step(x).block_until_ready()
open(sys.argv[2], "w").write(step.lower(x).compile().as_text())
"""


def test_a_cpu_trace_is_named_by_the_modules_hlo(tmp_path):
    # On CPU the thunks carry no name stack: it comes from the compiled module's HLO text; the while thunk that
    # contains the others is left out. The trace is taken in a fresh process: once libtpu has been loaded (the
    # compile_topology tests), its profiler records the process's trace and the CPU's thunks are missing from it.
    script, trace, hlo_file = tmp_path / "trace_a_loop.py", tmp_path / "trace", tmp_path / "loop.hlo"
    script.write_text(_TRACE_A_LOOP)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, str(script), str(trace), str(hlo_file)], check=True, env=env, timeout=300)
    hlo = hlo_file.read_text()
    assert ps.module_name(hlo) == "jit__lambda"
    text, figures = ps.summarize_trace(trace, "loop", {ps.module_name(hlo): hlo}, steps=6)
    assert "host XLA thunks" in text, text
    assert figures["kernels"] >= 12 and figures["kernels_per_step"] >= 2
    assert figures["shares"]["mlp (norm + matmuls)"] > 0 and figures["shares"]["sampling: top-k"] > 0, text
    assert sum(figures["shares"].values()) == pytest.approx(1.0)
    assert figures["kinds"]["matmul"] > 0 and figures["kinds"]["sort / top-k"] > 0, text
    assert not any(line.split()[-1].startswith("while") for line in text.splitlines()[4:]), text


def test_an_empty_folder_says_so(tmp_path):
    text, figures = ps.summarize_trace(tmp_path, "decode")
    assert "no .xplane.pb" in text and figures == {"kernels": 0}


def test_hlo_instructions_name_a_fusion_by_what_it_calls():
    hlo = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %tanh.1 = f32[4]{0} tanh(%param_0), metadata={op_name="jit(f)/mlp/tanh"}
}

ENTRY %main.3 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
}
"""
    table = ps.hlo_instructions(hlo)
    assert table["fusion"] == ("fusion", "jit(f)/mlp/tanh", "fusion parameter tanh")
    assert table["tanh.1"] == ("tanh", "jit(f)/mlp/tanh", "tanh")
    assert ps.module_name(hlo) == "jit_f"


# A TPU trace as libtpu writes it: the device plane's "XLA Modules" line holds the program ("jit_step(<id>)"),
# its "XLA Ops" line one event per HLO instruction, named by the instruction's text, with no name stack; a
# while's event spans its body's ops. Times in ps: (event name, start, duration).
_TPU_OPS = (
    ("%while.7 = (s32[], f32[8,8]) while(%tuple.1), condition=%cond, body=%body", 1_000_000, 9_000_000),
    (
        "%fusion.3 = f32[8,8]{1,0:T(8,128)} fusion(%p, %w), kind=kOutput, calls=%fused_dot",
        1_000_000,
        4_000_000,
    ),
    (
        "%fusion.4 = f32[8,8]{1,0:T(8,128)} fusion(%fusion.3), kind=kLoop, calls=%fused_exp",
        6_000_000,
        2_000_000,
    ),
    ("%copy.5 = f32[8,8]{0,1:T(8,128)} copy(%fusion.4)", 8_000_000, 2_000_000),
)
_TPU_HLO = """HloModule jit_step, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%fused_dot (p: f32[8,8], w: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  ROOT %convolution.1 = f32[8,8]{1,0} convolution(%p, %w), dim_labels=bf_io->bf, metadata={op_name="jit(step)/transpose(jvp(forward))/mlp/dot_general"}
}

%fused_exp (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  ROOT %exponential.1 = f32[8,8]{1,0} exponential(%x), metadata={op_name="jit(step)/jvp(forward)/attention/exp"}
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %fusion.3 = f32[8,8]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_dot
  %fusion.4 = f32[8,8]{1,0} fusion(%fusion.3), kind=kLoop, calls=%fused_exp
  ROOT %copy.5 = f32[8,8]{0,1} copy(%fusion.4), metadata={op_name="jit(step)/attention/copy"}
}
"""


def _tpu_xspace() -> str:
    names = ["jit_step(4242)", *(name for name, _, _ in _TPU_OPS)]
    ops = [
        f"events {{ metadata_id: {names.index(n) + 1} offset_ps: {start} duration_ps: {duration} }}"
        for n, start, duration in _TPU_OPS
    ]
    metadata = _event_metadata(names)
    return "\n".join(
        [
            'planes { id: 1 name: "/device:TPU:0"',
            'lines { id: 1 name: "XLA Modules" timestamp_ns: 1000',
            "events { metadata_id: 1 offset_ps: 500000 duration_ps: 10000000 } }",
            'lines { id: 2 name: "XLA Ops" timestamp_ns: 1000',
            *ops,
            "}",
            *metadata,
            "}",
        ]
    )


def test_a_tpu_trace_is_read_by_its_instructions_and_the_modules_hlo():
    """A TPU's ops are named by their instruction's text: the reader takes the instruction's name and opcode,
    the module from the "XLA Modules" line, leaves the while (which spans its body) out, and the module's HLO
    text gives each op its name stack: scope, pass and kind (a fusion holding a convolution is a matmul)."""
    events, where = ps.read_events_from(jax.profiler.ProfileData.from_text_proto(_tpu_xspace()))
    assert where.startswith("/device:TPU:0") and len(events) == 4
    assert [e.hlo_op for e in events] == ["while.7", "fusion.3", "fusion.4", "copy.5"]
    assert {e.module for e in events} == {"jit_step"}
    # without the HLO text: no name stack, but the while is still left out and the copy known by its opcode
    text, figures = ps.summarize(ps.attribute(events, None), "update")
    assert figures["kernels"] == 3 and figures["kernel_ms"] == pytest.approx(0.008)
    assert figures["shares"] == {"unattributed": 1.0}
    assert figures["kinds"]["copy / scatter"] == pytest.approx(0.25)
    events, _ = ps.read_events_from(jax.profiler.ProfileData.from_text_proto(_tpu_xspace()))
    text, figures = ps.summarize(
        ps.attribute(events, {ps.module_name(_TPU_HLO): _TPU_HLO}), "update", by_pass=True
    )
    assert figures["kernels"] == 3
    assert figures["shares"] == pytest.approx({"mlp (norm + matmuls)": 0.5, "attention": 0.5})
    assert figures["kinds"] == pytest.approx({"matmul": 0.5, "other kernels": 0.25, "copy / scatter": 0.25})
    assert figures["passes"] == pytest.approx(
        {"backward": 0.5, "forward": 0.25, "other (optimizer, loss, ...)": 0.25}
    )
    assert "fusion.3" in text and "%fusion.3 =" not in text
