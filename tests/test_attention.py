"""The attention seam (grpax.models.attention): every implementation JAX runs here gives dot_product's values.

dot_product is the XLA einsum attention the parity tests (tests/test_model_parity.py, tests/test_families.py)
hold against transformers; the others are held against it, in float32, through the model's three paths: the
forward without a cache (the update's and the reference's), the cached prefill and decode (the sampler's XLA
backend), and ``forward_grouped``.
"""

import ast
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CPU_HAS_AVX512

from grpax.errors import ConfigError
from grpax.models import attention
from grpax.models.llama import forward, forward_grouped, init_cache
from grpax.models.params import init_params
from grpax.models.registry import ATTENTION_IMPLEMENTATIONS, ModelConfig
from grpax.sampler.engine import generate
from grpax.sampler.keys import SamplerConfig

# GQA (4 query heads per 2 kv heads), one sliding-window layer, a scores factor that is not 1 / sqrt(H).
CFG = ModelConfig(
    vocab_size=61,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    layer_types=("local", "global"),
    sliding_window=3,
    query_pre_attn_scalar=12.0,
)
# The implementations that run where the tests run (cudnn: only on a GPU).
HERE = [
    name
    for name, impl in attention.IMPLEMENTATIONS.items()
    if not impl.platforms or jax.default_backend() in impl.platforms
]
OTHERS = [name for name in HERE if name != "dot_product"]
# float32 throughout: the implementations differ only in rounding (scores * (1 / sqrt(H)) against / sqrt(H)).
ATOL = 1e-5
# A whole model's logits (two layers of peaked, x15 weights): a score's rounding difference grows through the
# softmaxes; under 1e-5 on AVX-512 CPUs, 6.0e-5 of logits up to 7.5 on an AVX2 AMD EPYC (conftest.CPU_HAS_AVX512).
MODEL_ATOL = ATOL if CPU_HAS_AVX512 or jax.default_backend() != "cpu" else 1e-4


@pytest.fixture(scope="module")
def params():
    p = jax.jit(init_params, static_argnums=0)(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)  # peaked logits, as tests/test_engine.py


def test_the_names_are_the_configs_values():
    assert tuple(attention.IMPLEMENTATIONS) == ATTENTION_IMPLEMENTATIONS


def test_chunked_attention_equals_attention(monkeypatch):
    """Query blocks of 4 over T = 10 (the last block padded): the same outputs and gradients as at once."""
    monkeypatch.setattr(attention, "_QUERY_CHUNK", 4)
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(2, 10, 4, 8)).astype(np.float32))
    k, v = (jnp.asarray(rng.normal(size=(2, 13, 2, 8)).astype(np.float32)) for _ in range(2))
    mask = jnp.asarray(rng.random((2, 10, 13)) < 0.7)
    np.testing.assert_allclose(
        jax.jit(attention.chunked_attention)(q, k, v, mask), attention.attention(q, k, v, mask), atol=1e-6
    )
    grads = [
        jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a, mask) ** 2), argnums=(0, 1, 2)))(q, k, v)
        for f in (attention.chunked_attention, attention.attention)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("name", OTHERS)
def test_implementation_equals_dot_product(name):
    """Outputs and gradients, with a fully masked query row (padding) and a scores factor."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 6, 4, 8)).astype(np.float32))
    k, v = (jnp.asarray(rng.normal(size=(2, 7, 2, 8)).astype(np.float32)) for _ in range(2))
    mask = jnp.asarray(rng.random((2, 6, 7)) < 0.6).at[1, 2].set(False)
    attend = attention.IMPLEMENTATIONS[name].attend
    for scale in (None, 0.3):
        want = jax.jit(attention.attention, static_argnums=4)(q, k, v, mask, scale)
        np.testing.assert_allclose(jax.jit(attend, static_argnums=4)(q, k, v, mask, scale), want, atol=ATOL)
    grads = [
        jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a, mask) ** 2), argnums=(0, 1, 2)))(q, k, v)
        for f in (attend, attention.attention)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("name", OTHERS)
def test_model_logits_equal_dot_product(params, name):
    """forward (left-padded rows), cached prefill + decode, and forward_grouped: dot_product's values."""
    other = CFG.replace(attention=name)
    run = jax.jit(forward, static_argnums=2)
    tokens = jnp.asarray([[0, 0, 5, 9, 11, 3], [7, 21, 30, 2, 4, 6]], jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1] * 6], jnp.int32)
    want, _ = run(params, tokens, CFG, attention_mask=mask)
    got, _ = run(params, tokens, other, attention_mask=mask)
    np.testing.assert_allclose(got, want, atol=MODEL_ATOL)

    def prefill_and_decode(cfg):
        cache = init_cache(cfg, 2, 8)
        positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
        logits, cache = run(params, tokens, cfg, positions=positions, cache=cache)
        step, _ = run(params, tokens[:, -1:], cfg, positions=jnp.full((2, 1), 6, jnp.int32), cache=cache)
        return logits, step

    for got, want in zip(prefill_and_decode(other), prefill_and_decode(CFG), strict=True):
        np.testing.assert_allclose(got, want, atol=MODEL_ATOL)
    prompt_ids, prompt_mask = tokens[:, :4], mask[:, :4]
    completions = jnp.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], jnp.int32)
    grouped = jax.jit(forward_grouped, static_argnums=4)
    np.testing.assert_allclose(
        grouped(params, prompt_ids, prompt_mask, completions, other),
        grouped(params, prompt_ids, prompt_mask, completions, CFG),
        atol=MODEL_ATOL,
    )


