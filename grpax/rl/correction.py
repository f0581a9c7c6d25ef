"""Rollout correction: importance weights between the trainer's and the sampler's policy (pure jnp, jittable).

The sampler (the behaviour policy mu, whose per-token logprobs travel as ``rollout_logprobs``) and the trainer
(pi_old, ``old_logprobs``: recomputed by the trainer at the very params that sampled, or ``stop_gradient(logprobs)``
on-policy) score the same tokens differently: 16-bit rounding, a top-k / top-p filter, or a sampler that computes
another function. Staleness never enters the weight (pi_old is of the sampling params; the updates a stale batch
has not seen are in the clipped ratio pi_theta / pi_old). The GRPO gradient assumes the tokens were drawn from
pi_old; weighting each token's loss by

    w_it = pi_old(o_it) / mu(o_it) = exp(old_logp_it - rollout_logp_it)            (token level)
    w_i  = prod_t pi_old(o_it) / mu(o_it) = exp(sum_t (old_logp_it - rollout_logp_it))   (sequence level)

turns the expectation under mu into one under pi_old (importance sampling), where mu gives every token pi_old
can draw a non-zero probability. A top-k / top-p filter does not: it draws from the kept set renormalised, so
every drawn token gets w = Z (the kept mass at its position), E_mu[w] = Z < 1, and no weight restores the tail
that is never drawn. Its variance is unbounded, so the weight is bounded to [C_min, C_max] in one of two ways:

- truncate (TIS; Ionides 2008, "Truncated importance sampling", JCGS; Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training", blog): w <- clip(w, C_min, C_max). Biased (tokens
  whose ratio exceeds the cap are under-weighted), variance at most C_max^2;
- mask (MIS; Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the
  training-inference mismatch", blog): w <- w if C_min <= w <= C_max else 0: outlying tokens (or whole
  sequences) leave the gradient. With both bounds at token level this is IcePop's two-sided band mask (Ling
  Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model", Ring-1T,
  arXiv:2510.18855; [alpha, beta] = [0.5, 5] as verl's example threshold "0.5_5.0").

The weight is a constant (stop-gradient) multiplying the per-token policy loss, before the KL term is added,
as TRL does. Keys and semantics follow TRL's ``GRPOConfig`` (``vllm_importance_sampling_mode`` in
{token,sequence}_{truncate,mask}, ``vllm_importance_sampling_clip_max`` / ``_clip_min``, formerly
``vllm_importance_sampling_cap``; trl/trainer/grpo_config.py and grpo_trainer.py ``_generate_and_score``); the
sequence weight is the product of its tokens' ratios as in TRL and in verl's ``algorithm.rollout_correction``
(``rollout_is=token|sequence``, ``rollout_is_threshold``; docs/algo/rollout_corr.md). As in verl, log w is
clamped to [-20, 20] before the exponential, so a weight is always finite.

``docs/algorithm.md`` ("Rollout correction") says what is and is not unbiased.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpax.rl.config import IMPORTANCE_SAMPLING_MODES

# verl's safety bound on log w: exp(+-20) ~ 5e8 / 2e-9, finite in float32 and in a product with the loss.
_LOG_WEIGHT_LIMIT = 20.0


def log_importance_ratio(
    old_logprobs: jax.Array, rollout_logprobs: jax.Array, completion_mask: jax.Array, level: str
) -> jax.Array:
    """log w = log pi_old - log mu of each counted token (token level) or of its row (sequence level).

    Args:
      old_logprobs: float32 [B, T], the trainer's log pi_old of the completion tokens.
      rollout_logprobs: float32 [B, T], the sampler's log mu of the same tokens.
      completion_mask: [B, T], 1 = counted token; other positions may hold anything (inf, NaN).
      level: "token" or "sequence" (the row's sum broadcast to each of its tokens).

    Returns:
      float32 [B, T], 0 at positions that do not count, clamped to [-20, 20].
    """
    counted = completion_mask.astype(bool)
    diff = jnp.where(counted, old_logprobs.astype(jnp.float32) - rollout_logprobs.astype(jnp.float32), 0.0)
    if level == "sequence":
        diff = jnp.broadcast_to(jnp.sum(diff, axis=-1, keepdims=True), diff.shape)
    return jnp.where(counted, jnp.clip(diff, -_LOG_WEIGHT_LIMIT, _LOG_WEIGHT_LIMIT), 0.0)


def importance_weights(
    old_logprobs: jax.Array,
    rollout_logprobs: jax.Array,
    completion_mask: jax.Array,
    mode: str,
    clip_max: float | None = 2.0,
    clip_min: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The rollout-correction weights of a batch and their statistics (module docstring).

    Args:
      old_logprobs: float32 [B, T] log pi_old (the trainer's; pass ``stop_gradient(logprobs)`` on-policy).
      rollout_logprobs: float32 [B, T] log mu (the sampler's, ``GenerateOutput.logprobs``).
      completion_mask: [B, T], 1 = counted token.
      mode: "token_truncate", "token_mask", "sequence_truncate" or "sequence_mask" (TRL's values).
      clip_max: C_max, or None for no upper bound.
      clip_min: C_min, or None for no lower bound.

    Returns:
      (weights, stats). weights: float32 [B, T], stop-gradient, 0 at positions that do not count. stats:
      float32 scalars over the counted tokens (a sequence weight counts once per token of its row, so that
      micro-batches combine by token counts): ``mismatch/is_ratio_mean``, ``_min``, ``_max`` (the raw ratio w
      before any bound; min +inf and max -inf without counted tokens), ``mismatch/is_truncated_frac`` (w moved
      to a bound) and ``mismatch/is_masked_frac`` (w set to 0).

    Example:
      >>> w, s = importance_weights(jnp.log(jnp.array([[0.9, 0.2]])), jnp.log(jnp.array([[0.3, 0.4]])),
      ...                           jnp.ones((1, 2)), "token_truncate", clip_max=2.0)
      >>> w  # ratios 3.0 and 0.5: 3.0 is truncated to C_max = 2; s["mismatch/is_truncated_frac"] = 0.5
      Array([[2.        , 0.49999997]], dtype=float32)
    """
    assert mode in IMPORTANCE_SAMPLING_MODES, mode  # validated where it entered (GRPOConfig)
    level, bound = mode.split("_")
    counted = completion_mask.astype(bool)
    ratio = jnp.exp(log_importance_ratio(old_logprobs, rollout_logprobs, completion_mask, level))
    lo = -jnp.inf if clip_min is None else clip_min
    hi = jnp.inf if clip_max is None else clip_max
    outside = counted & ((ratio < lo) | (ratio > hi))
    if bound == "truncate":
        weights = jnp.clip(ratio, lo, hi)
    else:
        weights = jnp.where(outside, 0.0, ratio)
    weights = jax.lax.stop_gradient(jnp.where(counted, weights, 0.0))
    num = jnp.maximum(jnp.sum(counted), 1).astype(jnp.float32)
    frac = jnp.sum(outside) / num
    zero = jnp.float32(0.0)
    stats = {
        "mismatch/is_ratio_mean": jnp.sum(jnp.where(counted, ratio, 0.0)) / num,
        "mismatch/is_ratio_min": jnp.min(jnp.where(counted, ratio, jnp.inf)),
        "mismatch/is_ratio_max": jnp.max(jnp.where(counted, ratio, -jnp.inf)),
        "mismatch/is_truncated_frac": frac if bound == "truncate" else zero,
        "mismatch/is_masked_frac": frac if bound == "mask" else zero,
    }
    return weights, {k: jax.lax.stop_gradient(v) for k, v in stats.items()}
