"""Grouped-query attention behind one choice: ``ModelConfig.attention`` names the implementation.

``forward`` and ``forward_grouped`` (``grpax.models.llama``) resolve ``cfg.attention`` once per trace with
``select_attention`` and hand the chosen implementation to every layer, so the update, the reference pass
and the sampler's XLA backend (its prefill) run the same attention. The key and its ``dot_product`` value
are MaxText's (``attention: dot_product``, its plain XLA reference); a kernel plugs in as one row of
``IMPLEMENTATIONS`` and its name in ``grpax.models.registry.ATTENTION_IMPLEMENTATIONS``:

* ``dot_product`` (default): ``attention`` below, two einsums with the softmax in float32.
* ``jax_nn``: ``jax.nn.dot_product_attention`` with its XLA implementation (any platform).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused flash attention (NVIDIA
  GPUs only; bfloat16 or float16 activations).

``jax.nn.dot_product_attention`` has no score soft-capping and no attention sinks, so ``jax_nn`` and ``cudnn``
refuse a config with ``attn_logit_softcap`` (Gemma 2) or ``attention_sinks`` (GPT-OSS: a learned logit per head
joins every softmax's denominator, so a query may attend to nothing; ``sink_softmax``). The decode step of one query per row over the KV cache (``cached_attention``
with T == 1) reads the cache in its own layout whatever the choice (``cached_attention``'s docstring), and the
sampler's CPU backend (``grpax.backends.cpu``) runs its own kernels: the choice is the XLA path's.

``window_mask`` builds the (global, local) masks of sliding-window layers; ``chunked_attention`` bounds the
scores alive at once in the update. Shape letters as in ``grpax.models.llama``: B rows, T queries, S keys,
N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from grpax.errors import ConfigError

if TYPE_CHECKING:
    from grpax.models.registry import ModelConfig

# A large finite negative keeps fully-masked (padding) query rows finite instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Queries per block of ``chunked_attention``: the [B, N, T, S] float32 scores of a long sequence are never
# materialised at once, forward or backward.
_QUERY_CHUNK = 128

# (q [B, T, N, H], k [B, S, K, H], v [B, S, K, H], mask bool [B, T, S], scale, cap, sinks) -> [B, T, N, H]
Attend = Callable[..., jax.Array]


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's attention and final logit soft-capping); ``x`` when ``cap`` is None."""
    return x if not cap else cap * jnp.tanh(x / cap)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis of float32 ``scores`` [B, K, G, ..., S]; with ``sinks`` [N = K * G] (GPT-OSS),
    each head's sink logit joins the denominator, ``exp(s) / (sum exp(s) + exp(sink))``, as transformers'
    ``eager_attention_forward`` of GPT-OSS (the sink's column dropped after the softmax)."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    B, K, G = scores.shape[:3]
    sink = sinks.astype(jnp.float32).reshape(1, K, G, *(1,) * (scores.ndim - 3))
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - top)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention in two einsums (``attention=dot_product``).

    Args:
      q: [B, T, N, H] queries (already rotated).
      k, v: [B, S, K, H] keys and values; N must be a multiple of K.
      mask: bool [B, T, S], True where query t may attend to key s.
      scale: the scores' factor (None: 1 / sqrt(H)); cap: soft-capping of the scores (``softcap``), or None.
      sinks: float [N] attention sinks (``sink_softmax``), or None.

    Returns:
      [B, T, N, H] in q's dtype; softmax in float32.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = softcap(scores / math.sqrt(H) if scale is None else scores * scale, cap)
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = sink_softmax(scores, sinks).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


def jax_nn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    cap: float | None = None,
    sinks: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``attention`` by ``jax.nn.dot_product_attention`` (``implementation``: None / "xla", or "cudnn").

    Same arguments and result as ``attention``; ``cap`` and ``sinks`` must be None (refused by ``ModelConfig``).
    """
    assert not cap and sinks is None, "jax.nn.dot_product_attention has no soft-capping and no sinks"
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None], scale=scale, implementation=implementation
    )


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One attention implementation.

    Attributes:
      attend: the function, with ``attention``'s arguments and result.
      platforms: the JAX platforms it runs on (``jax.default_backend()``); () = any.
      dtypes: the activation dtypes (``cfg.dtype``) it takes; () = any (a cached prefill then attends in
        float32, else in ``cfg.dtype``).
    """

    attend: Attend
    platforms: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()


# The values of ``ModelConfig.attention`` (registry.ATTENTION_IMPLEMENTATIONS holds the same names).
IMPLEMENTATIONS: dict[str, Implementation] = {
    "dot_product": Implementation(attention),
    "jax_nn": Implementation(jax_nn_attention),
    "cudnn": Implementation(
        functools.partial(jax_nn_attention, implementation="cudnn"), ("gpu",), ("bfloat16", "float16")
    ),
}
DOT_PRODUCT = IMPLEMENTATIONS["dot_product"]


