"""MaxText's ``remat_policy=custom`` (grpax.rl.remat_keys): the named activations kept on the device or offloaded to
host memory change what the backward pass keeps, never the gradients; the keys reach the model and are refused
in one line where they cannot apply."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.config import ConfigError, build_config
from grpax.models import llama
from grpax.models.params import init_params
from grpax.models.registry import REMAT_NAMES, ModelConfig
from grpax.plan.memory_estimate import remat_extra
from grpax.rl.train_config import TrainConfig, validate

CFG = ModelConfig(
    vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
    dtype="float32", weight_dtype="float32",
)  # fmt: skip
KEPT = (("decoder_layer_input", "device"), ("query_proj", "device"), ("mlpwi_0", "device"))


def _grouped_loss(cfg):
    """A scalar of the trainer's forward (``forward_grouped``: 2 prompts of 6 tokens, 2 completions each of 4)."""
    prompts = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    completions = jax.random.randint(jax.random.key(2), (4, 4), 0, cfg.vocab_size)
    mask = jnp.ones((2, 6), jnp.int32)
    return lambda p: jnp.mean(llama.forward_grouped(p, prompts, mask, completions, cfg)[0] ** 2)


def _grads(cfg):
    return jax.jit(jax.value_and_grad(_grouped_loss(cfg)))(init_params(cfg, jax.random.key(0)))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_trainers_forward_names_every_activation(family):
    # Every name a key sets is in the update's forward (forward_grouped), dense and mixture of experts alike.
    cfg = CFG if family == "llama" else CFG.replace(
        family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16
    )  # fmt: skip
    text = str(jax.make_jaxpr(_grouped_loss(cfg))(init_params(cfg, jax.random.key(0))))
    assert {name for name in REMAT_NAMES if f"name={name}" in text} == set(REMAT_NAMES)


def test_custom_keeps_other_activations_but_computes_the_same_gradients():
    full = _grads(dataclasses.replace(CFG, remat_policy="full"))
    none = _grads(CFG)
    for names in ((), KEPT):
        custom = _grads(dataclasses.replace(CFG, remat_policy="custom", remat_names=names))
        for a, b, c in zip(
            jax.tree.leaves(custom), jax.tree.leaves(full), jax.tree.leaves(none), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)


def test_what_custom_keeps_on_the_device_is_counted_by_hand():
    # forward_grouped of 2 prompts of P = 8 tokens and 4 completions of C = 4: 2 * 8 + 4 * 4 = 32 tokens per
    # layer. Kept on the device beyond remat full: the q projection, 32 x N * H = 32 x 32 float32 values (4 KiB),
    # and the gate projection, 32 x F = 32 x 64 (8 KiB); the layer's input is full's own residual already.
    tokens = 2 * 8 + 4 * 4
    extra = lambda names: remat_extra(  # noqa: E731
        dataclasses.replace(CFG, remat_policy="custom", remat_names=names), 2, 4, 8, 4, 1, 1.0
    )
    assert extra((("query_proj", "device"),)) == tokens * 32 * 4
    assert extra(KEPT) == tokens * (32 + 64) * 4
    # offloaded activations are in host memory: nothing beyond full on the device
    assert extra((("query_proj", "offload"), ("mlpwi_0", "offload"))) == 0


def test_the_keys_reach_the_model_config_and_bad_ones_are_refused():
    rl_yml = ["remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload", "key_proj=offload"]
    cfg = build_config(TrainConfig, ["load_parameters_path=x", *rl_yml, "value_proj=offload", "mlpwo=device"])
    validate(cfg)
    assert cfg.model_keys()["remat_policy"] == "custom"
    assert cfg.model_keys()["remat_names"] == (
        ("decoder_layer_input", "offload"), ("query_proj", "offload"), ("key_proj", "offload"),
        ("value_proj", "offload"), ("mlpwo", "device"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^query_proj='host': expected one of remat, device, offload$"):
        validate(
            build_config(TrainConfig, ["load_parameters_path=x", "remat_policy=custom", "query_proj=host"])
        )
    with pytest.raises(
        ConfigError,
        match=r"^query_proj=offload names what remat_policy=custom keeps, but remat_policy=full: pass "
        r"remat_policy=custom, or drop query_proj$",
    ):
        validate(
            build_config(TrainConfig, ["load_parameters_path=x", "remat_policy=full", "query_proj=offload"])
        )


def test_maxtext_fused_projection_names_are_accepted_as_remat_and_refused_otherwise():
    build_config(TrainConfig, ["load_parameters_path=x", "mlpwi=remat", "qkv_proj=remat"])
    with pytest.raises(ConfigError, match=r"^mlpwi=offload .*; name them mlpwi_0 and mlpwi_1"):
        build_config(TrainConfig, ["load_parameters_path=x", "remat_policy=custom", "mlpwi=offload"])


@pytest.mark.slow
def test_offloaded_activations_go_to_host_memory_on_tpu():
    """The TPU compiler's own plan (libtpu, no TPU) of the trainer's backward pass (``forward_grouped``):
    offloading the layer inputs and q projections moves exactly their bytes to host memory."""
    from jax.sharding import SingleDeviceSharding

    from grpax.plan.topology import get_topology

    cfg = ModelConfig(
        vocab_size=256, hidden_dim=256, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=128, mlp_dim=512,
        dtype="bfloat16", weight_dtype="float32",
    )  # fmt: skip
    place = SingleDeviceSharding(get_topology("v6e-1").devices[0])
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place),
        jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))),
    )
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=place)  # noqa: E731
    batch = (
        ints(2, 1024),
        ints(2, 1024),
        ints(8, 768),
    )  # 2 prompts of 1024 tokens, 4 completions each of 768

    def plan(names):
        c = dataclasses.replace(cfg, remat_policy="custom", remat_names=names)
        loss = lambda p, *b: llama.forward_grouped(p, *b, c)[0].astype(jnp.float32).mean()  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params, *batch).compile().memory_analysis()

    names = ("decoder_layer_input", "query_proj")
    offloaded, kept = plan(tuple((n, "offload") for n in names)), plan(tuple((n, "device") for n in names))
    # 2 layers x 2 names x (2 x 1024 + 8 x 768 = 8192 tokens) x 256 values x 2 B
    assert offloaded.host_temp_size_in_bytes == 2 * 2 * 8192 * 256 * 2 == 16 * 2**20
    assert kept.host_temp_size_in_bytes == 0
    assert offloaded.temp_size_in_bytes < kept.temp_size_in_bytes - 16 * 2**20
