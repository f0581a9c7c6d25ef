"""Expert parallelism on 8 fake CPU devices: a mixture of experts split over the ``expert`` mesh axis computes
what one device computes (the forward and its routing, the GRPO update, a whole rollout and update).

As in tests/test_sharding.py the 8-device tests run in a child pytest started with
``--xla_force_host_platform_device_count=8``; in the parent they are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax import sharding as sh
from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig

IN_CHILD = os.environ.get("GRPAX_TEST_FAKE_DEVICES") == "8"
on_8_devices = pytest.mark.skipif(
    not IN_CHILD, reason="runs in the 8-device child of test_moe_on_8_fake_devices"
)

# 8 experts (one per device at expert=8), heads, vocab, embed and expert widths that divide every mesh below.
CFG = ModelConfig(
    vocab_size=128, hidden_dim=64, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16, mlp_dim=128,
    family="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True,
)  # fmt: skip
MESHES = {
    "expert8": sh.MeshConfig(ici_fsdp_parallelism=1, ici_expert_parallelism=8),
    "fsdp8": sh.MeshConfig(
        ici_fsdp_parallelism=8
    ),  # no expert axis: the experts per chip, gathered (moe._per_chip)
    "fsdp2xexpert4": sh.MeshConfig(ici_fsdp_parallelism=2, ici_expert_parallelism=4),
    "data2xtensor2xexpert2": sh.MeshConfig(
        ici_data_parallelism=2, ici_fsdp_parallelism=1, ici_tensor_parallelism=2, ici_expert_parallelism=2
    ),
}


def test_moe_on_8_fake_devices():
    if IN_CHILD:
        pytest.skip("this is the child run")
    env = dict(
        os.environ,
        GRPAX_TEST_FAKE_DEVICES="8",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-rs"],
        env=env, capture_output=True, text=True, timeout=1800, cwd=os.path.dirname(os.path.dirname(__file__)),
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "1 skipped" in out.splitlines()[-1], out  # only the parent test itself


@pytest.fixture(scope="module")
def params():
    """Decisive routers (x50): the one-device and the split runs pick the same experts."""
    p = init_params(CFG, jax.random.key(0))
    return {**p, "layers": {**p["layers"], "router": p["layers"]["router"] * 50}}


def test_expert_parallelism_keys_make_the_mesh_axis():
    assert sh.MeshConfig().ici_expert_parallelism == 1 and "expert" in sh.MESH_AXES
    spec = sh.logical_to_spec(
        ("layers", "experts", "embed", "mlp"), shape=(2, 8, 64, 32), mesh_shape={"fsdp": 2, "expert": 4}
    )
    assert spec == jax.sharding.PartitionSpec(None, "expert", "fsdp")


@on_8_devices
@pytest.mark.parametrize("name", list(MESHES))
def test_expert_parallel_forward_equals_one_device(name, params):
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)
    expected, _, routing = forward(params, tokens, CFG, return_routes=True)
    mesh = sh.create_mesh(MESHES[name])
    sharded = sh.shard_params(params, CFG, mesh)
    spec = sharded["layers"]["expert_gate"].sharding.spec  # [L, E, D, F]: E split, or D (FSDP)
    assert spec[2] == "fsdp" if name == "fsdp8" else spec[1] == "expert", spec
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda p, t: forward(p, t, CFG, return_routes=True))
        logits, _, split = fn(sharded, sh.shard_batch(tokens, mesh))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5, rtol=0)
    assert np.array_equal(np.asarray(split.experts), np.asarray(routing.experts))


def _score(rows, out):
    """Points for the completion's even token ids: a reward that varies within each group."""
    ids, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask) > 0
    return {"total": np.array([float(np.sum(ids[i][mask[i]] % 2 == 0)) for i in range(len(rows))])}, np.zeros(
        len(rows)
    )


