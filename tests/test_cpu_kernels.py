"""The CPU decode-attention kernel (grpax.models.cpu_kernels) against XLA's ``cached_attention``."""

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
        raise RuntimeError(f"the CPU decode-attention kernel did not build: {cpu_kernels._load()}")
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


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(cpu_kernels, "_load", cpu_kernels._load.__wrapped__)
    reason = cpu_kernels._load()
    assert reason is not None and "nonexistent" in reason
    monkeypatch.setenv("GRPAX_CPU_KERNELS", "0")
    assert "GRPAX_CPU_KERNELS=0" in cpu_kernels._load()


def test_an_explicit_choice_is_kept():
    for choice in ("kernel", "xla"):
        sc = SamplerConfig(decode_attention=choice)
        assert engine.resolve_decode_attention(sc, {"w": np.ones(2, np.float32)}) is sc
