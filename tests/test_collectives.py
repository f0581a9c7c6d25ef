"""Collectives counted from a compiled program's HLO text: loop trips, the TPU reduce-scatter fusion, group
sizes in each of the three replica-group notations, the TPU async collective fusion chain counted once, and
the bytes per chip by hand."""

import re

import pytest

from grpax.plan.collectives import count_collectives, executed_collectives, fsdp_minimum

# An entry computation with a 5-trip loop whose body all-gathers bf16[8,4] (64 bytes) over groups of 4 chips
# and calls a TPU reduce-scatter fusion (an all-reduce of f32[16], 64 bytes, over 8 chips, then a slice);
# the entry all-reduces f32[10] (40 bytes) over pairs and all-to-alls s32[4,2] (32 bytes) over all 8 chips.
HLO = """HloModule jit_step, entry_computation_layout={()->f32[10]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%all-reduce-scatter.1 (input: f32[16]) -> f32[2] {
  %input = f32[16]{0:T(256)} parameter(0)
  %all-reduce.9 = f32[16]{0:T(256)} all-reduce(%input), channel_id=3, replica_groups=mesh['axis_0'=8] {'axis_0'}, to_apply=%add
  ROOT %slice = f32[2]{0} slice(%all-reduce.9), slice={[0:2]}
}

%body (p: (s32[], bf16[2,4])) -> (s32[], bf16[2,4]) {
  %p = (s32[], bf16[2,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[2,4]{1,0} get-tuple-element(%p), index=1
  %all-gather.2 = bf16[8,4]{1,0:T(8,128)} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %f = f32[16] constant({...})
  %fusion.3 = f32[2]{0} fusion(%f), kind=kCustom, calls=%all-reduce-scatter.1
  ROOT %t = (s32[], bf16[2,4]) tuple(%i, %x)
}

%cond (q: (s32[], bf16[2,4])) -> pred[] {
  %q = (s32[], bf16[2,4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %constant.7 = s32[] constant(5)
  ROOT %compare.8 = pred[] compare(%j, %constant.7), direction=LT
}

ENTRY %main (arg: f32[10]) -> f32[10] {
  %arg = f32[10]{0} parameter(0)
  %init = (s32[], bf16[2,4]) constant({...})
  %while.1 = (s32[], bf16[2,4]) while(%init), condition=%cond, body=%body
  %all-to-all.4 = s32[4,2]{1,0} all-to-all(%init), channel_id=4, replica_groups={}, dimensions={0}
  ROOT %all-reduce.5 = f32[10]{0} all-reduce(%arg), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}
"""


def test_collectives_by_hand():
    counted, unknown = count_collectives(HLO, num_devices=8)
    assert unknown == 0
    assert {k: (c.count, c.bytes_per_chip) for k, c in counted.items()} == {
        "all-gather": (5, 5 * 64 * 3 / 4),  # each trip receives 3/4 of the 64-byte output
        "reduce-scatter": (
            5,
            5 * 64 * 7 / 8,
        ),  # the fusion's all-reduce is a reduce-scatter: 7/8 of the input
        "all-reduce": (1, 2 * 40 * 1 / 2),  # ring all-reduce: 2 (g - 1) / g of the array
        "all-to-all": (1, 32 * 7 / 8),  # no groups: all 8 devices
    }


def test_a_loop_of_unknown_trip_count_is_counted_once_and_reported():
    counted, unknown = count_collectives(HLO.replace("direction=LT", "direction=NE"), num_devices=8)
    assert unknown == 1 and counted["all-gather"].count == 1


# The TPU compiler's async collective fusion (as v5e's update compiles, trimmed): one all-gather of bf16[16,4]
# (128 bytes) over 8 chips spread over a start fusion, two continuation fusions that each also run a dot, and a
# done fusion, in a 5-trip loop; each fusion holds a copy of the all-gather with channel_id 7; the shard and the
# gathered buffer are threaded through the chain. One transfer per trip, not four.
_CONFIG = (
    'backend_config={"flag_configs":[],"async_collective_fusion_config":{"flag_start":"%s","flag_end":"%s"}}'
)
_GATHER = (
    "all-gather(%%%s), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, "
    'use_global_device_ids=true, frontend_attributes={chain_id="0"}, '
)


def _continuation(n: int, p: str, w: str) -> str:
    """Continuation fusion ``n`` of the chain: a dot on the shard, and its copy of the all-gather."""
    return f"""%async_collective_fusion.{n} ({p}0: bf16[2,4], {p}1: bf16[16,4], {p}2: u32[], {w}: bf16[4,4]) -> (bf16[2,4], bf16[2,4], bf16[16,4], bf16[16,4], u32[]) {{
  %{p}0 = bf16[2,4]{{1,0}} parameter(0)
  %{p}1 = bf16[16,4]{{1,0}} parameter(1)
  %{p}2 = u32[] parameter(2)
  %{w} = bf16[4,4]{{1,0}} parameter(3)
  %dot.{n} = bf16[2,4]{{1,0}} dot(%{p}0, %{w}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %all-gather.{n} = bf16[16,4]{{1,0}} {_GATHER % (p + "0")}{_CONFIG % (2, 8)}
  ROOT %tuple.{n} = (bf16[2,4]{{1,0}}, bf16[2,4]{{1,0}}, bf16[16,4]{{1,0}}, bf16[16,4]{{1,0}}, u32[]) tuple(%dot.{n}, %{p}0, %{p}1, %all-gather.{n}, %{p}2)
}}"""


