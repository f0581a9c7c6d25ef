"""Token sampling from next-token logits: temperature, top-k, top-p (nucleus) and greedy.

Pure, jit-able functions on float32 logits [B, V]. Filtering follows the usual definitions (Holtzman et al.
2020 for nucleus sampling; the same semantics as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper``):
top-k keeps the k largest logits, top-p keeps the smallest set of most likely tokens whose probability mass
reaches p (always at least one token). The log-probabilities reported for RL (``token_logprobs``) are those of
the temperature-scaled but *unfiltered* distribution, the quantity GRPO's ratio and KL terms use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


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
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]  # [B, 1]
    return jnp.where(logits >= kth, logits, _NEG_INF)


def apply_top_p(logits: jax.Array, top_p: float) -> jax.Array:
    """Nucleus filter: keeps the smallest set of most likely tokens whose probability mass is >= ``top_p``.

    Args:
      logits: float32 [B, V] (already temperature-scaled).
      top_p: mass in (0, 1]; 1.0 keeps all. The most likely token is always kept.

    Returns:
      float32 [B, V] with dropped tokens at -inf.
    """
    if top_p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    keep_sorted = mass_before < top_p
    keep_sorted = keep_sorted.at[..., 0].set(True)
    # Threshold = the smallest kept logit; ties at the threshold are kept as well.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


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
    scaled = logits.astype(jnp.float32) / temperature
    scaled = apply_top_k(scaled, top_k)
    scaled = apply_top_p(scaled, top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log_softmax(logits / temperature)[token]`` per row (pass temperature 1 for greedy decoding).

    Args:
      logits: float32 [..., V].
      tokens: int [...] chosen token ids.
      temperature: the sampling temperature (> 0).

    Returns:
      float32 [...] log-probabilities.
    """
    scaled = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(scaled, axis=-1)
    picked = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - logz
