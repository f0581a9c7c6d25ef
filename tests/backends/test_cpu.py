"""The CPU backend (grpax.backends.cpu): each kernel against XLA's ops or float64 products, the packed prefill
and the decode step against the model's own forward, the backend's choice (grpax.sampler.backend), and whole
rollouts of the CPU backend against the XLA backend."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.backends.cpu import backend as cpu_backend
from grpax.backends.cpu import build, ops
from grpax.models.attention import cached_attention
from grpax.models.llama import forward, init_cache, logits_from_hidden
from grpax.models.params import convert_layout, init_params
from grpax.models.registry import ModelConfig
from grpax.sampler.backend import select_backend
from grpax.sampler.engine import generate
from grpax.sampler.keys import SamplerConfig

# CI sets GRPAX_REQUIRE_CPU_KERNELS=1 (scripts/test.sh): there a kernel that fails to build is a failure,
# elsewhere (no compiler) these tests are skipped and the sampler uses XLA's attention.
if not build.available():
    if os.environ.get("GRPAX_REQUIRE_CPU_KERNELS") == "1":
        raise RuntimeError(f"the CPU kernels did not build: {build._load()}")
    pytest.skip(f"CPU kernel unavailable: {build._load()}", allow_module_level=True)

CFG = ModelConfig(
    vocab_size=61,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    rope_theta=10000.0,
)
PROMPTS = [[5, 9, 11, 3, 7, 21, 30], [1, 2], [40, 41, 42, 43, 44], [17]]


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0))
    # std 0.02 gives near-uniform logits (argmax ties); std ~0.3 makes the distributions peaked and varied
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)


def _sc(**kw):
    return SamplerConfig(**{**dict(max_prompt_length=16, max_completion_length=12, greedy=True), **kw})


def _paged_case(B, K, G, H, S, page_size, dtype, scale, seed=0):
    """Random queries, new keys/values and S-slot sequences in a shuffled pool of pages in the CPU layout (keys
    [P, K, H, ps], values [P, K, ps, H]), with the same sequences as a dense cache (keys [B, K, H, S'], values
    [B, K, S', H], S' = their pages' slots); positions: row 0 at the last slot, the last row at slot 0, row 1
    idle (-1) where B > 2."""
    rng = np.random.default_rng(seed)
    n = -(-S // page_size)
    num_pages = 1 + B * n + 2
    table = rng.permutation(np.arange(1, num_pages))[: B * n].reshape(B, n).astype(np.int32)
    k_pages = rng.standard_normal((num_pages, K, H, page_size)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, K, page_size, H)).astype(np.float32)
    dense_k = np.concatenate([k_pages[table[:, w]] for w in range(n)], axis=-1)  # [B, K, H, n ps]
    dense_v = np.concatenate([v_pages[table[:, w]] for w in range(n)], axis=-2)
    positions = rng.integers(0, S, B).astype(np.int32)
    positions[0], positions[-1] = S - 1, 0
    if B > 2:
        positions[1] = -1
    q = jnp.asarray(rng.standard_normal((B, 1, K * G, H), np.float32) * scale)  # rotated, not scaled
    new_k, new_v = (rng.standard_normal((B, K, H)).astype(np.float32) for _ in range(2))
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    return (
        jnp.asarray(q), cast(new_k), cast(new_v), cast(k_pages), cast(v_pages), jnp.asarray(table),
        jnp.asarray(positions), cast(dense_k), cast(dense_v),
    )  # fmt: skip


_paged_update = jax.jit(ops.paged_attention_update)


@pytest.mark.parametrize(
    "B, K, G, H, S, page_size, dtype",
    [
        (3, 2, 3, 64, 37, 16, jnp.float32),  # SmolLM2's group and head sizes; slots not a multiple of 8 or 32
        (4, 1, 1, 20, 9, 4, jnp.float32),  # head_dim not a multiple of 8, pages smaller than a vector
        (2, 3, 8, 128, 70, 32, jnp.float32),  # the largest group the kernel takes; Llama 3's head_dim
        (5, 2, 2, 40, 1, 8, jnp.float32),  # one slot
        (4, 3, 3, 64, 100, 48, jnp.bfloat16),  # a bfloat16 cache; pages not a multiple of the score blocks
    ],
)
@pytest.mark.parametrize("scale", [1.0, 30.0])  # peaked softmax: most exps underflow
def test_paged_kernel_writes_its_page_then_attends_as_xla(B, K, G, H, S, page_size, dtype, scale):
    q, new_k, new_v, k_pages, v_pages, table, positions, dense_k, dense_v = _paged_case(
        B, K, G, H, S, page_size, dtype, scale
    )
    q1 = q.reshape(B, K, G, H) / math.sqrt(H)  # the kernel's queries: [B, K, G, H], scaled
    out, got_k, got_v = _paged_update(q1, new_k, new_v, k_pages, v_pages, table, positions)
    assert out.shape == (B, K, G, H) and out.dtype == jnp.float32
    # the pools: each running sequence's new key and value at its position's page and offset, nothing else
    ref_k, ref_v = np.asarray(k_pages, np.float32).copy(), np.asarray(v_pages, np.float32).copy()
    for b, p in enumerate(np.asarray(positions)):
        if p >= 0:
            page = int(table[b, p // page_size])
            ref_k[page, :, :, p % page_size] = np.asarray(new_k[b], np.float32)
            ref_v[page, :, p % page_size, :] = np.asarray(new_v[b], np.float32)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), ref_k)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), ref_v)
    # the attention: XLA's float32 attention over the same keys/values laid out densely, new ones written
    rows = jnp.arange(B)[:, None]
    at = jnp.maximum(positions, 0)[:, None]
    dense_k = dense_k.astype(jnp.float32).at[rows, :, :, at].set(new_k[:, None].astype(jnp.float32))
    dense_v = dense_v.astype(jnp.float32).at[rows, :, at, :].set(new_v[:, None].astype(jnp.float32))
    mask = jnp.arange(dense_k.shape[-1])[None, None, :] <= positions[:, None, None]
    ref = jax.jit(cached_attention)(q, dense_k, dense_v, mask)
    live = np.asarray(positions) >= 0
    got = np.asarray(out).reshape(B, 1, K * G, H)
    np.testing.assert_allclose(got[live], np.asarray(ref)[live], atol=2e-6, rtol=0)
    np.testing.assert_array_equal(got[~live], 0.0)  # an idle slot: zeros
    # by hand for one row: softmax over the visible slots of row 0, query head 1 (kv head 1 // G); at scale 30
    # the float32 scores (~300) themselves carry ~3e-5 of rounding, which float64 does not share
    if scale != 1.0:
        return
    b, n, kv = 0, int(positions[0]) + 1, 1 // G
    keys = np.asarray(dense_k[b, kv, :, :n], np.float64)
    scores = np.asarray(q[b, 0, 1], np.float64) @ keys / math.sqrt(H)
    p = np.exp(scores - scores.max())
    expected = (p / p.sum()) @ np.asarray(dense_v[b, kv, :n], np.float64)
    np.testing.assert_allclose(np.asarray(out[b, kv, 1 % G]), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_kernel_sums_in_the_same_order_whatever_the_pages(dtype):
    # The same sequences in pages of 8, 16, 48 and 100 slots (one page: a dense cache): the same outputs, bit
    # for bit, so the page size changes no token of a rollout.
    B, K, G, H, S = 4, 3, 3, 64, 100
    outs = []
    for page_size in (8, 16, 48, 100):
        q, new_k, new_v, _, _, _, positions, dense_k, dense_v = _paged_case(B, K, G, H, S, S, dtype, 1.0)
        n = -(-S // page_size)
        pad = n * page_size - S
        k_pages = jnp.pad(dense_k, [(0, 0)] * 3 + [(0, pad)]).reshape(B, K, H, n, page_size)
        v_pages = jnp.pad(dense_v, [(0, 0), (0, 0), (0, pad), (0, 0)]).reshape(B, K, n, page_size, H)
        k_pages = k_pages.transpose(0, 3, 1, 2, 4).reshape(B * n, K, H, page_size)  # page (b, w) at b n + w
        v_pages = v_pages.transpose(0, 2, 1, 3, 4).reshape(B * n, K, page_size, H)
        table = jnp.arange(B * n, dtype=jnp.int32).reshape(B, n)
        q1 = q.reshape(B, K, G, H) / math.sqrt(H)
        outs.append(np.asarray(_paged_update(q1, new_k, new_v, k_pages, v_pages, table, positions)[0]))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_backend_chosen_where_it_runs(monkeypatch):
    params = {"w": np.ones((2, 2), np.float32)}
    assert select_backend("auto", params, CFG).name == "cpu"
    assert select_backend("cpu", params, CFG).name == "cpu"
    assert select_backend("xla", params, CFG).name == "xla"
    # traced prompts (an outer jit) keep XLA's ops; asking for the kernels there names the fix
    assert select_backend("auto", params, CFG, concrete=False).name == "xla"
    with pytest.raises(ValueError, match="backend='cpu' runs on one CPU device"):
        select_backend("cpu", params, CFG, concrete=False)
    with pytest.raises(ValueError, match="backend"):
        SamplerConfig(backend="pallas")
    # more query heads per KV head than the decode-attention kernel takes
    wide = CFG.replace(num_heads=18, num_kv_heads=2)
    assert select_backend("auto", params, wide).name == "xla"
    with pytest.raises(ValueError, match="at most 8 query heads"):
        select_backend("cpu", params, wide)
    # q or k/v widths not in whole 16-column panels (6 x 12 and 2 x 12: the tiny model of test_convert and the
    # CLI tests): the fused q/k/v matmul failed ("packed weights do not match") at the first decode step
    narrow = CFG.replace(hidden_dim=48, num_heads=6, head_dim=12)
    assert select_backend("auto", params, narrow).name == "xla"
    with pytest.raises(ValueError, match="q and k/v widths .* multiples of 16"):
        select_backend("cpu", params, narrow)
    narrow_params = init_params(narrow, jax.random.key(0))
    out = generate(narrow_params, PROMPTS, narrow, _sc(), jax.random.key(0))  # auto: the XLA backend
    assert out.completion_mask.sum() > 0
    monkeypatch.setattr(build, "available", lambda: False)
    assert select_backend("auto", params, CFG).name == "xla"
    with pytest.raises(ValueError, match="could not be built"):
        select_backend("cpu", params, CFG)


def test_kernels_take_float32_and_bfloat16_only():
    half = {"w": np.ones((2, 2), np.float16)}
    assert select_backend("auto", half, CFG).name == "xla"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        select_backend("cpu", half, CFG)
    single = {"w": np.ones((2, 2), np.float32)}
    for dtype, name in (("float16", "xla"), ("float32", "cpu"), ("bfloat16", "cpu")):
        assert select_backend("auto", single, CFG.replace(dtype=dtype)).name == name
    assert select_backend("auto", single, CFG, cache_dtype="float16").name == "xla"


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(build, "_load", build._load.__wrapped__)
    monkeypatch.setattr(build, "_library", build._library.__wrapped__)  # build afresh
    reason = build._load()
    assert reason is not None and "nonexistent" in reason
    monkeypatch.setenv("GRPAX_CPU_KERNELS", "0")
    assert "GRPAX_CPU_KERNELS=0" in build._load()


def _np_pack(w):  # the panel layout by hand: [K, N] -> [ceil(N / 16), K, 16], zero-padded
    K, N = w.shape
    P = -(-N // 16)
    out = np.zeros((P, K, 16), w.dtype)
    for p in range(P):
        cols = w[:, 16 * p : 16 * p + 16]
        out[p, :, : cols.shape[1]] = cols
    if w.dtype.itemsize == 2:  # bfloat16: rows in pairs, [P, K/2, 16, 2] (K rounded up to even)
        out = np.concatenate([out, np.zeros((P, K % 2, 16), w.dtype)], axis=1)
        out = out.reshape(P, -1, 2, 16).transpose(0, 1, 3, 2).reshape(P, -1, 16)
    return out


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_pack_layout(dtype):
    rng = np.random.default_rng(0)
    a, b = (np.asarray(jnp.asarray(rng.standard_normal((2, 5, n)), dtype)) for n in (20, 35))
    packed = jax.jit(lambda a, b: ops.pack([a, b]))(a, b)  # two layers, columns concatenated
    rows = 5 if dtype == np.float32 else 6  # bfloat16 rows in pairs, K = 5 padded with a zero row
    assert len(packed) == 2 and packed[0].shape == (2 + 3, rows, 16) and packed[0].dtype == a.dtype
    for layer in range(2):
        expected = np.concatenate([_np_pack(a[layer]), _np_pack(b[layer])])
        np.testing.assert_array_equal(np.asarray(packed[layer]), expected)
    # transposed input [L, N, K]: the same panels as from [L, K, N]
    t = ops.pack([jnp.asarray(a).transpose(0, 2, 1)], transposed=True)
    np.testing.assert_array_equal(np.asarray(t[1]), _np_pack(a[1]))
    # SwiGLU: gate panel q at 2q, up panel q at 2q + 1
    g = ops.pack([a, -a], swiglu=True)
    np.testing.assert_array_equal(np.asarray(g[0])[0::2], _np_pack(a[0]))
    np.testing.assert_array_equal(np.asarray(g[0])[1::2], _np_pack(-a[0]))
    assert ops.pack([jnp.asarray(a, jnp.float32)], jnp.bfloat16)[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="gate and up of one shape"):
        ops.pack([a, b], swiglu=True)
    with pytest.raises(ValueError, match="one L and K"):
        ops.pack([a, b[:, :4]])
    with pytest.raises(ValueError, match=r"must be \[L, K, N\]"):
        ops.pack([a[0]])


@pytest.mark.parametrize(
    "M, K, N",
    [
        (1, 8, 3),  # one row, fewer columns than a panel
        (6, 64, 16),  # one full register tile and one panel
        (7, 64, 40),  # a tile of 6 and one of 1; a partly filled last panel
        (16, 576, 960),  # SmolLM2's fused q/k/v at batch 16
        (64, 1536, 576),  # its down projection at batch 64
        (13, 32, 4099),  # many panels, the last one of 3 columns
        (5, 33, 20),  # odd K: bfloat16 row pairs end with a zero row
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_equals_float64_product(M, K, N, dtype):
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32)).astype(dtype)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)  # bf16 weights are widened exactly
    packed = ops.pack([w[None]])[0]
    out = jax.jit(lambda x, w: ops.matmul(x, w, N))(x, packed)
    assert out.shape == (M, N) and out.dtype == jnp.float32
    expected = x.astype(np.float64) @ w64
    # float32 accumulation over K terms of size ~1: error ~ sqrt(K) * 2^-24 * |terms|
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6 * math.sqrt(K) * 4, rtol=0)
    # leading dims are flattened and restored
    out3 = ops.matmul(jnp.asarray(x).reshape(M, 1, K), packed, N)
    np.testing.assert_array_equal(np.asarray(out3)[:, 0], np.asarray(out))


@pytest.mark.parametrize("M, K, F", [(5, 16, 24), (16, 576, 1536)])
def test_swiglu_matmul_equals_float64(M, K, F):
    rng = np.random.default_rng(F)
    x = rng.standard_normal((M, K)).astype(np.float32) / math.sqrt(K)
    gate, up = (rng.standard_normal((K, F)).astype(np.float32) * 3 for _ in range(2))
    packed = ops.pack([jnp.asarray(gate)[None], jnp.asarray(up)[None]], swiglu=True)[0]
    out = ops.matmul(jnp.asarray(x), packed, F, swiglu=True)
    g = x.astype(np.float64) @ gate
    assert g.min() < -3 and g.max() > 3  # both branches of the sigmoid, and its tails
    u = x.astype(np.float64) @ up
    sig = 1 / (1 + np.exp(-g))
    expected = g * sig * u
    # Rounding bound: float32 sums of K products (error <= K * 2^-24 * sum |terms|) carried through
    # silu(g) * u, plus the polynomial exp's ~1e-7 relative error (1e-6 here).
    eps = K * 2.0**-24
    dsilu = np.abs(sig * (1 + g * (1 - sig)))
    bound = eps * (
        dsilu * np.abs(u) * (np.abs(x) @ np.abs(gate)) + np.abs(g * sig) * (np.abs(x) @ np.abs(up))
    )
    error = np.abs(np.asarray(out, np.float64) - expected)
    assert (error <= bound + 1e-6 * np.abs(expected) + 1e-7).all(), (error / (bound + 1e-7)).max()
    assert error.max() > 0  # a float32 result, not a copy of the reference


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("M, K, N", [(7, 64, 40), (64, 576, 1536), (13, 32, 4099)])
def test_matmul_transposed_input_and_output_are_the_same_product(M, K, N, swiglu):
    # The kernel multiplies from x^T either way, in the same order: transposing in or out is bit-exact.
    rng = np.random.default_rng(M + K + N)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    ws = [jnp.asarray(rng.standard_normal((1, K, N)).astype(np.float32)) for _ in range(1 + swiglu)]
    packed = ops.pack(ws, swiglu=swiglu)[0]
    plain = np.asarray(ops.matmul(x, packed, N, swiglu=swiglu))
    from_t = ops.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True)
    out_t = ops.matmul(x, packed, N, swiglu=swiglu, transpose_out=True)
    both = ops.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True, transpose_out=True)
    assert from_t.shape == (M, N) and out_t.shape == (N, M) and both.shape == (N, M)
    np.testing.assert_array_equal(np.asarray(from_t), plain)
    np.testing.assert_array_equal(np.asarray(out_t), plain.T)
    np.testing.assert_array_equal(np.asarray(both), plain.T)
    with pytest.raises(ValueError, match="2-D x"):
        ops.matmul(x[None], packed, N, swiglu=swiglu, transpose_out=True)


@pytest.mark.parametrize("swiglu", [False, True])
def test_matmul_bfloat16_output_is_the_float32_output_rounded(swiglu):
    # out_dtype=bfloat16 rounds as XLA's convert (to nearest even), for every layout; x may come as bfloat16
    M, K, N = 37, 64, 72
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((M, K)) * 3, jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((1, K, N)), jnp.bfloat16) for _ in range(1 + swiglu)]
    packed = ops.pack(ws, swiglu=swiglu)[0]
    for kw in ({}, {"transpose_out": True}):
        full = ops.matmul(x, packed, N, swiglu=swiglu, **kw)
        half = ops.matmul(x, packed, N, swiglu=swiglu, out_dtype=jnp.bfloat16, **kw)
        assert full.dtype == jnp.float32 and half.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(half), np.asarray(full.astype(jnp.bfloat16)))
        assert not np.array_equal(np.asarray(half, np.float32), np.asarray(full))  # it did round
    # a bfloat16 x is the same as its float32 widening, which is exact
    widened = ops.matmul(x.astype(jnp.float32), packed, N, swiglu=swiglu)
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, packed, N, swiglu=swiglu)), widened)
    with pytest.raises(ValueError, match="out_dtype"):
        ops.matmul(x, packed, N, swiglu=swiglu, out_dtype=jnp.float16)
    # NaN keeps its sign, infinities and overflow stay infinite, as in XLA's convert
    special = x.at[0, 0].set(jnp.nan).at[1, :].set(jnp.inf).at[2, 0].set(-jnp.inf).at[2, 1].set(jnp.inf)
    special = special.at[3, :].set(-3e38)
    full = ops.matmul(special, packed, N, swiglu=swiglu)
    half = ops.matmul(special, packed, N, swiglu=swiglu, out_dtype=jnp.bfloat16)
    bits = np.asarray(half).view(np.uint16)
    np.testing.assert_array_equal(bits, np.asarray(full.astype(jnp.bfloat16)).view(np.uint16))
    assert np.isnan(np.asarray(full)[2]).any() and np.signbit(np.asarray(full)[2]).any()  # -NaN: inf - inf


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_with_rms_norm_equals_norm_then_product(dtype, swiglu):
    from grpax.models.llama import rms_norm

    M, K, N, eps = 13, 96, 40, 1e-5
    rng = np.random.default_rng(7)
    x = jnp.asarray((rng.standard_normal((M, K)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32))
    x = x.astype(dtype)
    g = jnp.asarray(rng.uniform(0.5, 2.0, K).astype(np.float32)).astype(dtype)
    ws = [jnp.asarray(rng.standard_normal((1, K, N)).astype(np.float32)) for _ in range(1 + swiglu)]
    packed = ops.pack(ws, swiglu=swiglu)[0]
    fused = np.asarray(ops.matmul(x, packed, N, swiglu=swiglu, norm_weight=g, eps=eps))
    apart = np.asarray(ops.matmul(rms_norm(x, g, eps), packed, N, swiglu=swiglu))
    if dtype == jnp.float32:
        # against float64: the normed rows, then the product
        x64 = np.asarray(x, np.float64)
        h = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * np.asarray(g, np.float64)
        if not swiglu:
            np.testing.assert_allclose(fused, h @ np.asarray(ws[0][0], np.float64), rtol=0, atol=1e-4)
        np.testing.assert_allclose(fused, apart, rtol=1e-5, atol=1e-5)
    else:
        # the same bfloat16 roundings as rms_norm: equal but where the mean's sum order moves a rounding
        close = np.isclose(fused, apart, rtol=1e-5, atol=1e-5)
        assert close.mean() > 0.9, close.mean()
        np.testing.assert_allclose(fused, apart, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="norm_weight"):
        ops.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True, norm_weight=g)


def test_decode_step_equals_the_model_forward():
    # The backend's decode step (packed weights, fused norms, the paged attention kernel writing its pages in
    # place) against the model's forward over a dense cache: the same logits and keys/values to float32 rounding.
    backend = cpu_backend.CpuBackend()
    for tied in (True, False):
        cfg = ModelConfig(
            vocab_size=70,
            hidden_dim=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=40,
            rope_theta=10000.0,
            tie_word_embeddings=tied,
        )
        stacked = init_params(cfg, jax.random.key(1))
        stacked = jax.tree.map(lambda x: x * 10.0 if x.ndim >= 2 else x, stacked)
        params = convert_layout(stacked, cfg, scan_layers=False)
        assert ("lm_head" in params) != tied
        tokens = jnp.asarray([3, 60, 7], jnp.int32)
        positions = jnp.asarray([4, 0, 9], jnp.int32)
        cache = init_cache(cfg, 3, 12, stacked=False)
        ref, ref_cache = forward(params, tokens[:, None], cfg, positions=positions[:, None], cache=cache)
        table = jnp.asarray([[7, 8, 9], [1, 2, 3], [4, 5, 6]], jnp.int32)  # pages of 4 slots
        outs = []
        # packed from stacked layers and from a list of layers
        for p in (stacked, params):
            prepared = backend.prepare_decode(p, cfg, 12)
            pages = backend.init_pages(cfg, 10, 4, jnp.float32)
            logits, pages = jax.jit(backend.decode_step, static_argnums=5)(
                prepared, tokens, positions, pages, table, cfg
            )
            outs.append(np.asarray(logits))
            for layer in range(cfg.num_layers):
                for b, pos in enumerate(np.asarray(positions)):
                    page, off = int(table[b, pos // 4]), pos % 4
                    np.testing.assert_allclose(
                        pages["k"][layer][page, :, :, off],
                        ref_cache["k"][layer][b, :, :, pos],
                        atol=2e-5,
                        rtol=1e-5,
                    )
                    np.testing.assert_allclose(
                        pages["v"][layer][page, :, off, :],
                        ref_cache["v"][layer][b, :, pos, :],
                        atol=2e-5,
                        rtol=1e-5,
                    )
        np.testing.assert_allclose(outs[0], np.asarray(ref[:, 0]), atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(outs[1], outs[0])
        assert np.abs(outs[0]).max() > 1  # logits far from zero: a wrong layout would show


def _xla_packed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, window: int, chunk: int = 32
) -> jax.Array:
    """XLA's causal attention inside each row of a packed sequence: the reference for the kernel (it was the
    packed prefill's attention before the kernel; grpax.models.llama keeps only the padded prefill).

    Each token attends to the earlier tokens of its own row. Rows are contiguous and at most ``window``
    tokens long, so the queries are cut into chunks of ``chunk`` tokens and each chunk attends only to the
    ``window + chunk`` keys that end with it: work grows with T * (window + chunk), not T^2, and no FLOP is
    spent on padding (the prefill of a right-padded batch computes every row at the longest row's length).

    Args:
      q: [T, N, H] queries (already rotated); k, v: [T, K, H]; N must be a multiple of K.
      rows: int32 [T] row of each token (tokens of a row contiguous and in order; padding gets its own id).
      window: static, >= the longest row in tokens.
      chunk: static query chunk size.

    Returns:
      [T, N, H] in q's dtype; scores and softmax in float32.
    """
    T, N, H = q.shape
    K = k.shape[1]
    G = N // K
    nc = -(-T // chunk)
    m = -(-window // chunk)  # chunks of history each query chunk may reach back to
    pad = nc * chunk - T
    # Heads lead so that both products are plain batched matmuls over (K, chunk): [G * chunk, H] x [H, W].
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nc, chunk, K, G, H)
    q = q.transpose(2, 0, 3, 1, 4).reshape(K, nc, G * chunk, H)
    rows_q = jnp.pad(rows, (0, pad), constant_values=-1)  # padding queries match no key row
    k, v = (jnp.pad(x, ((m * chunk, pad), (0, 0), (0, 0))).transpose(1, 0, 2) for x in (k, v))  # [K, T', H]
    rows_k = jnp.pad(rows, (m * chunk, pad), constant_values=-2)

    def windows(x, axis):  # [.., (m + nc) * chunk, ..] -> [.., nc, (m + 1) * chunk, ..]: chunk c's keys
        x = x.reshape(*x.shape[:axis], nc + m, chunk, *x.shape[axis + 1 :])
        sl = lambda j: jax.lax.slice_in_dim(x, j, j + nc, axis=axis)  # noqa: E731
        return jnp.concatenate([sl(j) for j in range(m + 1)], axis=axis + 1)

    kw, vw = windows(k, 1), windows(v, 1)  # [K, nc, W, H]
    key_index = windows(jnp.arange((m + nc) * chunk) - m * chunk, 0)  # pack index of each key [nc, W]
    query_index = jnp.arange(nc * chunk).reshape(nc, chunk)
    mask = (windows(rows_k, 0)[:, None, :] == rows_q.reshape(nc, chunk)[:, :, None]) & (
        key_index[:, None, :] <= query_index[:, :, None]
    )  # [nc, chunk, W]
    scores = jnp.einsum("KcMH,KcwH->KcMw", q, kw, preferred_element_type=jnp.float32) / math.sqrt(H)
    scores = scores.reshape(K, nc, G, chunk, -1)
    scores = jnp.where(mask[None, :, None], scores, -0.7 * float(jnp.finfo(jnp.float32).max))
    probs = jax.nn.softmax(scores, axis=-1).astype(vw.dtype).reshape(K, nc, G * chunk, -1)
    out = jnp.einsum("KcMw,KcwH->KcMH", probs, vw, preferred_element_type=jnp.float32)
    out = out.reshape(K, nc, G, chunk, H).transpose(1, 3, 0, 2, 4)  # [nc, chunk, K, G, H]
    return out.reshape(nc * chunk, N, H)[:T].astype(q.dtype)


def _packed_case(lengths, pad, N, K, H, dtype, seed=0):
    rng = np.random.default_rng(seed)
    T = sum(lengths) + pad
    rows = np.concatenate([np.full(n, b) for b, n in enumerate(lengths)] + [np.full(pad, len(lengths))])
    q, k, v = (jnp.asarray(rng.standard_normal((T, n, H), np.float32)).astype(dtype) for n in (N, K, K))
    return q, k, v, jnp.asarray(rows, jnp.int32)


def _packed_attention_float64(q, k, v, rows, num_rows, prefix=0):
    q, k, v, rows = (np.asarray(x, np.float64) for x in (q, k, v, rows))
    T, N, H = q.shape
    G = N // k.shape[1]
    out = np.zeros((T, N, H))
    for t in range(T):
        if t < prefix:  # the shared prefix: causal among its own tokens
            keys = np.arange(t + 1)
        elif not 0 <= rows[t] < num_rows:
            continue
        else:  # every row continues the prefix
            own = np.flatnonzero((rows == rows[t]) & (np.arange(T) <= t) & (np.arange(T) >= prefix))
            keys = np.concatenate([np.arange(prefix), own])
        for n in range(N):
            s = k[keys, n // G] @ q[t, n] / math.sqrt(H)
            p = np.exp(s - s.max())
            out[t, n] = (p / p.sum()) @ v[keys, n // G]
    return out


@pytest.mark.parametrize(
    "lengths, pad, N, K, H",
    [
        ([96, 1, 40, 33, 7], 11, 9, 3, 64),  # SmolLM2's heads; a one-token row; rows across 32-key blocks
        ([5, 70, 17], 0, 4, 4, 128),  # no grouping, Llama 3's head size, no padding tail
        ([12, 3, 30], 4, 6, 2, 8),  # a head size zero-padded to 64
    ],
)
def test_packed_attention_kernel_equals_float64_and_xla(lengths, pad, N, K, H):
    q, k, v, rows = _packed_case(lengths, pad, N, K, H, jnp.float32)
    out = jax.jit(ops.packed_attention, static_argnums=4)(q, k, v, rows, len(lengths))
    assert out.shape == q.shape and out.dtype == jnp.float32
    ref = _packed_attention_float64(q, k, v, rows, len(lengths))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=0)
    assert not np.any(np.asarray(out)[sum(lengths) :])  # padding tokens: zeros
    real = slice(0, sum(lengths))
    xla = _xla_packed_attention(q, k, v, rows, max(lengths))
    # each within float32 rounding of the exact result (XLA's up to 1.7e-6 off it for H = 128, the kernel 1e-6)
    np.testing.assert_allclose(np.asarray(xla)[real], ref[real], atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(xla)[real], atol=4e-6, rtol=0)


@pytest.mark.parametrize("H", [64, 8])
def test_packed_attention_kernel_with_a_shared_prefix_equals_float64(H):
    # 37 prefix tokens (ids 0, like row 0's: the kernel takes them by position), then rows 0-2 and padding
    lengths = [37, 20, 1, 45]
    q, k, v, rows = _packed_case(lengths, 6, 9, 3, H, jnp.float32, seed=2)
    rows = jnp.concatenate([jnp.zeros(37, jnp.int32), rows[37:] - 1])  # prefix, rows 0, 1, 2, padding id 3
    out = np.asarray(ops.packed_attention(q, k, v, rows, 3, prefix=37))
    np.testing.assert_allclose(out, _packed_attention_float64(q, k, v, rows, 3, prefix=37), atol=2e-6, rtol=0)
    assert not np.any(out[sum(lengths) :])
    # the same as each row's prefix + own tokens packed without sharing (row 1: prefix + its one token)
    alone = np.concatenate([np.arange(37), np.arange(57, 58)])
    single = ops.packed_attention(q[alone], k[alone], v[alone], jnp.zeros(38, jnp.int32), 1)
    np.testing.assert_allclose(out[57], np.asarray(single)[-1], atol=2e-6, rtol=0)


def test_packed_attention_kernel_rounds_bfloat16_probabilities_like_xla():
    lengths = [50, 23, 64]
    q, k, v, rows = _packed_case(lengths, 5, 9, 3, 64, jnp.bfloat16, seed=1)
    out = np.asarray(ops.packed_attention(q, k, v, rows, 3), np.float32)[: sum(lengths)]
    xla = np.asarray(_xla_packed_attention(q, k, v, rows, 64), np.float32)[: sum(lengths)]
    exact = _packed_attention_float64(q, k, v, rows, 3)[: sum(lengths)]
    # the same bfloat16 values almost everywhere (different float32 sum orders may round an output the other
    # way); without the probabilities' bfloat16 rounding the outputs move off XLA's (checked by the float64
    # reference, which keeps them exact: both are about as far from it)
    assert np.mean(out != xla) < 1e-3
    assert np.max(np.abs(out - xla)) <= 2**-7 * np.max(np.abs(xla))
    assert np.max(np.abs(out - exact)) < 3e-2


def test_packed_attention_kernel_rejects_bad_shapes():
    q, k, v, rows = _packed_case([4, 4], 0, 6, 4, 64, jnp.float32)  # 4 kv heads do not divide 6 heads
    with pytest.raises(ValueError, match="K dividing N"):
        ops.packed_attention(q, k, v, rows, 2)
    q, k, v, rows = _packed_case([4, 4], 0, 6, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match="rows"):
        ops.packed_attention(q, k, v, rows[:5], 2)


def test_packed_prefill_equals_each_prompt_alone():
    # Prompts packed back to back (crossing the 32-token attention chunks, with a padding tail) give each
    # prompt's own logits and write the cache a padded prefill writes. Plain init (not the x15 fixture,
    # whose sharp softmax amplifies the float32 rounding of the two summation orders to ~1e-3 at values ~90).
    p = convert_layout(init_params(CFG, jax.random.key(0)), CFG, scan_layers=False)
    rng = np.random.RandomState(3)
    lengths, B, P, T = [45, 1, 30, 7, 20], 5, 48, 112
    prompts = [rng.randint(0, CFG.vocab_size, n) for n in lengths]
    rows = np.concatenate([np.full(n, b) for b, n in enumerate(lengths)] + [np.full(T - sum(lengths), B)])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(T - sum(lengths), int)])
    packed = np.concatenate(prompts + [np.zeros(T - sum(lengths), int)])
    cache = init_cache(CFG, B, P, stacked=False)
    hidden, cache = cpu_backend.packed_prefill_forward(
        p, jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(rows), cache, CFG
    )
    logits = logits_from_hidden(p, hidden, CFG)
    right = np.zeros((B, P), np.int32)
    for b, prompt in enumerate(prompts):
        right[b, : len(prompt)] = prompt
    padded_cache = init_cache(CFG, B, P, stacked=False)
    _, padded_cache = forward(
        p, jnp.asarray(right), CFG, positions=jnp.broadcast_to(jnp.arange(P), (B, P)), cache=padded_cache
    )
    start = 0
    for b, prompt in enumerate(prompts):
        alone, _ = forward(p, jnp.asarray(prompt)[None], CFG)
        np.testing.assert_allclose(logits[0, start : start + len(prompt)], alone[0], atol=1e-5, rtol=0)
        start += len(prompt)
        for name, slots in (("k", np.s_[..., : len(prompt)]), ("v", np.s_[..., : len(prompt), :])):
            for ours, theirs in zip(
                jax.tree.leaves(cache[name]), jax.tree.leaves(padded_cache[name]), strict=True
            ):
                np.testing.assert_allclose(
                    np.asarray(ours)[b][slots], np.asarray(theirs)[b][slots], atol=1e-5, rtol=0
                )


def _packed_prompts(lengths, T):
    rng = np.random.RandomState(3)
    B = len(lengths)
    rows = np.concatenate([np.full(n, b) for b, n in enumerate(lengths)] + [np.full(T - sum(lengths), B)])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(T - sum(lengths), int)])
    packed = rng.randint(0, CFG.vocab_size, T)
    return jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(rows)


@pytest.mark.parametrize("prefix", [0, 4])
def test_scanned_prefill_of_stacked_layers_equals_the_unrolled_one(prefix):
    stacked = init_params(dataclasses.replace(CFG, num_layers=3), jax.random.key(1))
    cfg = dataclasses.replace(CFG, num_layers=3)
    unrolled = convert_layout(stacked, cfg, scan_layers=False)
    tokens, positions, rows = _packed_prompts([9, 5, 12], 32)
    outs = [
        cpu_backend.packed_prefill_forward(
            p, tokens, positions, rows, init_cache(cfg, 3, 16, stacked=False), cfg, prefix=prefix
        )
        for p in (stacked, unrolled)
    ]
    for ours, theirs in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6, rtol=0)


def _maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc only")
def test_a_prefill_program_of_stacked_layers_maps_little_code_per_layer():
    # XLA:CPU links each kernel of a program on pages of its own (code, constants, data: 3 mappings each, held
    # while the program lives). Unrolled, every layer added ~13 kernels (~40 mappings) to every prefill program:
    # a server's warm-up of 30-layer SmolLM2 passed the kernel's 65,530 mappings (vm.max_map_count). Scanned,
    # a layer adds only the slices of its cache buffers.
    backend = cpu_backend.CpuBackend()
    tokens = jnp.asarray(np.arange(24).reshape(3, 8) % CFG.vocab_size, jnp.int32)
    lengths = jnp.asarray([8, 5, 3], jnp.int32)
    added = {}
    for L in (2, 8):
        cfg = dataclasses.replace(CFG, num_layers=L, hidden_dim=40 + L)  # programs no other test compiled
        params = init_params(cfg, jax.random.key(0))
        fn = jax.jit(backend.prefill, static_argnames=("cfg", "plan"))
        cache = init_cache(cfg, 3, 8, stacked=False)
        lowered = fn.lower(params, tokens, lengths, cache, cfg=cfg, plan=backend.plan(tokens, lengths))
        before = _maps()
        compiled = lowered.compile()
        added[L] = _maps() - before
        del compiled
    assert added[8] - added[2] < 6 * 10, added  # unrolled: ~6 * 40


def test_packed_and_padded_prefill_sample_the_same(params):
    # The CPU backend (packed prefill, kernels) against the XLA backend (padded prefill, XLA's ops): the same
    # tokens, greedy and sampled with top-p, and logprobs within float32 rounding.
    rng = np.random.RandomState(5)
    prompts = [rng.randint(1, CFG.vocab_size, n).tolist() for n in (40, 3, 33, 17, 1, 29)]
    for sc in (
        _sc(max_prompt_length=48),
        _sc(max_prompt_length=48, greedy=False, temperature=0.9, top_p=0.9),
    ):
        packed = generate(params, prompts, CFG, sc, jax.random.key(2), num_generations=2)
        padded = generate(
            params, prompts, CFG, dataclasses.replace(sc, backend="xla"), jax.random.key(2), num_generations=2
        )
        np.testing.assert_array_equal(packed.completion_ids, padded.completion_ids)
        np.testing.assert_array_equal(packed.completion_mask, padded.completion_mask)
        # the first token's logprob comes from the prefill alone: packed and padded agree to 1e-5; the decode
        # steps after it add the kernels' float32 rounding (the kernel-vs-XLA tolerance, as below)
        np.testing.assert_allclose(packed.logprobs[:, 0], padded.logprobs[:, 0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(packed.logprobs, padded.logprobs, atol=1e-4, rtol=0)
    assert (
        cpu_backend.packed_length_for(123, 6, 48) == 144 and cpu_backend.packed_length_for(288, 6, 48) == 288
    )


def test_cpu_backend_equals_xla_backend_on_the_default_jobs_sampling():
    # Evaluation is greedy, rollouts sample with top-k 50 at temperature 0.9: the same tokens on both backends,
    # logprobs within the kernels' float32 rounding.
    cfg = ModelConfig(
        vocab_size=90, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96
    )
    params = init_params(cfg, jax.random.key(5))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)  # peaked logits: a clear argmax
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 1]]
    for kw in ({"greedy": True}, {"temperature": 0.9, "top_k": 50}):
        outs = {}
        for backend in ("cpu", "xla"):
            sc = SamplerConfig(max_prompt_length=8, max_completion_length=6, backend=backend, **kw)
            outs[backend] = generate(params, prompts, cfg, sc, jax.random.key(0), 2)
        np.testing.assert_array_equal(outs["cpu"].completion_ids, outs["xla"].completion_ids)
        np.testing.assert_allclose(outs["cpu"].logprobs, outs["xla"].logprobs, atol=1e-4, rtol=0)


def test_shared_prefix_length():
    shared_prefix_length = cpu_backend.shared_prefix_length
    system = list(range(1, 20))  # 19 shared tokens
    assert shared_prefix_length([system + [40, 41], system + [50]]) == 16  # rounded down to a multiple of 8
    assert shared_prefix_length([system + [40, 41], system + [50]], multiple=1) == 19
    assert shared_prefix_length([system, system + [50]], multiple=1) == 18  # each prompt keeps one token
    assert shared_prefix_length([system + [40]]) == 0  # nothing to share with one prompt
    assert shared_prefix_length([[1, 2, 3], [4, 5, 6]]) == 0


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prompt_prefix_prefilled_once_gives_the_same_rollouts(params, greedy, monkeypatch):
    # A 17-token "system prompt" before each question: prefilled once (16 tokens shared) or per prompt, the
    # completions and logprobs agree (the unshared path is held to the full forward by tests/test_engine.py).
    system = [(7 * i + 3) % CFG.vocab_size for i in range(17)]
    prompts = [system + p for p in PROMPTS]
    sc = _sc(max_prompt_length=32, greedy=greedy, temperature=0.8)
    used = []  # the prefix lengths the backend planned
    plan = cpu_backend.CpuBackend.plan
    monkeypatch.setattr(cpu_backend.CpuBackend, "plan", lambda *a: used.append(plan(*a)[1]) or plan(*a))
    shared = generate(params, prompts, CFG, sc, jax.random.key(3), num_generations=2)
    monkeypatch.setattr(cpu_backend, "shared_prefix_length", lambda prompts: 0)
    alone = generate(params, prompts, CFG, sc, jax.random.key(3), 2)
    np.testing.assert_array_equal(shared.completion_ids, alone.completion_ids)
    np.testing.assert_array_equal(shared.completion_mask, alone.completion_mask)
    np.testing.assert_allclose(shared.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    assert shared.finish_reason == alone.finish_reason
    assert used == [16, 0]  # 17 shared tokens rounded down to 16; none when sharing is off