def _step(params, mesh_cfg: sh.MeshConfig | None, router_replay: str):
    """One GRPO step (rollout of 4 prompts x G = 2, sampled, routing recorded; then the update) on one device
    (``mesh_cfg`` None) or on the trainer's and the sampler's meshes of ``mesh_cfg``."""
    import optax

    from grpax.rl.config import GRPOConfig
    from grpax.rl.rollout import Rollout
    from grpax.rl.train_step import TrainState, make_train_step, make_update
    from grpax.sampler.keys import SamplerConfig
    from grpax.sharding import mesh_context

    grpo = GRPOConfig(beta=0.0, temperature=1.0, num_generations=2, router_replay=router_replay)
    sc = SamplerConfig(max_prompt_length=8, max_completion_length=12, pad_token_id=0, record_routes=True)
    mesh = rollout_mesh = None
    params = jax.tree.map(jnp.array, params)
    if mesh_cfg is not None:
        mesh, rollout_mesh = sh.create_meshes(mesh_cfg)
        params = sh.shard_params(params, CFG, mesh)
    rollout = Rollout(CFG, sc, grpo, _score, mesh=mesh, rollout_mesh=rollout_mesh, min_completion_bucket=0)
    rollout.update_params(params, 0)
    rows = [{"prompt_ids": [3 + i, 5, 7 + i][: 2 + i % 2]} for i in range(4)]
    batch = rollout(rows, jax.random.key(4))
    optimizer = optax.sgd(0.5)
    opt_state = optimizer.init(params) if mesh is None else sh.init_optimizer_state(optimizer, params, mesh)
    state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32))
    update = make_update(make_train_step(CFG, grpo, optimizer, num_micro_batches=2), 1)
    with mesh_context(mesh):
        state, metrics = update(state, batch)
    return batch, metrics, state.params


@on_8_devices
@pytest.mark.parametrize(
    "mesh_cfg",
    [
        sh.MeshConfig(ici_fsdp_parallelism=1, ici_expert_parallelism=8, rollout_expert_parallelism=8,
                      rollout_tensor_parallelism=1),
        sh.MeshConfig(ici_fsdp_parallelism=2, ici_expert_parallelism=4, rollout_data_parallelism=2,
                      rollout_tensor_parallelism=1, rollout_expert_parallelism=4),
        sh.MeshConfig(ici_fsdp_parallelism=8, rollout_data_parallelism=1, rollout_tensor_parallelism=8),
    ],
    ids=["expert8", "fsdp2xexpert4-rollout_dp2xep4", "fsdp8-rollout_tp8"],
)  # fmt: skip
def test_expert_parallel_grpo_step_equals_one_device(mesh_cfg, params):
    """The same rollout (tokens, rewards, the sampler's logprobs and recorded routing) and the same update (loss,
    router disagreement, weights after SGD) on one device and with the experts split over 8 (or, fsdp=8, partitioned by the compiler)."""
    one_batch, one_metrics, one_params = _step(params, None, "replay")
    batch, metrics, new_params = _step(params, mesh_cfg, "replay")
    assert np.array_equal(np.asarray(batch.completion_ids), np.asarray(one_batch.completion_ids))
    np.testing.assert_array_equal(batch.host.rewards["total"], one_batch.host.rewards["total"])
    assert np.std(one_batch.host.rewards["total"]) > 0
    np.testing.assert_allclose(
        np.asarray(batch.rollout_logprobs), np.asarray(one_batch.rollout_logprobs), atol=1e-5, rtol=0
    )
    assert np.array_equal(np.asarray(batch.routed_experts), np.asarray(one_batch.routed_experts))
    assert np.array_equal(
        np.asarray(batch.prompt_routed_experts), np.asarray(one_batch.prompt_routed_experts)
    )
    for key in ("loss", "grad_norm", "router/disagreement_mean", "mismatch/logprob_diff_max"):
        np.testing.assert_allclose(float(metrics[key]), float(one_metrics[key]), atol=1e-5, rtol=1e-5)
    assert float(one_metrics["grad_norm"]) > 0
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