@pytest.mark.parametrize("name", OTHERS)
def test_sampler_xla_backend_samples_the_same(params, name):
    sc = SamplerConfig(max_prompt_length=8, max_completion_length=6, greedy=True, backend="xla")
    prompts = [[5, 9, 11, 3], [1, 2]]
    want = generate(params, prompts, CFG, sc, jax.random.key(1))
    got = generate(params, prompts, CFG.replace(attention=name), sc, jax.random.key(1))
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=MODEL_ATOL)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn runs here")
def test_a_gpu_only_choice_is_refused_in_one_line(params):
    cfg = CFG.replace(attention="cudnn", dtype="bfloat16")
    with pytest.raises(ConfigError) as e:
        forward(params, jnp.zeros((1, 3), jnp.int32), cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith("attention=cudnn runs on gpu only"), message


def test_config_refusals():
    with pytest.raises(
        ConfigError,
        match="attention='dot_prodcut': expected one of dot_product, jax_nn, cudnn, flash. Did you",
    ):
        CFG.replace(attention="dot_prodcut")
    with pytest.raises(
        ConfigError, match="attention='autoselected' is MaxText's per-platform choice, which grpax does not"
    ):
        CFG.replace(attention="autoselected")
    with pytest.raises(
        ConfigError, match="attention=flash has no sliding-window layers.*attention=dot_product"
    ):
        CFG.replace(attention="flash")
    with pytest.raises(ConfigError, match="attention=jax_nn has no soft-capping.*pass attention=dot_product"):
        CFG.replace(attention="jax_nn", attn_logit_softcap=50.0)


def test_profiles_name_each_block_step(params):
    """The compiled forward's ops carry the block steps' names (what an accelerator profile shows)."""
    lowered = jax.jit(forward, static_argnums=2).lower(params, jnp.zeros((1, 3), jnp.int32), CFG)
    text = lowered.compile().as_text()
    for scope in ("qkv", "rope", "attention", "attention_out", "mlp"):
        assert f"/{scope}/" in text, scope


def test_models_import_nothing_from_above():
    """grpax/models imports only grpax.models and the grpax.errors leaf (its README "Layout" line)."""
    folder = Path(attention.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.startswith("grpax"):
                    assert name.startswith("grpax.models") or name == "grpax.errors", (path.name, name)


def test_decode_scores_as_a_matmul_equal_the_multiply_reduce():
    # Accelerators score the cache with a matmul (no float32 copy of the keys per step), CPU with a multiply-
    # reduce: the same scores, for a float32 cache exactly up to summation order, for a bfloat16 cache as the
    # reduce of the query rounded to bfloat16.
    kq, kk = jax.random.split(jax.random.key(0))
    q1 = jax.random.normal(kq, (3, 2, 4, 16), jnp.float32)  # [B, K, G, H]
    keys = jax.random.normal(kk, (3, 2, 16, 40), jnp.float32)  # [B, K, H, S]
    np.testing.assert_allclose(
        attention._scores_dot(q1, keys), attention._scores_reduce(q1, keys), rtol=1e-5, atol=1e-5
    )
    k16 = keys.astype(jnp.bfloat16)
    want = attention._scores_reduce(q1.astype(jnp.bfloat16).astype(jnp.float32), k16)
    np.testing.assert_allclose(attention._scores_dot(q1, k16), want, rtol=1e-5, atol=1e-5)


# attention=flash (Pallas's splash kernel, TPU only) run by Pallas's interpreter: the values on this CPU.
FLASH_CFG = CFG.replace(layer_types=(), sliding_window=None)
FLASH_HERE = attention.Implementation(
    functools.partial(attention.flash_attention, interpret=True), causal_blocks=True
)


def _causal_case(rng, B, T, S, N, K, valid):
    """q, k, v and the model's mask: causal over the last T of S keys, and ``valid`` keys."""
    q = jnp.asarray(rng.normal(size=(B, T, N, 8)).astype(np.float32))
    k, v = (jnp.asarray(rng.normal(size=(B, S, K, 8)).astype(np.float32)) for _ in range(2))
    causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + S - T
    return q, k, v, causal[None] & jnp.asarray(valid, bool)[:, None, :]


@pytest.mark.parametrize(
    "T, S, valid",
    [  # Pallas's interpreter takes ~20 s a case here: two in the default suite
        pytest.param(8, 8, [[1] * 8], marks=pytest.mark.slow),  # causal
        pytest.param(5, 12, [[1] * 12], marks=pytest.mark.slow),  # the last 5 of 12 keys
        pytest.param(7, 7, [[0, 0, 1, 1, 1, 1, 1], [1] * 7], marks=pytest.mark.slow),  # left-padded prompts
        (5, 12, [[0, 0] + [1] * 10, [1] * 12]),  # completions after a left-padded prompt (forward_grouped's)
        (130, 140, [[0] * 3 + [1] * 137]),  # more than one block of queries and keys, both padded
    ],
)
def test_flash_equals_dot_product(T, S, valid):
    """Real queries' outputs and the gradients of a loss over them: dot_product's, with soft-capping and sinks."""
    rng = np.random.default_rng(T + S)
    B = len(valid)
    q, k, v, mask = _causal_case(rng, B, T, S, 4, 2, valid)
    real = jnp.asarray(valid, jnp.float32)[:, S - T :, None, None]  # queries at padding compute anything
    w = jnp.asarray(rng.normal(size=q.shape).astype(np.float32))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    flash = functools.partial(attention.flash_attention, interpret=True)
    for scale, cap, s in ((None, None, None), (0.3, 5.0, sinks)):

        def loss(f, q, k, v, scale=scale, cap=cap, s=s):
            return jnp.sum(f(q, k, v, mask, scale, cap, s) * w * real)

        want = attention.attention(q, k, v, mask, scale, cap, s) * real
        np.testing.assert_allclose(flash(q, k, v, mask, scale, cap, s) * real, want, atol=ATOL)
        grads = [
            jax.grad(functools.partial(loss, f), argnums=(0, 1, 2))(q, k, v)
            for f in (flash, attention.attention)
        ]
        for got, want in zip(*grads, strict=True):
            np.testing.assert_allclose(got, want, atol=ATOL)


def test_flash_model_equals_dot_product(monkeypatch):
    """forward (left-padded rows), forward_grouped and its gradient, and the cached prefill and decode (which
    attend by dot_product): the values of attention=dot_product."""
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "flash", FLASH_HERE)
    params = jax.jit(init_params, static_argnums=0)(FLASH_CFG, jax.random.key(0))
    flash = FLASH_CFG.replace(attention="flash")
    tokens = jnp.asarray([[0, 0, 5, 9, 11, 3], [7, 21, 30, 2, 4, 6]], jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1] * 6], jnp.int32)
    run = jax.jit(forward, static_argnums=2)
    got, want = (run(params, tokens, c, attention_mask=mask)[0] for c in (flash, FLASH_CFG))
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=ATOL)
    cache = init_cache(FLASH_CFG, 2, 8)
    got, want = (run(params, tokens, c, cache=cache)[0] for c in (flash, FLASH_CFG))
    np.testing.assert_allclose(got, want, atol=ATOL)

    completions = jnp.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], jnp.int32)

    def loss(p, cfg):
        return jnp.sum(forward_grouped(p, tokens[:, :4], mask[:, :4], completions, cfg) ** 2)

    grouped = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (got, got_grads), (want, want_grads) = grouped(params, flash), grouped(params, FLASH_CFG)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # float32 sums in another order (the kernel's online softmax, block by block): 1e-4 of each gradient, 1e-5 of
    # its leaf's largest
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))