CHAIN_HLO = f"""HloModule jit_step, entry_computation_layout={{()->bf16[2,4]}}

%start (s0: bf16[2,4]) -> (bf16[2,4], bf16[16,4], u32[]) {{
  %s0 = bf16[2,4]{{1,0}} parameter(0)
  %all-gather.1 = bf16[16,4]{{1,0}} {_GATHER % "s0"}{_CONFIG % (-1, -1)}
  ROOT %custom-call.1 = (bf16[2,4]{{1,0}}, bf16[16,4]{{1,0}}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}}

{_continuation(2, "c", "w")}

{_continuation(3, "d", "v")}

%done (e0: bf16[2,4], e1: bf16[16,4], e2: u32[]) -> bf16[16,4] {{
  %e0 = bf16[2,4]{{1,0}} parameter(0)
  %e1 = bf16[16,4]{{1,0}} parameter(1)
  %e2 = u32[] parameter(2)
  %all-gather.4 = bf16[16,4]{{1,0}} {_GATHER % "e0"}{_CONFIG % (2, 8)}
  ROOT %custom-call.4 = bf16[16,4]{{1,0}} custom-call(%e0, %e1, %all-gather.4, %e2), custom_call_target="AsyncCollectiveDone"
}}

%body (p: (s32[], bf16[2,4])) -> (s32[], bf16[2,4]) {{
  %p = (s32[], bf16[2,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[2,4]{{1,0}} get-tuple-element(%p), index=1
  %w4 = bf16[4,4]{{1,0}} constant({{...}})
  %async-collective-start.1 = (bf16[2,4]{{1,0}}, bf16[16,4]{{1,0}}, u32[]) fusion(%x), kind=kCustom, calls=%start
  %g0 = bf16[2,4]{{1,0}} get-tuple-element(%async-collective-start.1), index=0
  %g1 = bf16[16,4]{{1,0}} get-tuple-element(%async-collective-start.1), index=1
  %g2 = u32[] get-tuple-element(%async-collective-start.1), index=2
  %fusion.2 = (bf16[2,4]{{1,0}}, bf16[2,4]{{1,0}}, bf16[16,4]{{1,0}}, bf16[16,4]{{1,0}}, u32[]) fusion(%g0, %g1, %g2, %w4), kind=kOutput, calls=%async_collective_fusion.2
  %h1 = bf16[2,4]{{1,0}} get-tuple-element(%fusion.2), index=1
  %h2 = bf16[16,4]{{1,0}} get-tuple-element(%fusion.2), index=2
  %h4 = u32[] get-tuple-element(%fusion.2), index=4
  %fusion.3 = (bf16[2,4]{{1,0}}, bf16[2,4]{{1,0}}, bf16[16,4]{{1,0}}, bf16[16,4]{{1,0}}, u32[]) fusion(%h1, %h2, %h4, %w4), kind=kOutput, calls=%async_collective_fusion.3
  %k1 = bf16[2,4]{{1,0}} get-tuple-element(%fusion.3), index=1
  %k2 = bf16[16,4]{{1,0}} get-tuple-element(%fusion.3), index=2
  %k4 = u32[] get-tuple-element(%fusion.3), index=4
  %async-collective-done.1 = bf16[16,4]{{1,0}} fusion(%k1, %k2, %k4), kind=kCustom, calls=%done
  ROOT %t = (s32[], bf16[2,4]) tuple(%i, %x)
}}

%cond (q: (s32[], bf16[2,4])) -> pred[] {{
  %q = (s32[], bf16[2,4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %constant.7 = s32[] constant(5)
  ROOT %compare.8 = pred[] compare(%j, %constant.7), direction=LT
}}

ENTRY %main () -> bf16[2,4] {{
  %init = (s32[], bf16[2,4]) constant({{...}})
  %while.1 = (s32[], bf16[2,4]) while(%init), condition=%cond, body=%body
  ROOT %y = bf16[2,4]{{1,0}} get-tuple-element(%while.1), index=1
}}
"""


def test_an_async_collective_fusion_chain_is_one_transfer():
    counted, unknown = count_collectives(CHAIN_HLO, num_devices=8)
    assert unknown == 0
    # 5 trips of one all-gather receiving 7/8 of its 128-byte output; the chain's 4 copies counted 20 x before
    assert {k: (c.count, c.bytes_per_chip) for k, c in counted.items()} == {
        "all-gather": (5, 5 * 128 * 7 / 8)
    }
    # the same copies without the chain's config are 4 collectives, 20 transfers (what was counted before)
    plain = re.sub(r',"async_collective_fusion_config":\{[^}]*\}', "", CHAIN_HLO)
    assert count_collectives(plain, num_devices=8)[0]["all-gather"].count == 20


