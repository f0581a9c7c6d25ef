"""On-policy distillation: a teacher's per-token reverse KL as a dense advantage inside the GRPO update.

The student samples completions (the rollout, as for GRPO); a frozen teacher scores every sampled token (its
logprob pass is the reference's machinery: ``train_step.compute_logprobs``); the student is pushed toward the
teacher token by token. Thinking Machines Lab, "On-Policy Distillation" (2025), and MiniLLM (Gu et al., ICLR
2024) minimise the reverse KL

    KL(pi_theta || pi_T) = E_{x ~ pi_theta} [ sum_t log pi_theta(x_t | x_<t) - log pi_T(x_t | x_<t) ]

with its per-token single-sample estimate on the sampled tokens, taken at the sampling params pi_old and
stopped from the gradient:

    rkl_t = log pi_old(x_t) - log pi_T(x_t)                          (>= 0 on average, any sign per token)
    A_t   = A_i + lambda * (-rkl_t)                                  lambda = ``distillation_coef``

with no discounting (each token's own term, not a sum over the later ones: Thinking Machines' choice). A_t goes
to GRPO's clipped surrogate unchanged (``grpax.rl.losses``). On-policy (ratio 1) its gradient is

    grad J = E[ sum_t A_t grad log pi_theta(x_t) ] = -lambda E[ sum_t rkl_t grad log pi_theta(x_t) ] + GRPO's

the REINFORCE gradient of -lambda KL(pi_theta || pi_T), each token's estimate as its own reward (the score
function's expectation E[grad log pi] = 0 removes the derivative of log pi_theta inside the KL). With rewards
that are all equal (a task's reward functions returning 0, A_i = 0) it is pure on-policy distillation; it is
GKD's (Agarwal et al., ICLR 2024) fully on-policy setting (lambda_GKD = 1) with the reverse KL (its generalised
JSD at beta = 1). lambda = 0 is GRPO exactly. The teacher's logprobs are of softmax(logits / tau), the
temperature of the student's (GKD and TRL's ``GKDTrainer`` divide both by it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reverse_kl(old_logprobs: jax.Array, teacher_logprobs: jax.Array) -> jax.Array:
    """rkl_t = log pi_old(x_t) - log pi_T(x_t), the per-token reverse-KL estimate, no gradient.

    Args:
      old_logprobs: float32 [B, C] the student's logprobs of its sampled tokens at the sampling params.
      teacher_logprobs: float32 [B, C] the teacher's of the same tokens.

    Returns:
      float32 [B, C] (any value at padding: mask it).
    """
    return jax.lax.stop_gradient(old_logprobs.astype(jnp.float32) - teacher_logprobs.astype(jnp.float32))


def distillation_advantages(
    advantages: jax.Array, old_logprobs: jax.Array, teacher_logprobs: jax.Array, coef: float
) -> jax.Array:
    """A_t = A_i - lambda rkl_t: GRPO's advantage of row i plus the teacher's dense per-token term.

    Args:
      advantages: float32 [B], A_i (``grpax.rl.advantages.compute_advantages``).
      old_logprobs: float32 [B, C] log pi_old of the sampled tokens.
      teacher_logprobs: float32 [B, C] log pi_T of the same tokens.
      coef: lambda >= 0 (``distillation_coef``).

    Returns:
      float32 [B, C], no gradient.

    Example:
      >>> distillation_advantages(jnp.array([1.0]), jnp.array([[-1.0, -2.0]]), jnp.array([[-0.5, -3.0]]), 0.5)
      Array([[1.25, 0.5 ]], dtype=float32)

      rkl = [-0.5, 1.0]: the teacher likes the first token more (+0.25), the second less (-0.5).
    """
    adv = advantages.astype(jnp.float32)[:, None]
    return adv - coef * reverse_kl(old_logprobs, teacher_logprobs)
