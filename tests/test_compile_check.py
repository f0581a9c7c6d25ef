"""``grpax train_rl ... compile_topology=...``: the whole job compiled for a TPU slice with no TPU and no weights.

A tiny Llama (only its config.json exists: no weight is read) is compiled for a v5e:2x2 slice through the
command; the table's parameter and optimizer bytes are checked against per-chip shard sizes counted by hand,
a job that cannot fit exits 1 naming keys to change, and an unknown slice or a missing libtpu is one line.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from grpax.cli.main import main
from grpax.config import ConfigError, build_config
from grpax.models.registry import ModelConfig, to_hf_config
from grpax.plan.compile_check import check_before_run
from grpax.plan.step_cost import StepShape, step_phases
from grpax.plan.topology import get_topology
from grpax.rl.train_config import TrainConfig
from grpax.sampler.keys import SamplerConfig
from grpax.sharding import MeshConfig, create_rollout_mesh, per_chip_bytes

pytest.importorskip("libtpu", reason="the tpu extra (pip install -e '.[tpu]') brings libtpu; CI installs it")

# V=512, D=64, L=2, N=4, K=2, H=16, F=128, untied head.
TINY = ModelConfig(
    vocab_size=512, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
    eos_token_ids=(1,),
)  # fmt: skip

WHOLE_TABLE = SamplerConfig(decode_phase_length=0)  # the decode's gathers over the whole page table


@pytest.fixture
def no_kept_figures(monkeypatch):
    """The fit check's figures cache off (``figures_cache.read`` finds nothing): a test that asserts what a compile
    logs or returns must compile, whatever an earlier run left in the compilation cache's folder."""
    from grpax.plan import figures_cache

    monkeypatch.setattr(figures_cache, "read", lambda key: None)


@pytest.fixture
def config_only(tmp_path, monkeypatch):
    """A folder holding only config.json (a load_parameters_path with no weights in it)."""
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(TINY, "float32")))
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # restored after the test
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    return tmp_path


def _keys(folder, **extra):
    keys = dict(
        model_name="",
        load_parameters_path=str(folder),
        compile_topology="v5e:2x2",
        batch_size=4,
        num_generations=2,
        max_prefill_predict_length=32,
        max_target_length=64,
    )
    keys.update(extra)
    return ["train_rl", *(f"{k}={v}" for k, v in keys.items())]


def _row(out: str, name: str) -> int:
    match = re.search(rf"^  {re.escape(name)}\s+[\d.]+ GiB\s+([\d,]+) bytes$", out, re.M)
    assert match, f"no row {name!r} in:\n{out}"
    return int(match.group(1).replace(",", ""))


def test_tiny_model_compiles_for_v5e_2x2_with_hand_counted_shards(config_only, capsys, no_kept_figures):
    # hardware=tpu, as the run's own command on the slice says: compiling needs no TPU on this host.
    assert main(_keys(config_only, hardware="tpu")) == 0
    out, err = capsys.readouterr()
    # each function's figures are logged as it compiles (a long job's table comes only at the end)
    temporaries = _row(out, "update temporaries") / 2**30
    line = rf"compiled the GRPO update in [\d.]+ s: temporaries {temporaries:.2f} GiB, arguments [\d.]+ GiB, "
    assert re.search(line + r"collectives [\d.]+ GB per chip", err), err
    assert "v5e:2x2 (4 x TPU v5e)" in out and "fits: peak" in out
    # Trainer mesh fsdp=4: every matrix is split 4 ways on its D (embed) side, the norms are replicated.
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    matrices = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    norms = L * 2 * D + D
    params = 4 * (matrices // 4 + norms)  # float32
    assert params == 140544
    assert _row(out, "params") == params
    assert _row(out, "reference params") == params  # beta = 0.04 > 0: a copy for the reference pass
    # AdamW's mu and nu are params-shaped and sharded like them; + its two int32 counts (adam, schedule) and
    # the TrainState's int32 step.
    assert _row(out, "optimizer state") == 2 * params + 3 * 4
    # The rollout engine's KV page pool on the sampler mesh tensor=4: K=2 heads do not split 4 ways, so each
    # chip holds all of it: 1 scratch page + 8 slots x ceil(64 / 32) pages, each 32 tokens x (k, v) x K x H.
    pages = 1 + 4 * 2 * 2
    assert _row(out, "KV page pool: 17 pages x 32 tokens") == L * pages * 32 * 2 * K * H * 4
    peak = _row(out, "peak, all colocated")
    assert peak > _row(out, "params") + _row(out, "optimizer state") + _row(out, "reference params")
    assert _row(out, "chip HBM") == 16 * 2**30
    assert re.search(r"compile time: the GRPO update [\d.]+ s", out)
    # the update's chip-to-chip traffic from its HLO, its ICI time at v5e's 200 GB/s, FSDP's minimum beside it
    assert "ICI time at 200 GB/s per chip" in out
    assert re.search(
        r"^  update +[\d.]+ GB [\d.]+ s ICI; FSDP's minimum [\d.]+ GB \([\d.]+x\): all-gather ", out, re.M
    )


def test_a_job_that_cannot_fit_exits_1_naming_the_keys(config_only, capsys):
    # 512 prompts x 16 completions of 8192 tokens: the KV pool alone is 1 + 8192 slots x 256 pages of 32 tokens,
    # x 2 (k, v) x 2 layers x 2 x 16 x 4 bytes = 32 GiB per chip (K=2 heads do not split over tensor=4), above
    # v5e's 16 GiB.
    args = _keys(config_only, batch_size=512, num_generations=16, max_prefill_predict_length=4096,
                 max_target_length=8192)  # fmt: skip
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "does not fit: peak" in out
    assert "to make it fit, try:" in out and "max_target_length=4096" in out


# Heads whose pool the TPU stores without padding: per chip (rollout tensor=1) 2K = 16 bfloat16 rows of H = 128.
TILED = ModelConfig(
    vocab_size=512, hidden_dim=256, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=128, mlp_dim=512,
    eos_token_ids=(1,),
)  # fmt: skip


def test_the_compiled_rollout_programs_grow_with_num_pages_by_exactly_the_pools_bytes(
    tmp_path, monkeypatch, capsys
):
    """The engine's programs take the pool as a donated argument, updated in place: each program's arguments,
    outputs and aliased bytes grow by exactly the pool's growth (num_pages: the default, 100 and 300 pages), so
    its phase beyond the resident arrays grows by the pool and by the compiler's temporaries alone (which vary a
    little with the shapes, far less than a copy of the pool; the rollout phase, the larger of the two programs',
    may so grow a little less or more than the pool when the other program becomes the larger). The sampler's mesh is data-parallel (4 x 1):
    Pallas's ragged paged attention runs inside a shard_map there too (it was called bare on a mesh without
    "tensor", which the TPU compiler refused). With TINY's heads (2K = 4 float32 rows of H = 16) the TPU stores
    the pool padded and holds padded copies of it: its phase grows faster."""
    from grpax.plan import compile_check

    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(TILED, "bfloat16")))
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    reports = []
    real = compile_check.compile_job
    monkeypatch.setattr(
        compile_check, "compile_job", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1]
    )
    keys = dict(beta=0, hardware="tpu", rollout_data_parallelism=-1, rollout_tensor_parallelism=1,
                dtype="bfloat16", weight_dtype="bfloat16", batch_size=8, num_generations=4)  # fmt: skip
    rows = {}
    for num_pages in (0, 100, 300):
        assert main(_keys(tmp_path, **keys, num_pages=num_pages)) == 0
        out = capsys.readouterr().out
        pages = num_pages or 1 + 32 * 2  # every slot (8 x 4) holds 64 tokens: 2 pages
        pool = _row(out, f"KV page pool: {pages} pages x 32 tokens")
        assert pool == 2 * pages * 32 * 2 * 8 * 128 * 2  # L x pages x page_size x (k, v) x K x H x bfloat16
        programs = {name: reports[-1].functions[name] for name in ("prefill", "decode")}
        rows[pages] = (pool, programs)
    (pool, programs), *others = rows.values()
    for other_pool, other_programs in others:
        grown = other_pool - pool
        for name, c in programs.items():
            d = other_programs[name]
            assert (d.arguments - c.arguments, d.outputs - c.outputs, d.aliased - c.aliased) == (
                grown,
            ) * 3, name
            assert abs(d.temporaries - c.temporaries) < grown // 8, name  # no copy of the pool's growth