def test_fsdp_minimum_by_hand():
    # 1000 weights in bfloat16 over fsdp = 4: a pass gathers 3/4 of 2000 bytes; the update gathers twice
    # (forward, backward) and reduce-scatters the gradient once.
    assert fsdp_minimum(1000, 2, fsdp=4, tensor=1, passes=1, grads=False) == 1500
    assert fsdp_minimum(1000, 2, fsdp=4, tensor=1, passes=2, grads=True) == 4500
    assert fsdp_minimum(1000, 2, fsdp=4, tensor=2, passes=2, grads=True) == 2250
    assert fsdp_minimum(1000, 2, fsdp=1, tensor=8, passes=2, grads=True) == 0


def test_update_collectives_counts_a_saved_folder(tmp_path):
    """benchmarks/update_collectives.py --count: the saved memory's peak (resident + the largest phase) and the
    saved HLO's collectives, as another commit's compile left them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("libtpu", reason="the slice's devices come from libtpu's topology")
    (tmp_path / "update.hlo").write_text(HLO)
    gib = 2**30
    memory = {
        "update": {"temporaries": gib, "phase": 3 * gib},
        "reference": {"temporaries": gib, "phase": gib},
    }
    resident = {"params": gib, "optimizer state": 2 * gib}
    (tmp_path / "memory.json").write_text(json.dumps({"memory": memory, "resident": resident}))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "benchmarks/update_collectives.py", "--count", str(tmp_path), "--top", "2", "model_name=llama3.2-1b",
         "compile_topology=v5e-8"],
        cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    assert "resident arrays 3.00 GiB per chip: params 1.00 GiB, optimizer state 2.00 GiB" in out, out
    assert "peak of the update and the reference pass: 6.00 GiB per chip" in out, out
    # the HLO's bytes per chip by hand (test_collectives_by_hand): 240 + 280 + 40 + 28
    assert "all-gather 5 x 0.000 GB, reduce-scatter 5 x 0.000 GB" in out, out
    assert "update: 0.00 GB per chip, 0.0000 s at 200 GB/s ICI" in out, out
    # --top: the two largest by array bytes, loop trips counted (5 x 64 bytes each)
    assert "  all-gather bf16[8,4] over 4 chips: 5 x, 0.000 GB (arrays)" in out, out
    assert "  reduce-scatter f32[16] over 8 chips: 5 x, 0.000 GB (arrays)" in out, out


@pytest.mark.slow  # one compile of a 2-layer cut of llama3.2-1b's reference pass for v5e-8: ~30-60 s on 2 cores
def test_v5e_gathers_each_layer_weight_once_per_pass():
    """On v5e the TPU compiler spreads each layer weight's all-gather over an async collective fusion chain
    (several fusions, each with a copy of the gather): counted as chains, the reference pass gathers each MLP
    input weight once per layer, as on v6e (docs/scaling.md, "Chip-to-chip traffic of the update")."""
    import dataclasses

    import jax

    from grpax import sharding
    from grpax.config import build_config
    from grpax.plan import compile_check
    from grpax.plan.topology import get_topology
    from grpax.rl.train_config import TrainConfig
    from grpax.rl.train_step import token_logprobs

    pytest.importorskip("libtpu", reason="the slice's devices come from libtpu's topology")
    cfg = build_config(TrainConfig, ["model_name=llama3.2-1b", "compile_topology=v5e-8"])
    model_cfg = dataclasses.replace(compile_check.model_config(cfg), num_layers=2)
    devices = get_topology("v5e-8", 1, 0).devices
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    mesh = sharding.create_mesh(mesh_cfg, devices)
    job = compile_check.build_job(cfg, mesh, sharding.create_rollout_mesh(mesh_cfg, devices), model_cfg)
    with jax.set_mesh(job.mesh):
        args = (job.state.params, job.batch.tokens(), model_cfg, cfg.grpo().temperature, cfg.micro_batches)
        text = token_logprobs.lower(*args).compile().as_text()
    gathers = [(t, rest, n) for kind, t, rest, n in executed_collectives(text, 8)[0] if kind == "all-gather"]
    # w_gate and w_up, [D, F] = [2048, 8192] gathered over fsdp = 8: one each per layer
    mlp_in = [n for t, rest, n in gathers if t.startswith("bf16[1,2048,8192]") and "mlp/dot_general" in rest]
    assert sum(mlp_in) == 2 * 2, gathers
    # the premise: v5e's program holds the chains this counts once (each copy counted, as before, is more)
    plain = re.sub(r',"async_collective_fusion_config":\{[^}]*\}', "", text)
    copies = [
        n for kind, t, rest, n in executed_collectives(plain, 8)[0] if t.startswith("bf16[1,2048,8192]")
    ]
    assert sum(copies) > 2 * 2, "no async collective fusion chain in v5e's program: the compiler changed"
