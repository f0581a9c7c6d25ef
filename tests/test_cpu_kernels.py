"""The CPU kernels (grpax.models.cpu_kernels): decode attention against XLA's ``cached_attention``, the packed
matmul against float64 products, the packed decode layout against the model's own forward."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpax.models import cpu_kernels
from grpax.models.llama import cached_attention
from grpax.sampler import engine
from grpax.sampler.engine import SamplerConfig

# CI sets GRPAX_REQUIRE_CPU_KERNELS=1 (scripts/test.sh): there a kernel that fails to build is a failure,
# elsewhere (no compiler) these tests are skipped and the sampler uses XLA's attention.
if not cpu_kernels.available():
    if os.environ.get("GRPAX_REQUIRE_CPU_KERNELS") == "1":
        raise RuntimeError(f"the CPU kernels did not build: {cpu_kernels._load()}")
    pytest.skip(f"CPU kernel unavailable: {cpu_kernels._load()}", allow_module_level=True)


def _case(B, K, G, H, S, dtype, scale, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, 1, K * G, H), np.float32) * scale)
    cache_k = jnp.asarray(rng.standard_normal((B, K, H, S), np.float32)).astype(dtype)
    cache_v = jnp.asarray(rng.standard_normal((B, K, S, H), np.float32)).astype(dtype)
    # the first row sees every slot, the last only slot 0, one row a position past the cache (clipped)
    positions = rng.integers(0, S, B).astype(np.int32)
    positions[0], positions[-1] = S - 1, 0
    if B > 2:
        positions[1] = S + 3
    return q, cache_k, cache_v, jnp.asarray(positions)[:, None]


@pytest.mark.parametrize(
    "B, K, G, H, S, dtype",
    [
        (3, 2, 3, 64, 37, jnp.float32),  # SmolLM2's group and head sizes; slots not a multiple of 8 or 32
        (4, 1, 1, 20, 9, jnp.float32),  # head_dim not a multiple of 8
        (2, 3, 8, 128, 70, jnp.float32),  # the largest group the kernel takes; Llama 3's head_dim
        (5, 2, 2, 40, 1, jnp.float32),  # one slot
        (4, 3, 3, 64, 100, jnp.bfloat16),  # a bfloat16 cache
    ],
)
@pytest.mark.parametrize("scale", [1.0, 30.0])  # peaked softmax: most exps underflow
def test_kernel_equals_xla_decode_attention(B, K, G, H, S, dtype, scale):
    q, cache_k, cache_v, positions = _case(B, K, G, H, S, dtype, scale)
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
    # XLA's path rounds a bfloat16 cache's probabilities to bfloat16; the kernel keeps them in float32, so
    # the reference is XLA's float32 attention over the same (bfloat16-valued) cache
    ref = jax.jit(cached_attention)(q, cache_k.astype(jnp.float32), cache_v.astype(jnp.float32), mask)
    out = jax.jit(cached_attention, static_argnums=5)(q, cache_k, cache_v, mask, positions, True)
    assert out.shape == (B, 1, K * G, H) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=0)
    # by hand for one row: softmax over the visible slots of row 2, query head 1 (kv head 1 // G)
    b, n, kv = 2, min(int(positions[2, 0]), S - 1) + 1, 1 // G
    keys = np.asarray(cache_k[b, kv, :, :n], np.float64)
    scores = np.asarray(q[b, 0, 1], np.float64) @ keys / math.sqrt(H)
    p = np.exp(scores - scores.max())
    expected = (p / p.sum()) @ np.asarray(cache_v[b, kv, :n], np.float64)
    np.testing.assert_allclose(np.asarray(out[b, 0, 1]), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_update_kernel_writes_the_cache_in_place_then_attends(dtype):
    B, K, G, H, S = 4, 3, 3, 64, 37
    q, cache_k, cache_v, positions = _case(B, K, G, H, S, dtype, 1.0)  # positions S-1, S+3 (dropped), .., 0
    rng = np.random.default_rng(5)
    new_k, new_v = (jnp.asarray(rng.standard_normal((B, K, H)), dtype) for _ in range(2))
    # XLA's scatter of the decode path (mode="drop": a slot past the cache is not written), then the kernel
    rows = jnp.arange(B)[:, None]
    ref_k = cache_k.at[rows, :, :, positions].set(new_k[:, None], mode="drop")
    ref_v = cache_v.at[rows, :, positions, :].set(new_v[:, None], mode="drop")
    q1 = q.reshape(B, K, G, H).astype(jnp.float32) / math.sqrt(H)
    ref = cpu_kernels.decode_attention(q1, ref_k, ref_v, positions[:, 0])

    @jax.jit
    def step(q1, new_k, new_v, cache_k, cache_v, positions):
        return cpu_kernels.decode_attention_update(q1, new_k, new_v, cache_k, cache_v, positions)

    out, got_k, got_v = step(q1, new_k, new_v, cache_k, cache_v, positions[:, 0])
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(ref_v, np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert not np.array_equal(np.asarray(got_k, np.float32), np.asarray(cache_k, np.float32))  # it wrote


def test_kernel_needs_positions():
    q, cache_k, cache_v, positions = _case(2, 1, 2, 8, 5, jnp.float32, 1.0)
    mask = jnp.arange(5)[None, None, :] <= positions[:, :, None]
    with pytest.raises(ValueError, match="positions"):
        cached_attention(q, cache_k, cache_v, mask, None, True)


def test_kernel_used_only_where_it_applies(monkeypatch):
    params = {"w": np.ones((2, 2), np.float32)}
    assert engine.resolve_decode_attention(SamplerConfig(), params).decode_attention == "kernel"
    assert (
        engine.resolve_decode_attention(SamplerConfig(decode_attention="xla"), params).decode_attention
        == "xla"
    )
    with pytest.raises(ValueError, match="decode_attention"):
        SamplerConfig(decode_attention="pallas")
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert engine.resolve_decode_attention(SamplerConfig(), params).decode_attention == "xla"
    with pytest.raises(ValueError, match="could not be built"):
        engine.resolve_decode_attention(SamplerConfig(decode_attention="kernel"), params)


def test_kernels_take_float32_and_bfloat16_only():
    half = {"w": np.ones((2, 2), np.float16)}
    resolved = engine.resolve_decode_attention(SamplerConfig(), half)
    assert (resolved.decode_attention, resolved.decode_matmul, resolved.decode_sampling) == ("xla",) * 3
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        engine.resolve_decode_attention(SamplerConfig(decode_matmul="kernel"), half)
    from grpax.models.registry import ModelConfig

    shape = dict(
        vocab_size=70, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=40
    )
    single = {"w": np.ones((2, 2), np.float32)}
    for dtype, matmul in (("float16", "xla"), ("float32", "kernel")):
        cfg = ModelConfig(**shape, dtype=dtype)
        assert engine.resolve_decode_attention(SamplerConfig(), single, cfg).decode_matmul == matmul
    half_cache = SamplerConfig(cache_dtype="float16")
    assert engine.resolve_decode_attention(half_cache, single, cfg).decode_attention == "xla"


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(cpu_kernels, "_load", cpu_kernels._load.__wrapped__)
    monkeypatch.setattr(cpu_kernels, "_library", cpu_kernels._library.__wrapped__)  # build afresh
    reason = cpu_kernels._load()
    assert reason is not None and "nonexistent" in reason
    monkeypatch.setenv("GRPAX_CPU_KERNELS", "0")
    assert "GRPAX_CPU_KERNELS=0" in cpu_kernels._load()


def test_an_explicit_choice_is_kept():
    for attention in ("kernel", "xla"):
        for matmul in ("kernel", "xla"):
            sc = SamplerConfig(
                decode_attention=attention,
                decode_matmul=matmul,
                prefill_attention=attention,
                prefill_matmul=matmul,
                decode_sampling=matmul,
            )
            assert engine.resolve_decode_attention(sc, {"w": np.ones(2, np.float32)}) is sc


def test_matmul_kernel_used_only_where_it_applies(monkeypatch):
    params = {"w": np.ones((2, 2), np.float32)}
    resolved = engine.resolve_decode_attention(SamplerConfig(), params)
    assert (resolved.decode_attention, resolved.decode_matmul) == ("kernel", "kernel")
    # stacked (scanned) layers keep XLA's dots; asking for the kernel there names the key and the fix
    scanned = engine.resolve_decode_attention(SamplerConfig(unroll_layers=False), params)
    assert (scanned.decode_attention, scanned.decode_matmul) == ("kernel", "xla")
    with pytest.raises(ValueError, match="decode_matmul='kernel' needs unroll_layers=True"):
        engine.resolve_decode_attention(SamplerConfig(unroll_layers=False, decode_matmul="kernel"), params)
    with pytest.raises(ValueError, match="decode_matmul"):
        SamplerConfig(decode_matmul="blas")
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert engine.resolve_decode_attention(SamplerConfig(), params).decode_matmul == "xla"
    with pytest.raises(ValueError, match="decode_matmul='kernel': the CPU kernels could not be built"):
        engine.resolve_decode_attention(SamplerConfig(decode_attention="xla", decode_matmul="kernel"), params)


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
    packed = jax.jit(lambda a, b: cpu_kernels.pack([a, b]))(a, b)  # two layers, columns concatenated
    rows = 5 if dtype == np.float32 else 6  # bfloat16 rows in pairs, K = 5 padded with a zero row
    assert len(packed) == 2 and packed[0].shape == (2 + 3, rows, 16) and packed[0].dtype == a.dtype
    for layer in range(2):
        expected = np.concatenate([_np_pack(a[layer]), _np_pack(b[layer])])
        np.testing.assert_array_equal(np.asarray(packed[layer]), expected)
    # transposed input [L, N, K]: the same panels as from [L, K, N]
    t = cpu_kernels.pack([jnp.asarray(a).transpose(0, 2, 1)], transposed=True)
    np.testing.assert_array_equal(np.asarray(t[1]), _np_pack(a[1]))
    # SwiGLU: gate panel q at 2q, up panel q at 2q + 1
    g = cpu_kernels.pack([a, -a], swiglu=True)
    np.testing.assert_array_equal(np.asarray(g[0])[0::2], _np_pack(a[0]))
    np.testing.assert_array_equal(np.asarray(g[0])[1::2], _np_pack(-a[0]))
    assert cpu_kernels.pack([jnp.asarray(a, jnp.float32)], jnp.bfloat16)[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="gate and up of one shape"):
        cpu_kernels.pack([a, b], swiglu=True)
    with pytest.raises(ValueError, match="one L and K"):
        cpu_kernels.pack([a, b[:, :4]])
    with pytest.raises(ValueError, match=r"must be \[L, K, N\]"):
        cpu_kernels.pack([a[0]])


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
    packed = cpu_kernels.pack([w[None]])[0]
    out = jax.jit(lambda x, w: cpu_kernels.matmul(x, w, N))(x, packed)
    assert out.shape == (M, N) and out.dtype == jnp.float32
    expected = x.astype(np.float64) @ w64
    # float32 accumulation over K terms of size ~1: error ~ sqrt(K) * 2^-24 * |terms|
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6 * math.sqrt(K) * 4, rtol=0)
    # leading dims are flattened and restored
    out3 = cpu_kernels.matmul(jnp.asarray(x).reshape(M, 1, K), packed, N)
    np.testing.assert_array_equal(np.asarray(out3)[:, 0], np.asarray(out))


@pytest.mark.parametrize("M, K, F", [(5, 16, 24), (16, 576, 1536)])
def test_swiglu_matmul_equals_float64(M, K, F):
    rng = np.random.default_rng(F)
    x = rng.standard_normal((M, K)).astype(np.float32) / math.sqrt(K)
    gate, up = (rng.standard_normal((K, F)).astype(np.float32) * 3 for _ in range(2))
    packed = cpu_kernels.pack([jnp.asarray(gate)[None], jnp.asarray(up)[None]], swiglu=True)[0]
    out = cpu_kernels.matmul(jnp.asarray(x), packed, F, swiglu=True)
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
    packed = cpu_kernels.pack(ws, swiglu=swiglu)[0]
    plain = np.asarray(cpu_kernels.matmul(x, packed, N, swiglu=swiglu))
    from_t = cpu_kernels.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True)
    out_t = cpu_kernels.matmul(x, packed, N, swiglu=swiglu, transpose_out=True)
    both = cpu_kernels.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True, transpose_out=True)
    assert from_t.shape == (M, N) and out_t.shape == (N, M) and both.shape == (N, M)
    np.testing.assert_array_equal(np.asarray(from_t), plain)
    np.testing.assert_array_equal(np.asarray(out_t), plain.T)
    np.testing.assert_array_equal(np.asarray(both), plain.T)
    with pytest.raises(ValueError, match="2-D x"):
        cpu_kernels.matmul(x[None], packed, N, swiglu=swiglu, transpose_out=True)


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason="no AMX-BF16 on this CPU (or not lent by the OS)")
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize(
    "M, K, N",
    [
        (1, 64, 40),  # one row in a 16-row tile, a partly filled last panel
        (33, 576, 960),  # two 16-row tiles and one more row
        (300, 96, 1000),  # two 256-row chunks, an odd panel count
    ],
)
def test_amx_matmul_equals_float64_and_the_vector_tiles(M, K, N, swiglu):
    # bfloat16 x and weights: AMX sums the same exact products in float32 (another order than the vector tiles)
    rng = np.random.default_rng(M + K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((1, K, N)), jnp.bfloat16) for _ in range(1 + swiglu)]
    packed = cpu_kernels.pack(ws, swiglu=swiglu)[0]
    amx = np.asarray(cpu_kernels.matmul(x, packed, N, swiglu=swiglu, amx=True), np.float64)
    vector = np.asarray(cpu_kernels.matmul(x, packed, N, swiglu=swiglu, amx=False), np.float64)
    x64 = np.asarray(x, np.float64)
    g = x64 @ np.asarray(ws[0][0], np.float64)
    expected = g / (1 + np.exp(-g)) * (x64 @ np.asarray(ws[1][0], np.float64)) if swiglu else g
    scale = (np.abs(x64) @ np.abs(np.asarray(ws[0][0], np.float64))).max() * (
        np.abs(expected).max() if swiglu else 1
    )
    bound = K * 2.0**-24 * scale * 2  # float32 sums of K exact products (and the SwiGLU's product)
    assert np.abs(amx - expected).max() <= bound, np.abs(amx - expected).max() / bound
    assert np.abs(vector - expected).max() <= bound
    assert not np.array_equal(amx, vector)  # another sum order: the AMX path really ran
    # transposed input and output give the same numbers
    both = cpu_kernels.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True, transpose_out=True, amx=True)
    np.testing.assert_array_equal(np.asarray(both, np.float64), amx.T)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_matmul_bfloat16_output_is_the_float32_output_rounded(swiglu, amx):
    # out_dtype=bfloat16 rounds as XLA's convert (to nearest even), for every layout; x may come as bfloat16
    M, K, N = 37, 64, 72
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((M, K)) * 3, jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((1, K, N)), jnp.bfloat16) for _ in range(1 + swiglu)]
    packed = cpu_kernels.pack(ws, swiglu=swiglu)[0]
    for kw in ({}, {"transpose_out": True}):
        full = cpu_kernels.matmul(x, packed, N, swiglu=swiglu, amx=amx, **kw)
        half = cpu_kernels.matmul(x, packed, N, swiglu=swiglu, amx=amx, out_dtype=jnp.bfloat16, **kw)
        assert full.dtype == jnp.float32 and half.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(half), np.asarray(full.astype(jnp.bfloat16)))
        assert not np.array_equal(np.asarray(half, np.float32), np.asarray(full))  # it did round
    # a bfloat16 x is the same as its float32 widening, which is exact (apart from AMX, which needs bfloat16 x)
    widened = cpu_kernels.matmul(x.astype(jnp.float32), packed, N, swiglu=swiglu, amx=False)
    np.testing.assert_array_equal(
        np.asarray(cpu_kernels.matmul(x, packed, N, swiglu=swiglu, amx=False)), widened
    )
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_kernels.matmul(x, packed, N, swiglu=swiglu, out_dtype=jnp.float16)
    # NaN keeps its sign, infinities and overflow stay infinite, as in XLA's convert
    special = x.at[0, 0].set(jnp.nan).at[1, :].set(jnp.inf).at[2, 0].set(-jnp.inf).at[2, 1].set(jnp.inf)
    special = special.at[3, :].set(-3e38)
    full = cpu_kernels.matmul(special, packed, N, swiglu=swiglu, amx=amx)
    half = cpu_kernels.matmul(special, packed, N, swiglu=swiglu, amx=amx, out_dtype=jnp.bfloat16)
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
    packed = cpu_kernels.pack(ws, swiglu=swiglu)[0]
    fused = np.asarray(cpu_kernels.matmul(x, packed, N, swiglu=swiglu, norm_weight=g, eps=eps))
    apart = np.asarray(cpu_kernels.matmul(rms_norm(x, g, eps), packed, N, swiglu=swiglu))
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
        cpu_kernels.matmul(x.T, packed, N, swiglu=swiglu, x_transposed=True, norm_weight=g)


def test_packed_decode_params_give_the_same_forward():
    from grpax.models.llama import forward, init_cache, pack_decode_params
    from grpax.models.params import convert_layout, init_params
    from grpax.models.registry import ModelConfig

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
        tokens = jnp.asarray([[3], [60], [7]], jnp.int32)
        positions = jnp.asarray([[4], [0], [9]], jnp.int32)
        outs = []
        # packed from stacked layers and from a list of layers
        for p in (params, pack_decode_params(stacked, cfg), pack_decode_params(params, cfg)):
            assert "packed_lm_head" in p or p is params
            cache = init_cache(cfg, 3, 12, stacked=False)
            outs.append(np.asarray(forward(p, tokens, cfg, positions=positions, cache=cache)[0]))
        np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(outs[2], outs[1])
        assert np.abs(outs[0]).max() > 1  # logits far from zero: a wrong layout would show


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
    from grpax.models.llama import packed_attention

    q, k, v, rows = _packed_case(lengths, pad, N, K, H, jnp.float32)
    out = jax.jit(cpu_kernels.packed_attention, static_argnums=4)(q, k, v, rows, len(lengths))
    assert out.shape == q.shape and out.dtype == jnp.float32
    ref = _packed_attention_float64(q, k, v, rows, len(lengths))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=0)
    assert not np.any(np.asarray(out)[sum(lengths) :])  # padding tokens: zeros
    real = slice(0, sum(lengths))
    xla = packed_attention(q, k, v, rows, max(lengths))
    # each within float32 rounding of the exact result (XLA's up to 1.7e-6 off it for H = 128, the kernel 1e-6)
    np.testing.assert_allclose(np.asarray(xla)[real], ref[real], atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(xla)[real], atol=4e-6, rtol=0)


@pytest.mark.parametrize("H", [64, 8])
def test_packed_attention_kernel_with_a_shared_prefix_equals_float64(H):
    # 37 prefix tokens (ids 0, like row 0's: the kernel takes them by position), then rows 0-2 and padding
    lengths = [37, 20, 1, 45]
    q, k, v, rows = _packed_case(lengths, 6, 9, 3, H, jnp.float32, seed=2)
    rows = jnp.concatenate([jnp.zeros(37, jnp.int32), rows[37:] - 1])  # prefix, rows 0, 1, 2, padding id 3
    out = np.asarray(cpu_kernels.packed_attention(q, k, v, rows, 3, prefix=37))
    np.testing.assert_allclose(out, _packed_attention_float64(q, k, v, rows, 3, prefix=37), atol=2e-6, rtol=0)
    assert not np.any(out[sum(lengths) :])
    # the same as each row's prefix + own tokens packed without sharing (row 1: prefix + its one token)
    alone = np.concatenate([np.arange(37), np.arange(57, 58)])
    single = cpu_kernels.packed_attention(q[alone], k[alone], v[alone], jnp.zeros(38, jnp.int32), 1)
    np.testing.assert_allclose(out[57], np.asarray(single)[-1], atol=2e-6, rtol=0)


def test_packed_attention_kernel_rounds_bfloat16_probabilities_like_xla():
    from grpax.models.llama import packed_attention

    lengths = [50, 23, 64]
    q, k, v, rows = _packed_case(lengths, 5, 9, 3, 64, jnp.bfloat16, seed=1)
    out = np.asarray(cpu_kernels.packed_attention(q, k, v, rows, 3), np.float32)[: sum(lengths)]
    xla = np.asarray(packed_attention(q, k, v, rows, 64), np.float32)[: sum(lengths)]
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
        cpu_kernels.packed_attention(q, k, v, rows, 2)
    q, k, v, rows = _packed_case([4, 4], 0, 6, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.packed_attention(q, k, v, rows[:5], 2)


def test_prefill_attention_kernel_chosen_where_it_applies(monkeypatch):
    params = {"w": np.ones((2, 2), np.float32)}
    assert engine.resolve_decode_attention(SamplerConfig(), params).prefill_attention == "kernel"
    with pytest.raises(ValueError, match="prefill_attention"):
        SamplerConfig(prefill_attention="flash")
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert engine.resolve_decode_attention(SamplerConfig(), params).prefill_attention == "xla"
    with pytest.raises(ValueError, match="prefill_attention='kernel': the CPU kernels could not be built"):
        engine.resolve_decode_attention(
            SamplerConfig(decode_attention="xla", decode_matmul="xla", prefill_attention="kernel"), params
        )


def test_prefill_matmul_kernel_chosen_where_it_is_faster(monkeypatch):
    from grpax.models.registry import ModelConfig

    params = {"w": np.ones((2, 2), np.float32)}
    shape = dict(vocab_size=8, hidden_dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8)
    bf16, f32 = (ModelConfig(**shape, dtype=d) for d in ("bfloat16", "float32"))
    resolve = engine.resolve_decode_attention
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: True)
    assert resolve(SamplerConfig(), params, bf16).prefill_matmul == "kernel"
    assert resolve(SamplerConfig(), params, f32).prefill_matmul == "xla"  # XLA's float32 dots are as fast
    assert resolve(SamplerConfig(), params).prefill_matmul == "xla"  # no model config: dtype unknown
    assert resolve(SamplerConfig(unroll_layers=False), params, bf16).prefill_matmul == "xla"
    assert resolve(SamplerConfig(prefill_matmul="kernel"), params, f32).prefill_matmul == "kernel"
    with pytest.raises(ValueError, match="prefill_matmul='kernel' needs unroll_layers=True"):
        resolve(SamplerConfig(unroll_layers=False, prefill_matmul="kernel"), params, bf16)
    with pytest.raises(ValueError, match="prefill_matmul"):
        SamplerConfig(prefill_matmul="onednn")
    monkeypatch.setenv("GRPAX_CPU_AMX", "0")  # AMX turned off: the vector tiles are no faster than XLA
    assert resolve(SamplerConfig(), params, bf16).prefill_matmul == "xla"
    monkeypatch.delenv("GRPAX_CPU_AMX")
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)
    assert resolve(SamplerConfig(), params, bf16).prefill_matmul == "xla"


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(not cpu_kernels.amx_available(), reason="no AMX-BF16 on this CPU"),
        ),
    ],
)
def test_prefill_on_the_matmul_kernel_equals_xla_prefill(dtype):
    from grpax.models.params import cast_params, init_params
    from grpax.models.registry import ModelConfig

    cfg = ModelConfig(
        vocab_size=96,
        hidden_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        rope_theta=10000.0,
        dtype=dtype,
        weight_dtype=dtype,
    )
    params = cast_params(init_params(cfg, jax.random.key(3)), dtype)
    rng = np.random.default_rng(0)
    lengths = np.array([5, 9, 3], np.int32)
    tokens = np.zeros((3, 16), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(1, 96, n)
    out = {}
    for matmul in ("kernel", "xla"):
        sc = SamplerConfig(
            max_prompt_length=16, max_completion_length=8, prefill_matmul=matmul, pad_token_id=0
        )
        sc = engine.resolve_decode_attention(sc, params, cfg)
        assert sc.prefill_matmul == matmul
        out[matmul] = engine.prefill(params, tokens, lengths, cfg, sc, 2, packed_length=24)
    (cache_k, logits_k), (cache_x, logits_x) = out["kernel"], out["xla"]
    logits_k, logits_x = np.asarray(logits_k), np.asarray(logits_x)
    assert logits_k.shape == (6, 96) and np.abs(logits_x).max() > 0.1
    if dtype == "float32":  # the same products, summed in another order
        np.testing.assert_allclose(logits_k, logits_x, rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(cache_k), jax.tree.leaves(cache_x), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    else:  # bfloat16 activations: a sum order that rounds one value the other way moves it by an ulp (2^-8)
        np.testing.assert_allclose(logits_k, logits_x, rtol=0, atol=2e-2 * np.abs(logits_x).max())
        assert (np.argmax(logits_k, -1) == np.argmax(logits_x, -1)).all()


def test_generate_packs_once_for_prefill_and_decode_and_matches_xla(monkeypatch):
    from grpax.models.params import init_params
    from grpax.models.registry import ModelConfig

    cfg = ModelConfig(
        vocab_size=90, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96
    )
    params = init_params(cfg, jax.random.key(5))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)  # peaked logits: a clear argmax
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 0], [5, 6, 7, 1, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 4], jnp.int32)
    calls = {"pack": 0, "pack_decode_params": 0}
    pack, pack_params = engine._pack_cpu, engine.pack_decode_params

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(engine, "_pack_cpu", counted("pack", pack))
    monkeypatch.setattr(engine, "pack_decode_params", counted("pack_decode_params", pack_params))
    outs = {}
    for choice in ("kernel", "xla"):
        sc = SamplerConfig(
            max_prompt_length=8,
            max_completion_length=6,
            greedy=True,
            pad_token_id=0,
            decode_matmul=choice,
            prefill_matmul=choice,
            decode_attention=choice,
            prefill_attention=choice,
            decode_sampling="xla",
        )
        outs[choice] = engine.generate_padded(params, tokens, lengths, jax.random.key(0), cfg, sc, 2, 16)
        if choice == "kernel":  # packed once, outside prefill and decode, which take it as it is
            assert calls == {"pack": 1, "pack_decode_params": 0}
    np.testing.assert_array_equal(outs["kernel"]["completion_ids"], outs["xla"]["completion_ids"])
    np.testing.assert_allclose(outs["kernel"]["logprobs"], outs["xla"]["logprobs"], atol=1e-4, rtol=0)
    assert calls["pack"] == 1
    # params packed beforehand are taken as they are ("auto" uses the kernel they need; "xla" is refused)
    packed = pack_params(params, cfg)
    sc = SamplerConfig(max_prompt_length=8, max_completion_length=6, greedy=True, pad_token_id=0)
    out = engine.generate_padded(packed, tokens, lengths, jax.random.key(0), cfg, sc, 2, 16)
    np.testing.assert_array_equal(out["completion_ids"], outs["kernel"]["completion_ids"])
    assert calls["pack"] == 1
    with pytest.raises(ValueError, match="prefill_matmul=xla asks for XLA's dots"):
        sc = SamplerConfig(max_prompt_length=8, max_completion_length=6, prefill_matmul="xla", pad_token_id=0)
        engine.generate_padded(packed, tokens, lengths, jax.random.key(0), cfg, sc, 2, 16)


@pytest.mark.parametrize("B, V, temperature", [(16, 49152, 1.0), (5, 1000, 0.7), (3, 61, 1.3)])
def test_sample_kernel_equals_xla_draw_and_logprobs(B, V, temperature):
    from grpax.sampler.sampling import sample_from_uniform, token_logprobs

    rng = np.random.default_rng(B)
    logits = jnp.asarray(rng.standard_normal((B, V), np.float32) * 3)
    u = jnp.asarray(rng.random((B, 2), np.float32))
    tokens, logprobs = jax.jit(cpu_kernels.sample, static_argnums=2)(logits, u, temperature)
    assert tokens.dtype == jnp.int32 and logprobs.shape == (B,)
    expected = sample_from_uniform(logits, u, temperature=temperature)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))
    # log_softmax(logits / t)[token] in float64
    scaled = np.asarray(logits, np.float64) / temperature
    logz = scaled.max(1) + np.log(np.exp(scaled - scaled.max(1, keepdims=True)).sum(1))
    exact = scaled[np.arange(B), np.asarray(tokens)] - logz
    np.testing.assert_allclose(np.asarray(logprobs), exact, atol=2e-6, rtol=0)
    np.testing.assert_allclose(
        np.asarray(logprobs), np.asarray(token_logprobs(logits, tokens, temperature)), atol=2e-6, rtol=0
    )


def test_sample_kernel_draws_the_distribution():
    # Inverse CDF over a grid of u: each token's share of the grid is its probability (to the grid's step),
    # across blocks (block_size 16, V = 40: a partial last block) and within them.
    logits = jnp.asarray([[np.log(i % 7 + 0.5) if i % 5 else -30.0 for i in range(40)]], jnp.float32)
    x = np.asarray(logits[0], np.float64)
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    n = 200
    grid = (np.arange(n) + 0.5) / n
    u = jnp.asarray(np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2), jnp.float32)
    tokens, _ = cpu_kernels.sample(jnp.repeat(logits, n * n, axis=0), u, 1.0, block_size=16)
    counts = np.bincount(np.asarray(tokens), minlength=40) / (n * n)
    np.testing.assert_allclose(counts, probs, atol=2 / n)
    assert counts[0] == 0 and counts[5] == 0  # the near-zero tokens are never drawn here


def test_sample_kernel_chosen_where_it_applies(monkeypatch):
    params = {"w": np.ones((2, 2), np.float32)}
    resolve = engine.resolve_decode_attention
    assert resolve(SamplerConfig(), params).decode_sampling == "kernel"
    for kw in ({"top_k": 5}, {"top_p": 0.9}, {"greedy": True}):
        assert resolve(SamplerConfig(**kw), params).decode_sampling == "xla"
    with pytest.raises(ValueError, match="decode_sampling='kernel' needs top_k=0, top_p=1.0, greedy=False"):
        resolve(SamplerConfig(top_k=5, decode_sampling="kernel"), params)
    with pytest.raises(ValueError, match="decode_sampling"):
        SamplerConfig(decode_sampling="gumbel")
    with pytest.raises(ValueError, match="temperature"):
        cpu_kernels.sample(jnp.zeros((2, 32)), jnp.zeros((2, 2)), 0.0)