def test_unknown_topology_names_the_known_ones(config_only, capsys):
    assert main(_keys(config_only, compile_topology="v9z-8")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "compile_topology='v9z-8' is not a known TPU slice" in err and "v6e-8" in err and "v5p-8" in err


def test_a_checkpoint_path_without_config_names_the_path(tmp_path, capsys):
    """A mistyped load_parameters_path (no config.json at or above it) and no model_name: the error names it."""
    missing = tmp_path / "typo" / "0" / "items"
    assert main(_keys(missing)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the meshes' log lines
    assert err.startswith("grpax train_rl: error: compile_topology needs the model's shapes"), err
    assert f"load_parameters_path={missing} has no config.json at or above it" in err, err
    assert "pass model_name=<a registered model>" in err, err
    # With a registered model_name (train_rl's default is one) the typo would compile that model: refused.
    assert main(_keys(missing, model_name="smollm2-135m")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(
        f"load_parameters_path={missing} does not exist; fix the path, or leave it out to "
        "compile the registered model_name's shapes"
    ), err


def test_missing_libtpu_names_the_extra(config_only, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu now raises ImportError
    assert main(_keys(config_only)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install -e ".[tpu]"' in err


def test_step_flops_equal_a_hand_count():
    # One prompt of P=4 tokens, G=2 completions of C=2 tokens, the whole page table, no reference, remat none.
    cfg = TINY.replace(remat_policy="none")
    s = StepShape(1, 2, 4, 2, 1, 1, False, False, sampler=WHOLE_TABLE)
    phases = {p.name: p for p in step_phases(cfg, s, 1, 1, 1, 1, 1.0, 1.0)}
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    per_token = 2 * L * (2 * D * N * H + 2 * D * K * H + 3 * D * F)  # 2 x layer matmul params
    attention = lambda q, k: 4 * L * N * H * q * k  # noqa: E731
    assert phases["prefill"].flops == per_token * 4 + attention(4, 4) + 2 * D * V
    # One decode step (the prefill samples the first token) on two slots, each gathering its whole page table: one
    # page of 32 tokens (P + C = 6).
    assert phases["decode"].flops == 2 * (per_token + 2 * D * V) + attention(2, 32)
    grouped = per_token * (4 + 4) + attention(4, 4) + attention(4, 6) + 2 * D * V * 4
    layers_and_head = grouped - 2 * D * V * 4
    assert phases["update"].flops == 3 * layers_and_head + 4 * 2 * D * V * 4


def test_each_chip_reads_only_its_own_experts():
    """A mixture of experts split on ``expert`` (sampler and trainer): each chip reads the dense weights split
    on ``tensor`` and 1/ep of the experts, and the sampler's rows and cache split on ``expert`` (the count once
    took every chip as reading all the experts: Qwen3-30B-A3B at rollout expert=8 counted a 9.9 s decode)."""
    E, Fe, L, D = 4, 32, TINY.num_layers, TINY.hidden_dim
    cfg = TINY.replace(
        family="qwen3_moe", num_experts=E, num_experts_per_tok=2, moe_mlp_dim=Fe, remat_policy="none"
    )
    s = StepShape(1, 4, 4, 2, 1, 1, False, False, sampler=WHOLE_TABLE)
    count = lambda **kw: {p.name: p for p in step_phases(cfg, s, 1, 1, 1, 1, 1.0, 1.0, **kw)}  # noqa: E731
    one, split = count(), count(trainer_expert=2, rollout_expert=4)
    experts = L * E * 3 * D * Fe * 4  # float32 bytes of every layer's experts
    dense = cfg.num_params() * 4 - experts
    assert one["prefill"].bytes_per_chip == dense + experts
    assert split["prefill"].bytes_per_chip == dense + experts / 4
    # One decode step (C = 2: the prefill samples the first token) on 4 slots: the weights and the pages the
    # chip's slots gather (decode_phase_length 0: the whole table, one page of 32 tokens each; 4 slots split 4
    # ways on expert: 1 per chip).
    slot = 2 * L * TINY.num_kv_heads * TINY.head_dim * 4
    assert one["decode"].bytes_per_chip == dense + experts + 4 * 32 * slot
    assert split["decode"].bytes_per_chip == dense + experts / 4 + 1 * 32 * slot
    # remat none: the update's forward and backward read the weights; the optimizer's bytes do not change.
    assert one["update"].bytes_per_chip - split["update"].bytes_per_chip == 2 * (experts - experts / 2)
    assert split["decode"].flops == one["decode"].flops and split["update"].flops == one["update"].flops


def test_the_old_logprob_pass_is_counted_whenever_the_run_computes_it():
    """Issue 40 item 4: the rollout computes pi_old with max_staleness > 0 too (``needs_old_logprobs``); the
    step count once counted that pass only for num_iterations > 1."""
    from grpax.rl.config import GRPOConfig

    for num_iterations, max_staleness in [(1, 0), (2, 0), (1, 1)]:
        grpo = GRPOConfig(num_iterations=num_iterations, max_staleness=max_staleness)
        s = StepShape(1, 2, 4, 2, 1, num_iterations, False, grpo.needs_old_logprobs, sampler=WHOLE_TABLE)
        names = [p.name for p in step_phases(TINY, s, 1, 1, 1, 1, 1.0, 1.0)]
        assert ("old logprobs" in names) == (num_iterations > 1 or max_staleness > 0), names


def test_sampler_reads_the_weights_in_the_compute_dtype():
    """float32 master weights with bfloat16 compute: the decode reads the bfloat16 rounding (prepare_decode), the
    update reads float32 weights plus a float32 optimizer state, a bfloat16 one a float32 master copy too."""
    s = StepShape(1, 2, 4, 2, 1, 1, False, False, sampler=WHOLE_TABLE)
    count = lambda **kw: {p.name: p for p in step_phases(TINY.replace(**kw), s, 1, 1, 1, 1, 1.0, 1.0)}  # noqa: E731
    master, half = (
        count(weight_dtype="float32", dtype="bfloat16"),
        count(weight_dtype="bfloat16", dtype="bfloat16"),
    )
    assert master["decode"].bytes_per_chip == half["decode"].bytes_per_chip
    n = TINY.num_params()
    weights = lambda w: 2 * n * w  # remat none: the forward and the backward read them  # noqa: E731
    assert master["update"].bytes_per_chip == weights(4) + n * (2 * 4 + 20)
    assert half["update"].bytes_per_chip == weights(2) + n * (2 * 2 + 20 + 8)


def test_v4_and_v5p_slices_are_one_device_per_chip():
    """``v4-8`` and ``v5p-8`` name 8 TensorCores: 4 chips (2x2x1), one JAX device each (jax's TPU mesh builder
    refuses one device per core)."""
    for name, chips in (("v4-8", 4), ("v5p-8", 4), ("v4-16", 8)):
        devices = get_topology(name).devices
        assert len(devices) == chips, name
        assert {d.core_on_chip for d in devices} == {0}, name


def test_cloud_accelerator_type_names_are_slices():
    """``gcloud``'s --accelerator-type for v5e is v5litepod-N; names are read without case."""
    for name in ("v5litepod-8", "V5E-8"):
        topology = get_topology(name)
        assert (topology.chip.name, topology.num_chips) == ("TPU v5e", 8), name


def test_a_grid_no_host_tiles_names_compile_topology():
    """v6e:2x3 (6 chips) is no whole number of 1-, 4- or 8-chip hosts: the error names compile_topology and a
    working name, not chips_per_vm=6 (which fails the same way)."""
    with pytest.raises(ConfigError) as e:
        get_topology("v6e:2x3")
    message = str(e.value)
    assert message.startswith("compile_topology='v6e:2x3': v6e hosts hold 1, 4 or 8 chips"), message
    assert "chips_per_vm" not in message and "use a slice name such as v6e-8" in message, message
    with pytest.raises(ConfigError, match="^chips_per_vm=8: a v6e-4 slice"):
        get_topology("v6e-4", chips_per_vm=8)


def test_per_chip_bytes_counts_prng_keys():
    """The sampler's decode key is among the arrays a job over HBM reports (``_compile``'s refused path): a
    key<fry> is 2 uint32, 8 bytes (was: TypeError 'Cannot interpret key<fry> as a data type')."""
    import jax
    import jax.numpy as jnp

    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    key = jax.ShapeDtypeStruct((), jax.eval_shape(jax.random.key, 0).dtype, sharding=one)
    logits = jax.ShapeDtypeStruct((4, 10), jnp.bfloat16, sharding=one)
    assert per_chip_bytes([key, logits]) == 8 + 4 * 10 * 2


def test_a_refused_programs_temporaries_leave_out_its_arguments(no_kept_figures):
    """The TPU compiler's refusal names the program's whole peak, arguments included: on v6e-8 a donated
    argument x of 20 GiB per chip beside the 16 GiB of temporaries the same program holds when it compiles
    (x of 4 GiB) is refused with "(36.00G)"; ``_compile`` reports 20 GiB of arguments and 16 of temporaries
    (was: 36 of temporaries, the arguments counted twice in the phase and the peak)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpax.plan.compile_check import _compile

    mesh = jax.sharding.Mesh(np.array(get_topology("v6e-8").devices), ("x",))
    split = NamedSharding(mesh, P("x"))
    GIB = 2**30

    def f(x):  # temporaries: the 2 GiB-per-chip sequence t and its cumulative sum, twice as wide again
        t = jnp.cumsum(jnp.sin(x[:1].sum() + jnp.arange(8 * 2 * GIB, dtype=jnp.float32)))
        return x + jnp.sum(jax.lax.with_sharding_constraint(t, split))

    def compiled(gib):
        x = jax.ShapeDtypeStruct((8 * gib * GIB // 4,), jnp.float32, sharding=split)
        return _compile("f", 8, jax.jit(f, donate_argnums=0), x)

    fits, executable = compiled(4)
    assert executable is not None and abs(fits.temporaries - 16 * GIB) < 0.01 * GIB, fits.temporaries / GIB
    refused, executable = compiled(20)
    assert executable is None and refused.over_hbm
    assert refused.arguments == 20 * GIB
    assert abs(refused.temporaries - fits.temporaries) <= 0.01 * GIB, refused.temporaries / GIB


def test_two_slices_with_the_default_rollout_keys_name_the_fix():
    """The sampler's tensor parallelism stays within a slice: 2 v5e-4 slices with rollout_data_parallelism=1
    (the default) are refused naming the value that works, which then builds a (2, 1, 4) rollout mesh."""
    devices = get_topology("v5e-4", num_slices=2).devices
    with pytest.raises(ConfigError) as e:
        create_rollout_mesh(MeshConfig(), devices)
    assert str(e.value).endswith(
        "pass rollout_data_parallelism=2 (with rollout_tensor_parallelism=-1: 4-way within each)"
    ), str(e.value)
    mesh = create_rollout_mesh(MeshConfig(rollout_data_parallelism=2), devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4, "expert": 1}


@pytest.mark.slow  # one more whole-job compile; the default suite covers the same verdict through the command
def test_check_before_run_stops_a_run_that_cannot_fit(config_only):
    # The check an accelerator run makes before reading weights, here on a v5e:2x2 slice's devices with a
    # memory limit of 1 MiB (the tiny job's params, moments and reference alone take 0.54 MiB per chip).
    cfg = build_config(TrainConfig, _keys(config_only, compile_topology="")[1:])
    devices = get_topology("v5e:2x2").devices
    with pytest.raises(ConfigError, match=r"this run does not fit: peak .* GiB per device > 0.00 GiB; try: .*"
                                          r"max_target_length=32.*check_fit=false skips"):  # fmt: skip
        check_before_run(cfg, devices, limit=2**20)
    check_before_run(build_config(TrainConfig, [*_keys(config_only)[1:], "check_fit=false"]), devices, 1)


def test_the_reference_copy_is_planned_in_the_compute_dtype_and_in_host_memory(config_only, capsys):
    """float32 weights, bfloat16 compute: the reference copy is rounded as the forward reads it (half the
    bytes); with reference_memory=pinned_host it holds no device memory but its pass holds it."""
    assert (
        main(_keys(config_only, compile_topology="h100-8", dtype="bfloat16", reference_memory="device")) == 0
    )
    out = capsys.readouterr().out
    assert _row(out, "reference params") * 2 == _row(out, "params")
    keys = _keys(
        config_only, hardware="tpu", dtype="bfloat16", reference_memory="pinned_host", remat_policy="full"
    )
    assert main(keys) == 0
    out = capsys.readouterr().out
    half = _row(out, "params") // 2  # fsdp=4 on v5e:2x2, as in the first test; bfloat16
    assert _row(out, "reference params: in host memory (pinned_host)") == 0
    pass_bytes = _row(out, "reference logprobs phase, beyond the resident arrays")
    assert pass_bytes >= half + _row(out, "reference logprobs temporaries")
    assert re.search(r"^  reference from host +0.0 TFLOP +[\d.]+ GiB/chip", out, re.M)


def test_nvidia_target_is_an_estimate_with_exact_shards(config_only, capsys):
    # No compiler for an absent GPU: the table is labelled an estimate; its resident rows are still exact.
    assert main(_keys(config_only, compile_topology="h100-8")) == 0
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATE (analytical; this JAX cannot compile for an absent GPU)")
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    matrices = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    params = 4 * (matrices // 8 + L * 2 * D + D)  # fsdp=8 over 8 GPUs, float32
    assert _row(out, "params") == params and _row(out, "optimizer state") == 2 * params + 3 * 4
    assert _row(out, "chip HBM") == 81559 * 2**20
    assert "compile time" not in out


def test_rollout_devices_compile_the_sampler_and_the_trainer_on_their_own_chips(config_only, capsys):
    """v5e:2x2 with rollout_devices=2 and max_staleness=1: the trainer's 2 chips hold params split fsdp=2, the
    optimizer state, the reference and two params versions for the rollouts ahead; the sampler's 2 chips hold
    its own copy and the cache, each peak against the HBM."""
    assert main(_keys(config_only, hardware="tpu", rollout_devices=2, max_staleness=1)) == 0
    out = capsys.readouterr().out
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    matrices = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    norms = L * 2 * D + D
    params = 4 * (matrices // 2 + norms)  # float32, fsdp=2 on the trainer's 2 chips
    assert _row(out, "params") == params
    assert _row(out, "params versions for rollouts ahead (2)") == 2 * params
    # The sampler's mesh tensor=2: K=2 heads split 2 ways (the pool's pages: 1 + 8 slots x 2).
    assert _row(out, "KV page pool: 17 pages x 32 tokens") == L * 17 * 32 * 2 * (K // 2) * H * 4
    trainer = _row(out, "peak on the trainer's 2 chips (update, reference)")
    sampler = _row(out, "peak on the sampler's 2 chips (rollout_devices)")
    resident = sum(
        _row(out, name)
        for name in (
            "params",
            "optimizer state",
            "reference params",
            "params versions for rollouts ahead (2)",
        )
    )
    assert trainer > resident and trainer - resident == max(
        _row(out, "update phase, beyond the resident arrays"),
        _row(out, "reference logprobs phase, beyond the resident arrays"),
    )
    assert sampler == _row(out, "rollout phase, beyond the resident arrays")
    assert f"fits: peak {max(trainer, sampler) / 2**30:.2f} GiB" in out


def test_the_nvidia_estimate_refuses_rollout_devices(config_only, capsys):
    assert main(_keys(config_only, compile_topology="h100-8", rollout_devices=2)) == 2
    assert "rollout_devices=2: the NVIDIA estimate covers colocated jobs only" in capsys.readouterr().err


# LoRA rank r on the tiny model, all seven modules. An adapter takes its weight's logical axes (A the input
# side, B the output side, the rank replicated): on fsdp=n only the "embed" (D) sides split, so per layer the
# float32 values per chip are r x (7 D / n + 2 N H + 2 K H + 3 F): A of wq, wk, wv, w_gate, w_up and B of wo,
# w_down hold D; B of wq (N H), wk and wv (K H), w_gate and w_up (F); A of wo (N H) and w_down (F).
def _adapters_per_chip(r: int, n: int) -> int:
    D, L, N, K, H, F = 64, 2, 4, 2, 16, 128
    return 4 * L * r * (7 * D // n + 2 * N * H + 2 * K * H + 3 * F)


def test_lora_table_has_the_base_the_adapters_their_moments_and_no_reference(config_only, capsys):
    assert main(_keys(config_only, hardware="tpu", lora_rank=4, lora_sampler="merged")) == 0
    out = capsys.readouterr().out
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    matrices = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    params = 4 * (matrices // 4 + L * 2 * D + D)  # float32, fsdp=4, as in the full fine-tune's table
    assert _row(out, "base weights (frozen; the reference too)") == params == 140544
    adapters = _adapters_per_chip(4, 4)
    assert adapters == 22016
    assert _row(out, "adapters (float32)") == adapters
    # AdamW's mu and nu of the adapters only (float32, no master copy), its two counts and the step.
    assert _row(out, "adapter optimizer state") == 2 * adapters + 3 * 4
    assert _row(out, "reference copy: none (the base, adapters off)") == 0  # beta = 0.04 > 0: the base itself
    assert not re.search(r"^  (reference params|params|optimizer state)  ", out, re.M)
    # The sampler reads the merged weights: jitted lora.merge returns every weight anew, placed as the base.
    assert _row(out, "merged weights for the sampler (LoRA: lora.merge)") == params
    resident = params + adapters + 2 * adapters + 12
    phases = [
        _row(out, f"{name} phase, beyond the resident arrays")
        for name in ("update", "merge", "reference logprobs", "rollout")
    ]
    assert _row(out, "peak, all colocated") == resident + max(phases)
    assert _row(out, "reference logprobs phase, beyond the resident arrays") > params  # the merged copy held
    assert re.search(
        r"compile time: the GRPO update \(LoRA adapters\) [\d.]+ s, the LoRA merge [\d.]+ s", out
    )
    # The step count: the update's backward skips the weights' gradients, the merge is its own phase.
    assert re.search(r"^  merge +[\d.]+ TFLOP", out, re.M)


def test_lora_adapters_sampler_table_has_no_merged_copy(config_only, capsys):
    """``lora_sampler=adapters`` (auto's choice on a TPU): no merge, no merged row; the sampler reads the base
    with its adapters, both copied to the sampler's layout (tensor=4, float32 compute) as the trainer's merged
    params are. Adapters on tensor=4 (fsdp=1): the D sides whole; q_heads, mlp split 4 ways; K=2 kv heads
    whole (2 does not split 4 ways): per layer r x (7 D + 2 N H / 4 + 2 K H + 3 F / 4) float32 values."""
    assert main(_keys(config_only, hardware="tpu", lora_rank=4, lora_sampler="merged")) == 0
    merged = capsys.readouterr().out
    assert main(_keys(config_only, hardware="tpu", lora_rank=4)) == 0  # auto: adapters on a TPU
    out = capsys.readouterr().out
    D, L, N, K, H, F, r = 64, 2, 4, 2, 16, 128, 4
    for row in ("base weights (frozen; the reference too)", "adapters (float32)", "adapter optimizer state"):
        assert _row(out, row) == _row(merged, row)
    assert "merged weights" not in out and "merge temporaries" not in out and "LoRA merge" not in out
    assert not re.search(r"^  merge +[\d.]+ TFLOP", out, re.M)  # no merge in the step count either
    adapters_on_tensor = 4 * L * r * (7 * D + 2 * N * H // 4 + 2 * K * H + 3 * F // 4)
    assert adapters_on_tensor == 20480
    copy = _row(out, "params copied to the sampler's layout")
    assert copy == _row(merged, "params copied to the sampler's layout") + adapters_on_tensor
    # The phases hold no merged copy: the reference pass is its function alone (the merged plan's held the
    # merged base beside it); the rollout is the copy, the decode's temporaries and its other arguments and
    # outputs (cache, logits, tokens), as the merged plan's less its merged copy, plus the adapters' arguments
    # padded to the TPU's (8, 128) tiles (rank 4: 45,056 bytes here), under 4x their bytes.
    base = _row(out, "base weights (frozen; the reference too)")
    reference = "reference logprobs phase, beyond the resident arrays"
    assert _row(out, reference) == _row(merged, reference) - base
    rollout = "rollout phase, beyond the resident arrays"
    rest = lambda t, held: _row(t, rollout) - held - _row(t, "decode temporaries")  # noqa: E731
    merged_rest = rest(merged, base + _row(merged, "params copied to the sampler's layout"))
    assert 0 <= rest(out, copy) - merged_rest < 4 * adapters_on_tensor
    resident = sum(_row(out, row) for row in ("base weights (frozen; the reference too)", "adapters (float32)",
                                               "adapter optimizer state"))  # fmt: skip
    phases = [
        _row(out, f"{p} phase, beyond the resident arrays")
        for p in ("update", "reference logprobs", "rollout")
    ]
    assert _row(out, "peak, all colocated") == resident + max(phases)


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_qlora_table_holds_the_quantised_base(config_only, capsys, qtype):
    """QLoRA's plan: the base's projections quantised as the run quantises them (``lora.quantize_base`` on
    the abstract base: codes split as the weight is, scales split where their axis still divides), by hand on
    fsdp=4 (the D side of every matrix split 4 ways). Embeddings, head and norms stay float32 as in LoRA's."""
    pytest.importorskip("qwix")
    assert main(_keys(config_only, hardware="tpu", lora_rank=4, lora_base_dtype=qtype)) == 0
    out = capsys.readouterr().out
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    kept = 4 * (2 * V * D // 4 + L * 2 * D + D)  # embed and lm_head split on D, the norms whole
    values = L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)  # the seven projections
    if qtype == "int8":
        # 1 byte a value; a float32 scale per output channel: wq [L,1,N,H], wk and wv [L,1,K,H], w_gate and
        # w_up [L,1,F] whole (their D axis is 1), wo [L,1,1,D] and w_down [L,1,D] split on D.
        codes, scales = values // 4, 4 * L * (N * H + 2 * K * H + 2 * F + 2 * D // 4)
    else:
        # two codes a byte; a float32 scale per block of min(64, the innermost input axis) values: wq, wk, wv
        # and w_gate, w_up one block of D = 64 ([L,1,...] whole), wo per (N, D) (H = 16: one block; D split),
        # w_down two blocks of F = 128 ([L,2,D], D split).
        codes, scales = values // 2 // 4, 4 * L * (N * H + 2 * K * H + 2 * F + N * D // 4 + 2 * D // 4)
    base = _row(out, "base weights (frozen; the reference too)")
    assert base == kept + codes + scales == {"int8": 88576, "nf4": 79872}[qtype]
    assert _row(out, "adapters (float32)") == _adapters_per_chip(4, 4)  # as LoRA's
    assert "merged weights" not in out  # auto on a TPU: the adapters sampler reads the quantised base


def test_lora_update_compiles_with_the_adapters_on_their_weights_axes(config_only):
    """The compiled update takes each adapter leaf with the sharding the rules give it (no re-layout), and
    the base as a separate, not donated argument."""
    import dataclasses

    from grpax import sharding
    from grpax.plan.compile_check import build_job
    from grpax.rl.train_step import make_train_step

    cfg = build_config(TrainConfig, [*_keys(config_only, lora_rank=4, compile_topology="")[1:]])
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    job = build_job(cfg, *sharding.create_meshes(mesh_cfg, get_topology("v5e:2x2").devices))
    import jax
    from jax.sharding import PartitionSpec as P

    with jax.set_mesh(job.mesh):
        step = make_train_step(job.model_cfg, cfg.grpo(), job.optimizer, 1, lora=job.lora)
        lowered = step.func.lower(job.state, job.batch, base=job.base)
        compiled = lowered.compile()
    (state, _), kwargs = compiled.input_shardings
    specs = {
        jax.tree_util.keystr(path): s.spec
        for path, s in jax.tree_util.tree_flatten_with_path(state.params)[0]
    }
    # [L, D, r] / [L, r, D]: D on fsdp, the layer and rank axes replicated; the head and mlp sides on tensor=1.
    assert specs["['layers']['wq']['a']"] == P(None, "fsdp")  # trailing None dropped
    assert specs["['layers']['wo']['b']"] == P(None, None, "fsdp")
    assert specs["['layers']['w_down']['a']"] == P()
    placed = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, job.state.params))
    assert all(a.is_equivalent_to(b, 3) for a, b in zip(jax.tree.leaves(state.params), placed, strict=True))
    base = jax.tree.map(lambda x: x.sharding, job.base)
    assert all(
        a.is_equivalent_to(b, x.ndim)
        for a, b, x in zip(
            jax.tree.leaves(kwargs["base"]), jax.tree.leaves(base), jax.tree.leaves(job.base), strict=True
        )
    )
    (state_info, _), kwargs_info = lowered.args_info
    assert all(x.donated for x in jax.tree.leaves(state_info))  # adapters, their moments, the step
    assert not any(x.donated for x in jax.tree.leaves(kwargs_info["base"]))  # the frozen base is kept


def test_lora_nvidia_estimate_by_hand(config_only, capsys):
    """h100-8, fsdp=8: the LoRA table beside the full fine-tune's. Exact rows by hand; the estimated update
    holds the adapters' float32 gradients instead of the params'; the merged copy joins the rollout and the
    reference pass; the merge's temporaries are the float32 sums of every adapted weight (a 16-bit base only)."""
    assert main(_keys(config_only, compile_topology="h100-8")) == 0
    full = capsys.readouterr().out
    assert main(_keys(config_only, compile_topology="h100-8", lora_rank=4, lora_sampler="merged")) == 0
    out = capsys.readouterr().out
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    matrices = 2 * V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    params = 4 * (matrices // 8 + L * 2 * D + D)
    adapters = _adapters_per_chip(4, 8)
    assert adapters == 20224
    assert _row(out, "base weights (frozen; the reference too)") == _row(full, "params") == params
    assert _row(out, "adapters (float32)") == adapters
    assert _row(out, "adapter optimizer state") == 2 * adapters + 12
    assert _row(out, "merged weights for the sampler (LoRA: lora.merge)") == params
    update = "update temporaries"
    assert _row(full, update) - _row(out, update) == params - adapters  # float32 grads: params' vs adapters'
    merge = 0  # a float32 base: the sum in place (a bfloat16 one: below)
    assert _row(out, "merge temporaries") == merge
    for phase in ("rollout", "reference logprobs"):
        name = f"{phase} phase, beyond the resident arrays"
        assert _row(out, name) == _row(full, name) + params
    assert _row(out, "merge phase, beyond the resident arrays") == params + merge
    resident = params + adapters + 2 * adapters + 12
    phases = [
        _row(out, f"{name} phase, beyond the resident arrays")
        for name in ("update", "merge", "reference logprobs", "rollout")
    ]
    assert _row(out, "peak, all colocated") == resident + max(phases)
    # A bfloat16 base: the merge holds the float32 sums of every adapted weight, D split 8 ways.
    args = _keys(
        config_only, compile_topology="h100-8", lora_rank=4, weight_dtype="bfloat16", lora_sampler="merged"
    )
    assert main(args) == 0
    half = capsys.readouterr().out
    sums = 4 * L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F) // 8
    assert _row(half, "merge temporaries") == sums


def test_lora_step_flops_equal_a_hand_count():
    """LoRA r=2 on all modules, remat none: the backward computes the activations' gradients (1x the forward's
    matmuls) and the adapters' (2x theirs); each pass adds the adapters' own matmuls, 2 FLOPs per adapter
    parameter per token; the optimizer touches the adapters only; the merge is 2r FLOPs per adapted weight."""
    from grpax.models.lora import ALL_MODULES, LoraConfig, init_adapters

    cfg = TINY.replace(remat_policy="none")
    V, D, L, N, K, H, F = 512, 64, 2, 4, 2, 16, 128
    r = 2
    # Per layer r x (in + out) of each adapted weight: wq D+NH, wk and wv D+KH, wo NH+D, gate and up D+F, down F+D.
    adapter_params = L * r * ((D + N * H) + 2 * (D + K * H) + (N * H + D) + 2 * (D + F) + (F + D))
    import jax

    counted = jax.eval_shape(lambda: init_adapters(cfg, LoraConfig(r, 4.0, ALL_MODULES), jax.random.key(0)))
    assert sum(x.size for x in jax.tree.leaves(counted)) == adapter_params
    adapted = L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
    s = StepShape(1, 2, 4, 2, 1, 1, False, False, adapter_params, adapted, r, sampler=WHOLE_TABLE)
    phases = {p.name: p for p in step_phases(cfg, s, 1, 1, 1, 1, 1.0, 1.0)}
    no_lora = StepShape(1, 2, 4, 2, 1, 1, False, False, sampler=WHOLE_TABLE)
    full = {p.name: p for p in step_phases(cfg, no_lora, 1, 1, 1, 1, 1.0, 1.0)}
    per_token = 2 * L * (2 * D * N * H + 2 * D * K * H + 3 * D * F)
    attention = lambda q, k: 4 * L * N * H * q * k  # noqa: E731
    layers = per_token * (4 + 4) + attention(4, 4) + attention(4, 6)  # forward_grouped: 4 prompt + 2x2 tokens
    head = 2 * D * V * 4  # the completion tokens' vocabulary projection
    tokens = 4 + 2 * 2
    assert phases["update"].flops == 2 * layers + 3 * 2 * adapter_params * tokens + 3 * head
    assert full["update"].flops == 3 * layers + 4 * head
    assert phases["merge"].flops == 2 * r * adapted
    n = TINY.num_params()
    assert phases["merge"].bytes_per_chip == 2 * 4 * n  # read the float32 base, write the merged copy
    assert phases["update"].bytes_per_chip == 2 * 4 * n + adapter_params * (2 * 4 + 20)
    assert phases["decode"] == full["decode"]  # the sampler reads merged plain weights
    # The adapters sampler: no merge; prefill and decode add the adapters' matmuls, 2 FLOPs per adapter
    # parameter per token (P = 4 prompt tokens; C = 2: one decode step of 2 slots), and each step reads them.
    s = StepShape(
        1, 2, 4, 2, 1, 1, False, False, adapter_params, adapted, r, sampler_adapters=True, sampler=WHOLE_TABLE
    )
    adapters = {p.name: p for p in step_phases(cfg, s, 1, 1, 1, 1, 1.0, 1.0)}
    assert "merge" not in adapters and adapters["update"] == phases["update"]
    assert adapters["prefill"].flops == full["prefill"].flops + 2 * adapter_params * 4
    assert adapters["decode"].flops == full["decode"].flops + 2 * adapter_params * 2 * 1
    itemsize = {"float32": 4, "bfloat16": 2}[cfg.dtype]
    assert adapters["decode"].bytes_per_chip == full["decode"].bytes_per_chip + 1 * adapter_params * itemsize


def _decode_compile_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_compile", "benchmarks/decode_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("evictions", [True, False])
def test_the_tpu_decode_updates_its_cache_in_hbm(monkeypatch, evictions):
    """llama3.1-8b's decode loop cut to 3 layers, compiled for v6e-8 (the seed's sampler keys, 20 s): with the
    TPU compiler's default memory-space assignment a layer's cache buffers are staged in VMEM, updated there
    and written back to HBM at every step (a tiny model's are not); with the XLA backend's TPU options (no
    eviction) the loop bodies write nothing back. Which buffers the default stages depends on the whole
    program: at 4 layers it staged a pool while the loop wrote ``wo``'s slices out, and none since it reads
    them in place (``merge_heads``); at 3 layers it stages one either way."""
    from grpax.sampler import backend

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    if evictions:
        monkeypatch.setattr(backend, "XLA_TPU_OPTIONS", ())
    keys = [
        "model_name=llama3.1-8b-Instruct", "chips_per_vm=8", "rollout_data_parallelism=1",
        "rollout_tensor_parallelism=-1", "compile_topology=v6e-8",
    ]  # fmt: skip
    decode_compile = _decode_compile_module()
    cfg = build_config(TrainConfig, keys)
    text, _ = decode_compile.compile_decode(cfg, num_layers=3)
    backs = [
        size for kind, _, size in decode_compile.count_moves(text, 2**40)["loop"] if kind == "write-back"
    ]
    # A layer's page pool per chip: 257 pages x 32 tokens x (the key and the value of 1 kv head) x 128 in
    # bfloat16 (16 sequences of 16 pages and the scratch page), 4,210,688 bytes.
    pools = _layer_pool_bytes_per_chip(decode_compile, cfg, num_layers=3)
    assert pools == {257 * 32 * 2 * 128 * 2}, pools
    assert (pools.pop() in backs) == evictions, backs


@pytest.mark.parametrize(
    "sampler, merged",
    [
        ("plain", True),
        pytest.param("plain", False, marks=pytest.mark.slow),
        pytest.param("lora", True, marks=pytest.mark.slow),
        pytest.param("lora", False, marks=pytest.mark.slow),
    ],
)
def test_the_tpu_decode_reads_the_projections_in_place(monkeypatch, sampler, merged):
    """llama3.1-8b's decode loop cut to 2 layers, compiled for v6e-8 (the seed's sampler keys; "lora": rank-16
    adapters on every projection, ``lora_sampler=adapters``). With ``wo`` (and LoRA's ``wq``) sliced out of
    the stacked weight and reshaped after, the TPU compiler writes every layer's slice out at every step (a
    fusion of the loop body's ``slice``s); with the XLA backend's merged views (``merge_heads``) the loop body
    slices no weight out: each dot reads its slice in place."""
    from grpax.sampler import backend

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    if not merged:
        monkeypatch.setattr(backend, "merge_heads", lambda params: params)
    jax.clear_caches()  # the engine's jitted decode keeps its trace: the other case's lowering otherwise
    keys = [
        "model_name=llama3.1-8b-Instruct", "chips_per_vm=8", "rollout_data_parallelism=1",
        "rollout_tensor_parallelism=-1", "compile_topology=v6e-8",
    ]  # fmt: skip
    if sampler == "lora":
        keys += ["lora_rank=16", "lora_sampler=adapters"]
    decode_compile = _decode_compile_module()
    text, _ = decode_compile.compile_decode(build_config(TrainConfig, keys), num_layers=2)
    slices = [size for kind, _, size in decode_compile.count_moves(text, 2**20)["loop"] if kind == "slice"]
    # Per chip and layer, wo [32 / 8 heads, 128, 4096] and wq [4096, 32 / 8 heads, 128] in bfloat16: 4 MiB each.
    layer_weight = 4 * 128 * 4096 * 2
    written = {"plain": 2 * layer_weight, "lora": 2 * 2 * layer_weight}[sampler]
    assert sum(slices) == (0 if merged else written), slices


def _layer_pool_bytes_per_chip(decode_compile, cfg, num_layers: int) -> set[int]:
    """The per-chip bytes of each layer's page pool in the decode that ``compile_decode`` lowers."""
    import math

    from grpax.sampler import program_set
    from grpax.sampler.backend import select_backend

    job = decode_compile.topology_job(cfg, num_layers)
    sc = job.sampler_cfg
    backend = select_backend(sc.backend, job.rollout_params, job.model_cfg, sc.cache_dtype, concrete=False)
    programs = program_set.abstract_programs(
        job.rollout_params, job.model_cfg, sc, backend, cfg.batch_size, cfg.grpo().num_generations
    )
    pages = programs["decode"][1][1]
    return {math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(pages)}


@pytest.mark.slow
def test_the_update_with_remat_none_compiles_for_v6e_8(tmp_path):
    """llama3.2-1b's attention (32 heads of 64 over 8 kv heads) in a 1-layer model (D=256, F=512, V=512): the seed's
    keys, bfloat16 compute, compiled for v6e-8 (80 s). ``remat_policy=auto`` takes none and the TPU compiler used
    to fuse both attention einsums and the softmax into one three-deep fusion whose cost model overflowed a
    compiler thread's stack (SIGSEGV; issue 53); the softmax's output now crosses an optimization barrier. In a
    subprocess: a crash is a failed test, not a dead session."""
    shape = ModelConfig(
        vocab_size=512, hidden_dim=256, num_layers=1, num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=512,
        eos_token_ids=(1,),
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(shape, "float32")))
    keys = [
        "model_name=", f"load_parameters_path={tmp_path}", "dtype=bfloat16", "chips_per_vm=8",
        "rollout_data_parallelism=1", "rollout_tensor_parallelism=-1", "compile_topology=v6e-8",
    ]  # fmt: skip
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1")
    cmd = [sys.executable, "-m", "grpax", "train_rl", *keys]
    repo = Path(__file__).resolve().parents[1]  # python -m imports this tree's grpax
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=repo)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "chosen by the memory plan: remat_policy=auto -> none" in done.stdout, done.stdout
    assert "fits: peak" in done.stdout
