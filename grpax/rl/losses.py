"""GRPO policy loss: clipped surrogate, KL penalty and loss aggregation (pure jnp, jit-friendly).

Per token t of completion i (DeepSeekMath, Shao et al. 2024, eq. 3; PPO, Schulman et al. 2017):

    r_it   = exp(logp_it - old_logp_it)                       importance ratio (1 when num_iterations == 1)
    l_it   = -min(r_it A_i, clip(r_it, 1 - eps, 1 + eps_high) A_i) + beta KL_it

With a distillation teacher (``distillation_coef`` > 0, ``grpax.rl.distill``) A_i becomes a per-token
A_it = A_i - lambda (log pi_old(o_it) - log pi_T(o_it)), the rest unchanged.

``epsilon_high`` > ``epsilon`` is DAPO's clip-higher (Yu et al. 2025). With ``importance_sampling_level=
"sequence"`` (GSPO, Zheng et al. 2025) every token of row i uses the sequence ratio
exp(mean_t(logp_it - old_logp_it)) instead of its own.

``loss_type="cispo"`` is CISPO (MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention", arXiv:2506.13585, eqs. 4-5): the importance-sampling weight is clipped and its gradient stopped,
so every token keeps the REINFORCE gradient A grad log pi, scaled by the clipped weight, instead of losing it to
PPO's clip:

    J_CISPO = E[ 1 / sum_i |o_i| sum_i sum_t sg(r^_it) A_it log pi_theta(o_it | q, o_i,<t) ]
    r^_it   = clip(r_it, 1 - eps_low^IS, 1 + eps_high^IS)          here eps and eps_high
    l_it    = -sg(clip(r_it, 1 - eps, 1 + eps_high)) A_i logp_it + beta KL_it

(verl's ``cispo`` policy loss clips both sides the same way; TRL's ``loss_type="cispo"`` only caps from above,
at ``epsilon_high`` itself, with 5.0 recommended: here ``epsilon_high=4.0`` with ``epsilon`` near 1.)

With rollout correction (``grpax.rl.correction``) each token's policy loss (before the KL term) is multiplied
by the stop-gradient weight w_it, bounded pi_old / pi_sampler, as TRL does.

KL(pi_theta || pi_ref) is estimated per token from samples of pi_theta (Schulman 2020, "Approximating KL
divergence") with log rho = ref_logp - logp, i.e. rho = pi_ref / pi_theta as in GRPO:
k1 = -log rho (unbiased, can be negative), k2 = (log rho)^2 / 2, k3 = (rho - 1) - log rho (unbiased and
never negative; GRPO's choice).

Aggregation (``loss_agg_mode``), with m_it the completion mask and |o_i| = sum_t m_it:
  "token-mean"                    sum_it l_it m_it / sum_it m_it                 (DAPO; TRL "dapo")
  "sequence-mean-token-mean"      1/B sum_i (sum_t l_it m_it / |o_i|)             (GRPO paper; Tunix, MaxText)
  "sequence-mean-token-sum-norm"  1/B sum_i (sum_t l_it m_it / L_max)             (Dr. GRPO, L_max constant)

Every mode is a sum over rows divided by a normaliser that does not depend on the other rows' losses (total
tokens, or the number of rows B). Gradient accumulation passes the full batch's normaliser to each micro-batch
loss (``normalizer=``), so the sum of micro-batch gradients equals the full-batch gradient exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpax.rl.config import LOSS_AGG_MODES, GRPOConfig
from grpax.rl.correction import importance_weights
from grpax.rl.distill import distillation_advantages, reverse_kl

# log rho is clamped here for k3 only, so one token with an absurd ratio gives a large (e^20 ~ 5e8) but finite
# penalty instead of inf; inside [-20, 20] the estimator and its gradient are exact.
_K3_LOG_RATIO_LIMIT = 20.0


def per_token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log-probabilities of the chosen tokens under softmax(logits / temperature).

    Args:
      logits: float32 [B, T, V]; logits[b, t] is the distribution of tokens[b, t].
      tokens: int [B, T] chosen token ids.
      temperature: the sampling temperature tau (> 0); the sampler drew from softmax(logits / tau).

    Returns:
      float32 [B, T] log pi(tokens[b, t]).
    """
    logits = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return chosen - logz


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Entropy in nats of softmax(logits / temperature) at each position: float32 [B, T] from [B, T, V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k1 = -log rho = logp - ref_logp: unbiased estimate of KL(pi || pi_ref), per token; can be negative."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k2 = (log rho)^2 / 2 with log rho = ref_logp - logp: biased, low variance, >= 0."""
    return 0.5 * jnp.square(ref_logprobs - logprobs)


def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 = (rho - 1) - log rho with rho = pi_ref / pi: unbiased, >= 0 (GRPO eq. 4).

    ``expm1`` keeps rho - 1 accurate near rho = 1 (where the difference of two nearly equal numbers would
    round to a tiny negative value); log rho is clamped to [-20, 20] so the result stays finite.
    """
    log_rho = jnp.clip(ref_logprobs - logprobs, -_K3_LOG_RATIO_LIMIT, _K3_LOG_RATIO_LIMIT)
    return jnp.maximum(jnp.expm1(log_rho) - log_rho, 0.0)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
# ``policy_loss``'s default keys: GRPOConfig's, with no KL term (so no reference is needed).
ON_POLICY = GRPOConfig(beta=0.0)


def apply_truncation_mask(completion_mask: jax.Array, truncated: jax.Array) -> jax.Array:
    """Zeroes the mask of rows that hit the length limit (DAPO overlong filtering): [B, T] and bool [B]."""
    return completion_mask * (1 - truncated.astype(completion_mask.dtype))[:, None]


def loss_normalizer(completion_mask: jax.Array, loss_agg_mode: str) -> jax.Array:
    """The denominator of ``loss_agg_mode`` over a (full) batch: float32 scalar.

    Args:
      completion_mask: [B, T], 1 for completion tokens that count (after any truncation masking).
      loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Returns:
      total tokens (at least 1) for "token-mean"; the number of rows B for the sequence modes.

    Raises:
      ValueError: for an unknown loss_agg_mode.
    """
    if loss_agg_mode == "token-mean":
        return jnp.maximum(jnp.sum(completion_mask.astype(jnp.float32)), 1.0)
    if loss_agg_mode in LOSS_AGG_MODES:
        return jnp.asarray(completion_mask.shape[0], jnp.float32)
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")


def aggregate_loss(
    per_token_loss: jax.Array,
    completion_mask: jax.Array,
    loss_agg_mode: str,
    normalizer: jax.Array | float | None = None,
    max_completion_length: int | None = None,
) -> jax.Array:
    """Reduces per-token losses [B, T] to a scalar with ``loss_agg_mode`` (module docstring).

    Args:
      per_token_loss: float32 [B, T]; values at masked positions are ignored (never multiplied, so NaN there
        cannot leak).
      completion_mask: [B, T], 1 = counted token.
      loss_agg_mode: "token-mean", "sequence-mean-token-mean" or "sequence-mean-token-sum-norm".
      normalizer: the full batch's ``loss_normalizer``; None = this batch's own.
      max_completion_length: L_max for "sequence-mean-token-sum-norm" (default T).

    Returns:
      float32 scalar.
    """
    mask = completion_mask.astype(bool)
    if normalizer is None:
        normalizer = loss_normalizer(completion_mask, loss_agg_mode)
    row_sum = jnp.sum(jnp.where(mask, per_token_loss, 0.0), axis=-1)  # [B]
    if loss_agg_mode == "token-mean":
        return jnp.sum(row_sum) / normalizer
    if loss_agg_mode == "sequence-mean-token-mean":
        row_len = jnp.maximum(jnp.sum(mask, axis=-1), 1).astype(jnp.float32)
        return jnp.sum(row_sum / row_len) / normalizer
    if loss_agg_mode == "sequence-mean-token-sum-norm":
        L = per_token_loss.shape[-1] if max_completion_length is None else max_completion_length
        return jnp.sum(row_sum / L) / normalizer
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array | None,
    ref_logprobs: jax.Array | None,
    advantages: jax.Array,
    completion_mask: jax.Array,
    grpo: GRPOConfig = ON_POLICY,
    *,
    max_completion_length: int | None = None,
    normalizer: jax.Array | float | None = None,
    truncated: jax.Array | None = None,
    rollout_logprobs: jax.Array | None = None,
    teacher_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss (negated objective) of a batch or micro-batch.

    Args:
      logprobs: float32 [B, T] log pi_theta of the completion tokens (carries the gradient).
      old_logprobs: float32 [B, T] log pi_old from the sampling policy, or None for on-policy
        (num_iterations == 1): ``stop_gradient(logprobs)``, ratio 1.
      ref_logprobs: float32 [B, T] log pi_ref of the frozen reference, or None (then beta must be 0).
      advantages: float32 [B], one per completion (``compute_advantages``).
      completion_mask: [B, T], 1 = real completion token (EOS included), 0 = padding.
      grpo: the objective's keys, validated where they entered (``GRPOConfig``): ``epsilon`` / ``clip_high``,
        ``beta`` (0 skips the KL term; the reference then only feeds the ``kl`` metric), ``kl_estimator``,
        ``loss_agg_mode``, ``importance_sampling_level`` (GSPO: one length-normalised ratio per row),
        ``loss_type``, ``mask_truncated_completions`` and the rollout correction (``rollout_is_mode``,
        ``vllm_importance_sampling_clip_max`` / ``_clip_min``). Default: ``ON_POLICY`` (GRPOConfig's defaults
        with beta 0).
      max_completion_length: L_max in tokens for "sequence-mean-token-sum-norm" (default T).
      normalizer: the full batch's ``loss_normalizer`` when this is one micro-batch of it; None = this batch.
      truncated: bool [B], rows that hit the length limit (needed with ``mask_truncated_completions``).
      rollout_logprobs: float32 [B, T] log mu of the sampler (the behaviour policy), or None.
      teacher_logprobs: float32 [B, T] log pi_T of a distillation teacher, or None: each token's advantage is
        then A_i - distillation_coef (log pi_old - log pi_T) (``grpax.rl.distill``).

    Returns:
      (loss float32 scalar, aux) where aux holds float32 scalars averaged over this batch's counted tokens:
      ``policy_loss`` (the surrogate term only), ``kl`` (NaN without a reference), ``ratio_mean``,
      ``clip_low_frac`` (ratio < 1 - eps with A < 0), ``clip_high_frac`` (ratio > 1 + eps_high with A > 0),
      ``clip_region_frac`` (either: tokens that get no gradient from the surrogate; with CISPO the tokens
      whose weight was clipped, whatever the sign of A: their gradient is scaled, never removed), and
      ``num_tokens``; with ``rollout_logprobs`` also ``importance_weights``'s ``mismatch/is_*`` statistics of
      w = pi_old / mu (truncated and masked fractions 0 when the correction is off); with ``teacher_logprobs``
      also ``distill/reverse_kl`` (the mean of log pi_old - log pi_T) and ``distill/teacher_logprob``.

    Raises:
      ValueError: beta > 0 without ref_logprobs, mask_truncated_completions without ``truncated``, or the
        rollout correction without ``rollout_logprobs`` (the batch lacks what the keys need).
    """
    mode = grpo.rollout_is_mode
    if grpo.beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={grpo.beta} needs ref_logprobs (the frozen reference model's logprobs)")
    if mode is not None and rollout_logprobs is None:
        raise ValueError(f"rollout correction {mode} needs rollout_logprobs (the sampler's)")
    mask = completion_mask.astype(jnp.float32)
    if grpo.mask_truncated_completions:
        if truncated is None:
            raise ValueError("mask_truncated_completions=True needs `truncated` [B]")
        mask = apply_truncation_mask(mask, truncated)
    bmask = mask.astype(bool)
    # Padding positions may hold anything (inf, NaN): replace them before any arithmetic, so that nothing
    # non-finite appears in the loss or, through 0 * inf, in the gradient.
    logprobs = jnp.where(bmask, logprobs.astype(jnp.float32), 0.0)
    if old_logprobs is None:
        old_logprobs = jax.lax.stop_gradient(logprobs)
    old_logprobs = jnp.where(bmask, old_logprobs.astype(jnp.float32), 0.0)
    ratio = _ratio(logprobs, old_logprobs, mask, grpo.importance_sampling_level)
    adv, distill = advantages.astype(jnp.float32)[:, None], {}
    if teacher_logprobs is not None:
        teacher_logprobs = jnp.where(bmask, teacher_logprobs.astype(jnp.float32), 0.0)
        if grpo.distillation_coef > 0:  # [B] -> [B, T]; at 0 the advantages stay GRPO's bit for bit
            adv = distillation_advantages(advantages, old_logprobs, teacher_logprobs, grpo.distillation_coef)
        distill = {
            "distill/reverse_kl": _masked_mean(reverse_kl(old_logprobs, teacher_logprobs), bmask),
            "distill/teacher_logprob": _masked_mean(teacher_logprobs, bmask),
        }
    surrogate, clipped_low, clipped_high = _surrogate(ratio, adv, logprobs, grpo)
    correction = {}
    if rollout_logprobs is not None:
        surrogate, correction = _corrected(surrogate, old_logprobs, rollout_logprobs, mask, grpo)
    per_token, kl = surrogate, None
    if ref_logprobs is not None:
        ref_logprobs = jnp.where(bmask, ref_logprobs.astype(jnp.float32), 0.0)
        kl = KL_ESTIMATORS[grpo.kl_estimator](logprobs, ref_logprobs)
        if grpo.beta > 0:
            per_token = surrogate + grpo.beta * kl
    aggregate = lambda x: aggregate_loss(x, mask, grpo.loss_agg_mode, normalizer, max_completion_length)  # noqa: E731
    aux = {
        "policy_loss": aggregate(surrogate),
        "kl": _masked_mean(kl, bmask) if kl is not None else jnp.float32(jnp.nan),
        "ratio_mean": _masked_mean(ratio, bmask),
        "clip_low_frac": _masked_mean(clipped_low.astype(jnp.float32), bmask),
        "clip_high_frac": _masked_mean(clipped_high.astype(jnp.float32), bmask),
        "clip_region_frac": _masked_mean((clipped_low | clipped_high).astype(jnp.float32), bmask),
        "num_tokens": jnp.sum(mask),
        **correction,
        **distill,
    }
    return aggregate(per_token), {k: jax.lax.stop_gradient(v) for k, v in aux.items()}


def _corrected(surrogate, old_logprobs, rollout_logprobs, mask, grpo: GRPOConfig):
    """The surrogate times the rollout-correction weights (with ``grpo.rollout_is_mode``; without one it is
    returned as it is) and the weights' ``mismatch/is_*`` statistics (of the unbounded token ratio when off)."""
    mode = grpo.rollout_is_mode
    weights, stats = importance_weights(
        old_logprobs,
        rollout_logprobs,
        mask,
        mode or "token_truncate",
        grpo.vllm_importance_sampling_clip_max if mode else None,
        grpo.vllm_importance_sampling_clip_min if mode else None,
    )
    return (surrogate if mode is None else surrogate * weights), stats


def _ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array, level: str) -> jax.Array:
    """r_it = pi_theta / pi_old per token, or (GSPO, ``level="sequence"``) exp of the row's mean log-ratio."""
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        row_len = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=-1, keepdims=True) / row_len, log_ratio.shape)
    return jnp.exp(log_ratio)


def _surrogate(
    ratio: jax.Array, adv: jax.Array, logprobs: jax.Array, grpo: GRPOConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-token surrogate loss [B, T] of ``grpo.loss_type`` (module docstring), and where the clip acted
    (bool [B, T], below and above): PPO's tokens that lose their gradient, CISPO's whose weight was clipped."""
    low, high = ratio < 1.0 - grpo.epsilon, ratio > 1.0 + grpo.clip_high
    clipped = jnp.clip(ratio, 1.0 - grpo.epsilon, 1.0 + grpo.clip_high)
    if grpo.loss_type == "cispo":  # every token keeps its gradient, scaled by the clipped weight
        return -jax.lax.stop_gradient(clipped) * adv * logprobs, low, high
    return -jnp.minimum(ratio * adv, clipped * adv), low & (adv < 0), high & (adv > 0)
