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
* ``flash`` (MaxText's TPU value): Pallas's splash attention kernel (``flash_attention``; TPUs only, no
  sliding-window layers): the scores never in HBM, forward or backward. The update and the reference pass
  run it; the sampler's cached prefill keeps ``dot_product``.

``jax.nn.dot_product_attention`` has no score soft-capping and no attention sinks, so ``jax_nn`` and ``cudnn``
refuse a config with ``attn_logit_softcap`` (Gemma 2) or ``attention_sinks`` (GPT-OSS: a learned logit per head
joins every softmax's denominator, so a query may attend to nothing; ``sink_softmax``). The decode step of one query per row over the KV cache (``cached_attention``
with T == 1) reads the cache in its own layout whatever the choice (``cached_attention``'s docstring), and the
sampler's CPU backend (``grpax.backends.cpu``) runs its own kernels: the choice is the XLA path's.

``window_mask`` builds the (global, local) masks of sliding-window layers; ``chunked_attention`` bounds the
scores alive at once in the update. Shape letters as in ``grpax.models.llama``: B rows, T queries, S keys,
N query heads, K kv heads, H head dim.

The sampler's decode reads a paged KV cache (``grpax.sampler.engine``): per layer one pool of pages
``[num_pages, page_size, 2K, H]``, the key of kv head j at index 2j of axis 2 and its value at 2j + 1 (the
layout of vLLM's TPU backend and of Pallas's ragged paged attention), each sequence's tokens in the pages its
row of a page table names (token p in page ``table[p // page_size]`` at offset ``p % page_size``).
``write_pages`` writes new keys and values; ``paged_attention`` attends one query per sequence over its pages,
in one of ``PAGED_IMPLEMENTATIONS``: ``xla`` gathers the pages a step reads (any platform) and ``ragged_tpu``
is ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (TPU only), which reads only each sequence's
filled pages.
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
from grpax.models.sharding_rules import TENSOR, logical_to_spec

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
    # The barrier (an identity) keeps the TPU compiler from fusing both einsums and the softmax between them into
    # one output fusion nested three deep: libtpu's cost model recursed through it until a compiler thread's stack
    # overflowed (SIGSEGV; llama3.2-1b's update on v6e-8 with remat none, tests/test_compile_check.py).
    probs = jax.lax.optimization_barrier(sink_softmax(scores, sinks).astype(v.dtype))
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


# Sequences are padded to a multiple of ``_FLASH_BLOCK`` rows for the Pallas splash kernel (``flash``); its
# blocks of queries and keys are the longest multiples of it up to ``FLASH_BLOCK_MAX`` that divide them.
_FLASH_BLOCK = 128
FLASH_BLOCK_MAX = 512  # chosen on one v5e against 128 (docs/benchmarks.md, "Pallas's splash attention")
# The segment of the padding ``flash`` adds: its queries attend only to its keys, no real token to either.
_FLASH_PAD_SEGMENT = 2


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    cap: float | None = None,
    sinks: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``attention`` by JAX's Pallas splash attention kernel (``attention=flash``, MaxText's TPU value): the
    scores are computed block by block in the chip's vector memory, forward and backward, never written to HBM.

    ``mask`` must be the model's causal mask over the last T of S keys and the valid keys, the form every
    caller builds (``forward``, ``forward_grouped``, the cached prefill): ``mask[b, t, s] = (s <= t + S - T)
    & valid[b, s]``. The kernel gets it as a causal mask with offset S - T and segment ids (key s: 1 if a query
    attends to it, else 0; query t: its own key's, S - T + t): a real query's keys are the same; a padding
    query (segment 0) attends to padding keys instead of to none, and no real token reads what it computes.
    T and S are padded to multiples of ``_FLASH_BLOCK`` in a segment of their own.

    Same arguments and result as ``attention`` (softmax in float32 inside the kernel; q is scaled before it, in
    its own dtype); ``interpret``: Pallas's interpreter (tests on a CPU). Over a mesh of several devices each
    runs it on its rows and heads (``_flash_sharded``). Source: Dao et al. 2022 (FlashAttention);
    ``jax.experimental.pallas.ops.tpu.splash_attention``, as MaxText's ``attention: flash`` calls it.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, T, N, H = q.shape
    S = k.shape[1]
    seg_kv = jnp.any(mask, axis=1).astype(jnp.int32)  # [B, S]
    seg_q = seg_kv[:, S - T :]
    Tp, Sp = -(-T // _FLASH_BLOCK) * _FLASH_BLOCK, -(-S // _FLASH_BLOCK) * _FLASH_BLOCK
    if Tp > T and Sp == S:  # padded queries need a padded key to attend to
        Sp += _FLASH_BLOCK
    factor = 1.0 / math.sqrt(H) if scale is None else scale
    q = (q.astype(jnp.float32) * factor).astype(q.dtype)

    def padded(x: jax.Array, length: int) -> jax.Array:  # [B, L, heads, H] -> [B, heads, length, H]
        return jnp.pad(x, [(0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)]).transpose(0, 2, 1, 3)

    def pad_segments(ids: jax.Array, length: int) -> jax.Array:
        return jnp.pad(ids, [(0, 0), (0, length - ids.shape[1])], constant_values=_FLASH_PAD_SEGMENT)

    def kernel(q, k, v, seg_q, seg_kv, sinks):  # one device's rows and heads
        heads = q.shape[1]
        causal = masks.CausalMask((Tp, Sp), offset=S - T)
        attend = splash.make_splash_mha(
            masks.MultiHeadMask([causal] * heads),
            head_shards=1,
            q_seq_shards=1,
            block_sizes=_flash_blocks(Tp, Sp),
            attn_logits_soft_cap=cap,
            interpret=interpret,
        )
        one = lambda q, k, v, sq, skv: attend(q, k, v, splash.SegmentIds(sq, skv), sinks)  # noqa: E731
        return jax.vmap(one)(q, k, v, seg_q, seg_kv)

    args = (padded(q, Tp), padded(k, Sp), padded(v, Sp), pad_segments(seg_q, Tp), pad_segments(seg_kv, Sp))
    sinks = None if sinks is None else sinks.astype(jnp.float32)
    out = _flash_sharded(kernel, *args, sinks)  # [B, N, Tp, H]
    return out[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)


def _flash_blocks(q_len: int, kv_len: int):
    """The splash kernel's block sizes, forward and backward: the longest multiples of ``_FLASH_BLOCK`` up to
    ``FLASH_BLOCK_MAX`` that divide the (padded) query and key lengths."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    def block(length: int) -> int:
        sizes = range(_FLASH_BLOCK, max(FLASH_BLOCK_MAX, _FLASH_BLOCK) + 1, _FLASH_BLOCK)
        return max(b for b in sizes if length % b == 0)

    bq, bkv = block(q_len), block(kv_len)
    return splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip


def _flash_sharded(kernel, q, k, v, seg_q, seg_kv, sinks):
    """``kernel`` over a mesh: a Pallas call is not partitioned by XLA, so each device runs it on its own rows
    (the batch's mesh axes, ``sharding_rules``' "batch") and, where both head counts divide by "tensor", its
    own heads; alone on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q, k, v, seg_q, seg_kv, sinks)
    shape = dict(mesh.shape)
    # () where no batch axis divides the rows: each device takes them all
    spec = logical_to_spec(("batch",), shape=q.shape[:1], mesh_shape=shape, name="attention rows")
    rows = spec[0] if len(spec) else None
    tensor = shape.get(TENSOR, 1)
    heads = TENSOR if tensor > 1 and q.shape[1] % tensor == 0 and k.shape[1] % tensor == 0 else None
    P = jax.sharding.PartitionSpec
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(P(rows, heads), P(rows, heads), P(rows, heads), P(rows), P(rows), P(heads)),
        out_specs=P(rows, heads),
        check_vma=False,
    )(q, k, v, seg_q, seg_kv, sinks)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One attention implementation.

    Attributes:
      attend: the function, with ``attention``'s arguments and result.
      platforms: the JAX platforms it runs on (``target_platform``: the traced program's); () = any.
      dtypes: the activation dtypes (``cfg.dtype``) it takes; () = any (a cached prefill then attends in
        float32, else in ``cfg.dtype``).
      causal_blocks: it computes in blocks of its own, never holding the [T, S] scores, and reads the mask as a
        causal one over the last T of S keys and the keys some query attends to (``flash_attention``), so
        ``chunked_attention`` hands it whole sequences and a cached prefill (whose slots need not end at its
        last query) attends by ``attention`` instead.
    """

    attend: Attend
    platforms: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    causal_blocks: bool = False


# The values of ``ModelConfig.attention`` (registry.ATTENTION_IMPLEMENTATIONS holds the same names).
IMPLEMENTATIONS: dict[str, Implementation] = {
    "dot_product": Implementation(attention),
    "jax_nn": Implementation(jax_nn_attention),
    "cudnn": Implementation(
        functools.partial(jax_nn_attention, implementation="cudnn"), ("gpu",), ("bfloat16", "float16")
    ),
    "flash": Implementation(flash_attention, ("tpu",), causal_blocks=True),
}
DOT_PRODUCT = IMPLEMENTATIONS["dot_product"]


def target_platform() -> str:
    """The platform of the program being traced: its mesh's devices' (``jax.set_mesh``; a TPU slice compiled
    from a CPU host with ``compile_topology`` is "tpu"), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def select_attention(cfg: ModelConfig) -> Implementation:
    """The implementation ``cfg.attention`` names, checked against the traced program's platform
    (``target_platform``) and ``cfg.dtype``.

    Raises:
      ConfigError: the implementation does not run on this platform or dtype (one line: key, why, fix).
    """
    impl = IMPLEMENTATIONS[cfg.attention]
    platform = target_platform()
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
    if T <= _QUERY_CHUNK or impl.causal_blocks:
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
    dtypes, e.g. cuDNN's 16-bit kernel; ``attention`` for one of ``causal_blocks``).

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
    impl = DOT_PRODUCT if impl.causal_blocks else impl
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


PAGED_IMPLEMENTATIONS = ("xla", "ragged_tpu")


def ragged_tpu_takes(num_kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether Pallas's ragged paged attention kernel takes a model of these kv heads and head dim with pools
    of this dtype: head_dim a multiple of 128 (its lanes) and the pool's 2K heads a whole number of its
    sublane tiles (2K / packing in 1, 2, 4, 8 or a multiple of 8; packing = 4 / the dtype's bytes), as its
    ``get_min_heads_per_blk`` and ``broadcast_to_shape`` require."""
    packing = max(1, 4 // jnp.dtype(dtype).itemsize)
    heads = 2 * num_kv_heads
    tiled = heads % packing == 0 and (heads // packing in (1, 2, 4, 8) or heads // packing % 8 == 0)
    return head_dim % 128 == 0 and tiled


def write_pages(
    kv_pages: jax.Array, k: jax.Array, v: jax.Array, pages: jax.Array, offsets: jax.Array
) -> jax.Array:
    """Writes keys and values into a page pool (in place where ``kv_pages`` is a loop carry or donated).

    Args:
      kv_pages: [P, page_size, 2K, H] one layer's pool.
      k, v: [T, K, H] the new keys and values (any float dtype; stored in the pool's).
      pages: int32 [T] the page of each; indices >= P are dropped (padding).
      offsets: int32 [T] the slot in its page.

    Returns:
      The pool with the T entries written.
    """
    T, K, H = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(T, 2 * K, H).astype(kv_pages.dtype)
    return kv_pages.at[pages, offsets].set(kv, mode="drop")


def paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    scale: float | None = None,
    cap: float | None = None,
    window: int | None = None,
    implementation: str = "xla",
    sinks: jax.Array | None = None,
) -> jax.Array:
    """One query per sequence over its pages of the KV cache (the decode step's attention).

    Args:
      q: [S, N, H] queries (already rotated), one per sequence.
      kv_pages: [P, page_size, 2K, H] the layer's pool (``write_pages``; the new key already written).
      page_table: int32 [S, n] the pages of each sequence in order (entries past its length are not read).
      lengths: int32 [S] keys each query attends, positions 0..lengths - 1 (>= 1).
      scale, cap: as in ``attention``; window: a sliding window (keys with ``query - key < window``; the
        query is at position lengths - 1), or None.
      implementation: one of ``PAGED_IMPLEMENTATIONS`` (``ragged_tpu`` lowers for TPU only, without sinks).
      sinks: float [N] attention sinks (``sink_softmax``; GPT-OSS), or None.

    Returns:
      [S, N, H] in q's dtype; scores and softmax in float32.
    """
    if implementation == "ragged_tpu":
        assert sinks is None, "Pallas's ragged paged attention has no attention sinks"
        return _ragged_tpu(q, kv_pages, page_table, lengths, scale, cap, window)
    return _gathered(q, kv_pages, page_table, lengths, scale, cap, window, sinks)


def _gathered(q, kv_pages, page_table, lengths, scale, cap, window, sinks=None):
    """``paged_attention`` in XLA's ops: the n pages of every sequence gathered ([S, n * page_size] keys)."""
    S, N, H = q.shape
    n, page_size, K = page_table.shape[1], kv_pages.shape[1], kv_pages.shape[2] // 2
    kv = kv_pages[page_table].reshape(S, n * page_size, K, 2, H)  # [S, n * page_size, K, 2, H]
    k, v = kv[..., 0, :], kv[..., 1, :]
    q1 = q.reshape(S, K, N // K, H).astype(jnp.float32)
    q1 = q1 / math.sqrt(H) if scale is None else q1 * scale
    scores = jax.lax.platform_dependent(q1, k, cpu=_paged_scores_f32, default=_paged_scores_dot)
    scores = softcap(scores, cap)
    slots = jnp.arange(n * page_size, dtype=jnp.int32)[None]
    mask = slots < lengths[:, None]  # [S, n * page_size]
    if window is not None:
        mask &= (lengths[:, None] - 1) - slots < window
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = sink_softmax(scores, sinks).astype(v.dtype)
    out = jnp.einsum("SKGT,STKH->SKGH", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(S, N, H).astype(q.dtype)


def _paged_scores_f32(q1: jax.Array, k: jax.Array) -> jax.Array:
    """float32 [S, K, G, T] scores of q1 float32 [S, K, G, H] over keys [S, T, K, H] widened to float32 (CPU, as
    ``_scores_reduce``: a bfloat16 cache's query is not rounded)."""
    return jnp.einsum("SKGH,STKH->SKGT", q1, k.astype(jnp.float32))


def _paged_scores_dot(q1: jax.Array, k: jax.Array) -> jax.Array:
    """``_paged_scores_f32`` as a matmul on the cache's dtype accumulated in float32 (as ``_scores_dot``)."""
    return jnp.einsum("SKGH,STKH->SKGT", q1.astype(k.dtype), k, preferred_element_type=jnp.float32)


def _ragged_tpu(q, kv_pages, page_table, lengths, scale, cap, window):
    """``paged_attention`` by Pallas's ragged paged attention kernel (TPU): one query per sequence."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    S, N, H = q.shape
    blocks = _ragged_block_sizes(page_table.shape[1], kv_pages.shape[1], S)

    def kernel(q, kv_pages, lengths, page_table):
        return ragged_paged_attention(
            q.astype(kv_pages.dtype),
            kv_pages,
            lengths.astype(jnp.int32),
            page_table.astype(jnp.int32),
            jnp.arange(S + 1, dtype=jnp.int32),  # cu_q_lens: one query per sequence
            jnp.asarray([S], jnp.int32),
            sm_scale=1.0 / math.sqrt(H) if scale is None else scale,
            sliding_window=window,
            soft_cap=cap,
            mask_value=_MASK_VALUE,
            num_kv_pages_per_block=blocks[0],
            num_queries_per_block=blocks[1],
        ).astype(q.dtype)

    # A Pallas call is not partitioned by XLA: over a mesh of several devices (any axes: a data-parallel
    # rollout mesh too) each chip runs it on its own kv heads (the pool's axis 2 split over "tensor", k/v pairs
    # staying together) where they divide by "tensor", as the pools are placed (XLABackend.page_spec); else on
    # all of them (the pools replicated); the rest replicated.
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q, kv_pages, lengths, page_table)
    tensor = dict(mesh.shape).get(TENSOR, 1)
    heads = TENSOR if tensor > 1 and (kv_pages.shape[2] // 2) % tensor == 0 else None
    P = jax.sharding.PartitionSpec
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(P(None, heads, None), P(None, None, heads, None), P(), P()),
        out_specs=P(None, heads, None),
        check_vma=False,
    )(q, kv_pages, lengths, page_table)


def _ragged_block_sizes(
    pages_per_seq: int, page_size: int, num_queries: int
) -> tuple[int | None, int | None]:
    """(kv pages, queries) per block of the ragged kernel: None, None (the kernel's own tuned table) where this
    process runs on TPU chips; else (a compile for a TPU topology from a CPU host, where the table's lookup of the
    local device fails) 512 tokens of pages and 32 queries."""
    if jax.devices()[0].platform == "tpu":
        return None, None
    return min(pages_per_seq, max(1, 512 // page_size)), min(num_queries, 32)
