"""Token sampling from next-token logits: temperature, top-k, top-p (nucleus) and greedy.

Pure, jit-able functions on float32 logits [B, V]. Filtering follows the usual definitions (Holtzman et al.
2020 for nucleus sampling; the same semantics as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper``):
top-k keeps the k largest logits, top-p keeps the smallest set of most likely tokens whose probability mass
reaches p (always at least one token). ``filter_logits`` gives the distribution a draw comes from
(temperature, then top-k, then top-p, renormalised over the kept tokens); the sampler reports each token's
log-probability under that distribution (``token_logprobs`` of the filtered logits), the behaviour policy of
the rollout. Without a filter it is the temperature-scaled softmax the trainer scores; with one the two differ
by -log(kept mass) at each step (a biased GRPO ratio and KL, which is why training samples unfiltered by
default).

The ``*_per_row`` variants take each row's own temperature, top-k and top-p as arrays [B] (the engine's rows of
requests with different settings, one program for all of them): a row keeps exactly the tokens the scalar
filters keep for it. Per-row top-k finds each row's k-th largest logit by bisection over the float32 order
(``_kth_largest_by_bisection``) unless every row asks the one static k, which keeps ``apply_top_k``'s path.

On a GPU no step sorts the vocabulary: top-k's threshold comes from the largest logit of each block of
``_TOP_K_BLOCK`` tokens (``_kth_largest_by_blocks``; XLA's GPU top-k sorts the whole row for k > 16), top-p's by
bisection. CPU and TPU keep ``lax.top_k`` for top-k (XLA:CPU's partial top-k measured faster than the blocks
there, docs/benchmarks.md; the TPU's program stays as it was). Each step runs under a ``jax.named_scope`` (top_k,
top_p, draw, logprobs), so profiles name it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf

# Tokens per block of ``_kth_largest_by_blocks``: near sqrt(V / k), which balances its two top-k's (V / block
# block maxima, k * block candidates: 4008 and 1600 at V = 128256, k = 50), and a power of two that divides a
# vocabulary split over up to 8 devices (128256 = 8 * 16032), so that each block stays inside one device's part.
_TOP_K_BLOCK = 32


def apply_top_k(logits: jax.Array, top_k: int) -> jax.Array:
    """Keeps the ``top_k`` largest logits of each row, sets the rest to -inf.

    Args:
      logits: float32 [B, V].
      top_k: static number of tokens to keep; 0 (or >= V) keeps all.

    Returns:
      float32 [B, V]; ties with the k-th value are kept.
    """
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    with jax.named_scope("top_k"):
        # The k-th largest logit [B, 1]: the same value both ways, so the same tokens on every platform.
        kth = jax.lax.platform_dependent(
            logits,
            cuda=functools.partial(_kth_largest_by_blocks, top_k=top_k),
            default=functools.partial(_kth_largest_by_sort, top_k=top_k),
        )
        return jnp.where(logits >= kth, logits, _NEG_INF)


def _kth_largest_by_sort(logits: jax.Array, top_k: int) -> jax.Array:
    """float32 [B, 1]: the ``top_k``-th largest of each row of ``logits`` [B, V] by ``lax.top_k`` (CPU, TPU)."""
    # The barrier keeps XLA from fusing the slice into the TopK: on CPU, "top_k then take the k-th value" is
    # otherwise rewritten into a path ~100x slower than the top_k itself (150 ms vs 1.4 ms at B=16, V=49152).
    return jax.lax.optimization_barrier(jax.lax.top_k(logits, top_k)[0])[..., -1:]


def _kth_largest_by_blocks(logits: jax.Array, top_k: int, block: int = _TOP_K_BLOCK) -> jax.Array:
    """``_kth_largest_by_sort``'s value without sorting the vocabulary (the GPU's path).

    Each row is cut into blocks of ``block`` tokens (the last one padded with -inf). The ``top_k`` blocks with
    the largest maxima hold ``top_k`` tokens at least as large as the row's k-th largest value T: when one of the
    row's top k lies in another block, that block's maximum bounds each chosen block's maximum from below, and
    it is >= T. So the k-th largest of the chosen blocks' ``top_k * block`` tokens is T exactly, ties included.
    Two small top-k's per row (V / block block maxima, then ``top_k * block`` candidates) replace the top-k of V
    tokens, which XLA's GPU backend sorts whole for k > 16 (its top-k kernel takes k <= 16).

    Args:
      logits: float32 [B, V].
      top_k: static, 1 <= top_k < V.
      block: tokens per block.

    Returns:
      float32 [B, 1].
    """
    B, V = logits.shape
    num_blocks = -(-V // block)
    if num_blocks <= 2 * top_k:  # too few blocks to leave many tokens out
        return _kth_largest_by_sort(logits, top_k)
    padded = jnp.pad(logits, ((0, 0), (0, num_blocks * block - V)), constant_values=_NEG_INF)
    blocks = padded.reshape(B, num_blocks, block)
    _, chosen = jax.lax.top_k(blocks.max(axis=-1), top_k)  # [B, k] the blocks with the largest maxima
    candidates = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(B, top_k * block)
    return jax.lax.top_k(candidates, top_k)[0][..., -1:]


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (IEEE-754 bits, negatives' magnitude bits flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def apply_top_p(logits: jax.Array, top_p: float) -> jax.Array:
    """Nucleus filter: keeps the smallest set of most likely tokens whose probability mass is >= ``top_p``.

    A token is kept when the mass of the strictly more likely tokens is < ``top_p`` (so ties at the threshold
    are kept and the most likely token always is). That set is ``logits >= T`` for the smallest T with
    ``mass(logits > T) < top_p``, found by bisection over the float32 order (32 masked sums over V) instead of
    sorting the vocabulary, which costs ~100x more on CPU at V = 49k.

    Args:
      logits: float32 [B, V] (already temperature-scaled).
      top_p: mass in (0, 1]; 1.0 keeps all.

    Returns:
      float32 [B, V] with dropped tokens at -inf.
    """
    if top_p >= 1.0:
        return logits
    with jax.named_scope("top_p"):
        return _nucleus(logits, top_p)


def _nucleus(logits: jax.Array, top_p: float | jax.Array) -> jax.Array:
    """``apply_top_p`` for top_p < 1 (a number, or float32 [B]: each row's)."""
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _sortable(logits)

    def mass_above(threshold):  # [B] mass of tokens whose key is > threshold [B]
        return jnp.sum(jnp.where(keys > threshold[:, None], probs, 0.0), axis=-1)

    def step(_, bounds):
        lo, hi = bounds  # invariant: mass_above(lo) >= top_p > mass_above(hi)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        below = mass_above(mid) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    lo = jnp.min(keys, axis=-1) - 1
    hi = jnp.max(keys, axis=-1)
    _, threshold = jax.lax.fori_loop(0, 33, step, (lo, hi))
    return jnp.where(keys >= threshold[:, None], logits, _NEG_INF)


def _kth_largest_by_bisection(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """float32 [B, 1]: the ``top_k[b]``-th largest of each row of ``logits`` [B, V], each row its own k (int32 [B],
    clipped to 1..V): the largest value whose row holds at least k values >= it, found by bisection over the
    float32 order (32 counts over V; no sort). The same value as ``_kth_largest_by_sort`` for the same k."""
    V = logits.shape[-1]
    k = jnp.clip(top_k, 1, V)
    keys = _sortable(logits)

    def step(_, bounds):
        lo, hi = bounds  # invariant: count(keys >= lo) >= k > count(keys >= hi)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        enough = jnp.sum(keys >= mid[:, None], axis=-1, dtype=jnp.int32) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, step, (jnp.min(keys, axis=-1), jnp.max(keys, axis=-1) + 1))
    bits = jnp.where(lo >= 0, lo, lo ^ jnp.int32(0x7FFFFFFF))  # _sortable's inverse
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[:, None]


def apply_top_k_per_row(logits: jax.Array, top_k: jax.Array, static_top_k: int = 0) -> jax.Array:
    """``apply_top_k`` with each row's own k: row b keeps its ``top_k[b]`` largest logits (0 or >= V: all).

    Where every row asks ``static_top_k`` (the engine's configured k) this is ``apply_top_k(logits,
    static_top_k)``; otherwise each row's threshold comes from ``_kth_largest_by_bisection`` (costlier than
    ``lax.top_k`` on CPU: docs/benchmarks.md). Both thresholds are the row's k-th largest value exactly, so a row
    keeps the same tokens either way.

    Args:
      logits: float32 [B, V].
      top_k: int32 [B] tokens to keep per row.
      static_top_k: static; the k whose rows take ``apply_top_k``'s path.

    Returns:
      float32 [B, V]; ties with a row's k-th value are kept.
    """
    V = logits.shape[-1]

    def per_row(x):
        with jax.named_scope("top_k"):
            off = ((top_k <= 0) | (top_k >= V))[:, None]
            return jnp.where(off | (x >= _kth_largest_by_bisection(x, top_k)), x, _NEG_INF)

    same = jnp.all(top_k == static_top_k)
    return jax.lax.cond(same, lambda x: apply_top_k(x, static_top_k), per_row, logits)


def apply_top_p_per_row(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """``apply_top_p`` with each row's own mass ``top_p`` float32 [B] (1.0: keeps all); skipped where no row
    filters. The same bisection as ``apply_top_p``, so a row keeps the same tokens as there."""

    def per_row(x):
        with jax.named_scope("top_p"):
            return jnp.where((top_p < 1.0)[:, None], _nucleus(x, top_p), x)

    return jax.lax.cond(jnp.any(top_p < 1.0), per_row, lambda x: x, logits)


def _pick(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw: int32 [B] index i with probability weights[:, i] / sum (weights >= 0, [B, M])."""
    cdf = jnp.cumsum(weights, axis=-1)
    index = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    # float rounding at u ~ 1 may step past the end; fall back to the last entry with weight
    last = weights.shape[-1] - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
    return jnp.minimum(index, last).astype(jnp.int32)


def filter_logits(
    logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """The logits of the distribution a draw comes from: ``logits / temperature``, then top-k, then top-p.

    Args:
      logits: float32 [B, V]; temperature > 0; top_k (static, 0 = off) and top_p (1.0 = off) as in
        ``apply_top_k`` / ``apply_top_p``.

    Returns:
      float32 [B, V], dropped tokens at -inf: ``softmax`` of it is the sampling distribution.
    """
    scaled = logits.astype(jnp.float32) / temperature
    return apply_top_p(apply_top_k(scaled, top_k), top_p)


def filter_logits_per_row(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, static_top_k: int = 0
) -> jax.Array:
    """``filter_logits`` with each row's own settings: ``logits / temperature``, then top-k, then top-p.

    Args:
      logits: float32 [B, V].
      temperature: float32 [B], each > 0.
      top_k: int32 [B] (0 = off) and static_top_k as in ``apply_top_k_per_row``.
      top_p: float32 [B] (1.0 = off).

    Returns:
      float32 [B, V], dropped tokens at -inf; a row equals ``filter_logits`` of it with its settings.
    """
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    return apply_top_p_per_row(apply_top_k_per_row(scaled, top_k, static_top_k), top_p)


def sample_from_uniform(
    logits: jax.Array,
    u: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    block_size: int = 256,
) -> jax.Array:
    """Exact categorical draw from two uniforms per row (two-level inverse CDF).

    ``jax.random.categorical`` draws B * V Gumbel variates per step; on CPU that costs more than the model's
    decode step for a 49k vocabulary. Here the vocabulary is cut into blocks: a block is drawn by its
    probability mass, then a token inside it, so P(token) = mass(block) / total * p(token) / mass(block).

    Args:
      logits: float32 [B, V].
      u: float32 [B, 2] uniforms in [0, 1).
      temperature, top_k, top_p: as in ``sample_tokens``.
      block_size: tokens per block (the vocabulary is zero-padded to a multiple).

    Returns:
      int32 [B] token ids.
    """
    return draw_from_uniform(filter_logits(logits, temperature, top_k, top_p), u, block_size)


def draw_from_uniform(scaled: jax.Array, u: jax.Array, block_size: int = 256) -> jax.Array:
    """``sample_from_uniform``'s draw from logits already filtered (``filter_logits``): int32 [B]."""
    B, V = scaled.shape
    with jax.named_scope("draw"):
        weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # [B, V], 0 where filtered
        num_blocks = -(-V // block_size)
        weights = jnp.pad(weights, ((0, 0), (0, num_blocks * block_size - V)))
        weights = weights.reshape(B, num_blocks, block_size)
        block = _pick(weights.sum(axis=-1), u[:, 0])
        inner = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [B, block_size]
        return block * block_size + _pick(inner, u[:, 1])


def sample_tokens(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> jax.Array:
    """Draws one token per row.

    Args:
      logits: float32 [B, V] next-token logits.
      key: a PRNG key (unused when ``greedy``).
      temperature: divides the logits before filtering; must be > 0 unless ``greedy``.
      top_k: static; 0 disables.
      top_p: nucleus mass; 1.0 disables.
      greedy: argmax (ignores temperature, top_k, top_p).

    Returns:
      int32 [B] token ids.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    u = jax.random.uniform(key, (logits.shape[0], 2), jnp.float32)
    return sample_from_uniform(logits, u, temperature=temperature, top_k=top_k, top_p=top_p)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log_softmax(logits / temperature)[token]`` per row (pass temperature 1 for greedy decoding).

    Args:
      logits: float32 [..., V].
      tokens: int [...] chosen token ids.
      temperature: the sampling temperature (> 0).

    Returns:
      float32 [...] log-probabilities.
    """
    with jax.named_scope("logprobs"):
        scaled = logits.astype(jnp.float32) / temperature
        logz = jax.nn.logsumexp(scaled, axis=-1)
        picked = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return picked - logz