def select_attention(cfg: ModelConfig) -> Implementation:
    """The implementation ``cfg.attention`` names, checked against the platform JAX runs on and ``cfg.dtype``.

    Raises:
      ConfigError: the implementation does not run on this platform or dtype (one line: key, why, fix).
    """
    impl = IMPLEMENTATIONS[cfg.attention]
    platform = jax.default_backend()
    if impl.platforms and platform not in impl.platforms:
        raise ConfigError(
            f"attention={cfg.attention} runs on {' or '.join(impl.platforms)} only and JAX runs on "
            f"{platform}: pass attention=dot_product (or jax_nn)"
        )
    if impl.dtypes and cfg.dtype not in impl.dtypes:
        raise ConfigError(
            f"attention={cfg.attention} takes dtype={' or '.join(impl.dtypes)} activations, not "
            f"dtype={cfg.dtype}: pass dtype={impl.dtypes[0]}, or attention=dot_product"
        )
    return impl


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    cap: float | None = None,
    impl: Implementation = DOT_PRODUCT,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``impl``'s attention computed ``_QUERY_CHUNK`` queries at a time, each block rematerialised in the
    backward pass (``jax.checkpoint``): the same values, with the scores of one block alive at a time."""
    B, T, N, H = q.shape
    if T <= _QUERY_CHUNK:
        return impl.attend(q, k, v, mask, scale, cap, sinks)
    n = -(-T // _QUERY_CHUNK)
    pad = n * _QUERY_CHUNK - T

    def blocks(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, _QUERY_CHUNK, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(B, n, _QUERY_CHUNK, *x.shape[2:]).swapaxes(0, 1)

    block = jax.checkpoint(lambda qm: impl.attend(qm[0], k, v, qm[1], scale, cap, sinks))
    out = jax.lax.map(block, (blocks(q), blocks(mask)))
    return out.swapaxes(0, 1).reshape(B, n * _QUERY_CHUNK, N, H)[:, :T]


def _scores_reduce(q1: jax.Array, cache_k: jax.Array) -> jax.Array:
    """float32 [B, K, G, S] scores of q1 float32 [B, K, G, H] over keys [B, K, H, S]: a multiply-reduce over H in
    float32 (XLA:CPU vectorises it over the slots)."""
    return jnp.sum(q1[..., None] * cache_k[:, :, None].astype(jnp.float32), axis=3)


def _scores_dot(q1: jax.Array, cache_k: jax.Array) -> jax.Array:
    """``_scores_reduce`` as a matmul on the cache's dtype accumulated in float32: the TPU compiler turned the
    multiply-reduce into a float32 copy of every layer's keys at every decode step (docs/scaling.md)."""
    return jnp.einsum(
        "BKGH,BKHS->BKGS", q1.astype(cache_k.dtype), cache_k, preferred_element_type=jnp.float32
    )


def cached_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    cap: float | None = None,
    impl: Implementation = DOT_PRODUCT,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention of new queries over a KV cache in the decode layout.

    The cache keeps keys as [B, K, H, S] and values as [B, K, S, H]. For one query per row (decode, T == 1)
    both products read the cache in place: the scores are a multiply-reduce over H that XLA vectorises over
    the slots, and the weighted sum a batched matmul over contiguous [S, H] rows. At batch 64 on CPU that is a
    256 ms decode step against 349 ms for a multiply-reduce over a [B, S, K, H] cache, and far faster than an
    einsum over that layout, which made XLA transpose the whole cache of every layer at every step
    (docs/benchmarks.md). Several queries per row (a padded prefill, once per rollout) use ``impl`` on
    the cache transposed to [B, S, K, H], in float32 (in ``q``'s dtype for an implementation that names its
    dtypes, e.g. cuDNN's 16-bit kernel).

    Args:
      q: [B, T, N, H] queries (already rotated).
      cache_k: [B, K, H, S] cached keys; cache_v: [B, K, S, H] cached values; N must be a multiple of K.
      mask: bool [B, T, S], True where query t may attend to slot s.
      scale, cap, sinks: as in ``attention``; impl: the prefill's attention (``select_attention``).

    Returns:
      [B, T, N, H] in q's dtype; scores and softmax in float32.
    """
    B, T, N, H = q.shape
    K = cache_k.shape[1]
    if T == 1:
        q1 = q.reshape(B, K, N // K, H).astype(jnp.float32)  # [B, K, G, H]
        q1 = q1 / math.sqrt(H) if scale is None else q1 * scale
        scores = jax.lax.platform_dependent(q1, cache_k, cpu=_scores_reduce, default=_scores_dot)
        scores = softcap(scores, cap)
        scores = jnp.where(mask[:, 0, None, None], scores, _MASK_VALUE)
        probs = sink_softmax(scores, sinks).astype(cache_v.dtype)
        out = jnp.einsum("BKGS,BKSH->BKGH", probs, cache_v, preferred_element_type=jnp.float32)
        return out.reshape(B, 1, N, H).astype(q.dtype)
    # Several queries per row (a padded prefill, once per rollout): the attention on the cache turned to
    # [B, S, K, H], in float32 (XLA:CPU rejects some bf16 x bf16 -> f32 batched dots of this layout).
    dtype = q.dtype if impl.dtypes else jnp.float32
    k = cache_k.transpose(0, 3, 1, 2).astype(dtype)  # [B, S, K, H]
    v = cache_v.transpose(0, 2, 1, 3).astype(dtype)
    out = impl.attend(q.astype(dtype), k, v, mask, scale, cap, sinks)
    return out.astype(q.dtype)


def window_mask(mask: jax.Array, query_positions: jax.Array, key_positions: jax.Array, cfg: ModelConfig):
    """The (global, local) layers' masks: ``mask`` bool [B, T, S], and ``mask`` where the key is within the
    window, ``query - key < sliding_window`` in positions (transformers' ``sliding_window_overlay``). The local
    mask is ``mask`` itself when no layer is local.

    Args:
      query_positions: int [B, T]; key_positions: int [B, S] (or [1, S]).
    """
    if not any(cfg.local_layers):
        return mask, mask
    near = query_positions[:, :, None] - key_positions[:, None, :] < cfg.sliding_window
    return mask, mask & near