def test_flash_is_refused_off_a_tpu_in_one_line():
    params = jax.jit(init_params, static_argnums=0)(FLASH_CFG, jax.random.key(0))
    with pytest.raises(ConfigError) as e:
        forward(params, jnp.zeros((1, 3), jnp.int32), FLASH_CFG.replace(attention="flash"))
    message = str(e.value)
    assert "\n" not in message and message.startswith("attention=flash runs on tpu only"), message


def test_flash_compiles_for_a_tpu_from_this_host():
    """The update's forward and backward with attention=flash, compiled for a TPU v5e by libtpu here: the
    platform is the mesh's (a TPU's), not this host's."""
    pytest.importorskip("libtpu")
    from grpax.models.sharding_rules import MESH_AXES
    from grpax.plan.topology import get_topology

    device = get_topology("v5e-1").devices[0]
    mesh = jax.sharding.Mesh(np.asarray([device], dtype=object).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    cfg = FLASH_CFG.replace(attention="flash", num_heads=4, num_kv_heads=2, head_dim=128, hidden_dim=256)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def loss(p, prompt_ids, prompt_mask, completion_ids):
        return jnp.sum(forward_grouped(p, prompt_ids, prompt_mask, completion_ids, cfg))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, ints(2, 256), ints(2, 256), ints(4, 256)).compile()
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas kernel, lowered by Mosaic
