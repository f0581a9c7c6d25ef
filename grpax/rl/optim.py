"""The GRPO optimizer: AdamW on a warmup + decay learning-rate schedule (the train step clips the gradients'
global norm before it, ``grpax.rl.train_step``).

As MaxText's RL optimizer (``utils_rl.get_optimizer``): linear warmup from 0 to the peak learning rate over
``warmup_ratio * num_train_steps`` steps, then a cosine decay to ``end_lr_ratio * peak`` at the last step.
The schedule is always sized from the real number of optimizer steps of the run, which the caller must pass:
a schedule sized for a default length would decay too early or never.

Unlike MaxText, weight decay is applied to matrices only (ndim >= 2), not to RMSNorm scales, as in the usual
AdamW practice (decaying a norm scale toward 0 shrinks the activations it scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from grpax.rl.config import LR_SCHEDULES


def num_warmup_steps(num_train_steps: int, warmup_ratio: float = 0.0, warmup_steps: int | None = None) -> int:
    """Warmup length in steps: ``warmup_steps`` when given, else ``int(warmup_ratio * num_train_steps)``."""
    if warmup_steps is not None:
        return int(warmup_steps)
    return int(warmup_ratio * num_train_steps)


def make_lr_schedule(
    learning_rate: float,
    num_train_steps: int,
    *,
    warmup_ratio: float = 0.0,
    warmup_steps: int | None = None,
    schedule: str = "cosine",
    end_lr_ratio: float = 0.0,
) -> optax.Schedule:
    """Learning rate as a function of the optimizer step (0-based: step s is the s-th update).

    Args:
      learning_rate: peak learning rate eta.
      num_train_steps: the number of optimizer updates of the whole run (required: it sizes the decay).
      warmup_ratio: fraction of num_train_steps spent warming up linearly from 0 (ignored if warmup_steps).
      warmup_steps: warmup length in steps, overriding warmup_ratio.
      schedule: "cosine" (to end_lr_ratio * eta at num_train_steps), "linear" (same end), or "constant".
      end_lr_ratio: final learning rate as a fraction of the peak.

    Returns:
      An optax schedule: lr(0) = 0 when there is warmup (eta otherwise), lr(warmup) = eta,
      lr(num_train_steps) = end_lr_ratio * eta for the decaying schedules.

    Raises:
      ValueError: num_train_steps < 1, warmup >= num_train_steps (with a decay), or an unknown schedule.
    """
    if num_train_steps < 1:
        raise ValueError(f"num_train_steps={num_train_steps}: the schedule needs the run's real step count")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
    warmup = num_warmup_steps(num_train_steps, warmup_ratio, warmup_steps)
    if warmup < 0 or (warmup >= num_train_steps and schedule != "constant"):
        raise ValueError(f"warmup of {warmup} steps leaves no room to decay within {num_train_steps} steps")
    end = end_lr_ratio * learning_rate
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, num_train_steps, end_value=end)
    decay_steps = num_train_steps - warmup
    if schedule == "linear":
        after = optax.linear_schedule(learning_rate, end, decay_steps)
    else:
        after = optax.constant_schedule(learning_rate)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup), after], [warmup])


def _decay_mask(params):
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(
    learning_rate: float | optax.Schedule,
    num_train_steps: int,
    *,
    warmup_ratio: float = 0.0,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.1,
    eps: float = 1e-8,
    schedule: str = "cosine",
    end_lr_ratio: float = 0.0,
    mu_dtype: str = "",
) -> optax.GradientTransformation:
    """AdamW(b1, b2, eps, weight_decay) on ``make_lr_schedule``.

    Gradient clipping is not part of it: ``grpax.rl.train_step`` clips the global norm (``max_grad_norm``)
    before its guarded update, where the clipped gradients can overwrite the raw ones in place (a clip inside
    the optimizer needed one more params-sized tree of temporaries).

    Args:
      learning_rate: peak learning rate, or a ready schedule (then the warmup/schedule arguments are unused).
      num_train_steps: optimizer updates in the run (sizes the schedule).
      warmup_ratio, warmup_steps, schedule, end_lr_ratio: see ``make_lr_schedule``.
      b1, b2, eps: AdamW moment decays and denominator epsilon.
      weight_decay: decoupled weight decay, applied to params with ndim >= 2.
      mu_dtype: the dtype m is stored in ('' = the params'); each update computes in float32 (optax).

    Returns:
      An optax GradientTransformation; its state counts applied updates, so the schedule advances only on
      updates that were applied.
    """
    lr = (
        learning_rate
        if callable(learning_rate)
        else make_lr_schedule(
            learning_rate,
            num_train_steps,
            warmup_ratio=warmup_ratio,
            warmup_steps=warmup_steps,
            schedule=schedule,
            end_lr_ratio=end_lr_ratio,
        )
    )
    return optax.adamw(
        lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_decay_mask, mu_dtype=mu_dtype or None
    )


def optimizer_from_config(grpo, num_train_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, lr schedule) from a ``GRPOConfig`` and the run's number of optimizer updates."""
    schedule = make_lr_schedule(
        grpo.learning_rate,
        num_train_steps,
        warmup_ratio=grpo.warmup_ratio,
        schedule=grpo.lr_schedule,
        end_lr_ratio=grpo.end_lr_ratio,
    )
    optimizer = make_optimizer(
        schedule,
        num_train_steps,
        b1=grpo.b1,
        b2=grpo.b2,
        weight_decay=grpo.weight_decay,
        eps=grpo.adam_eps,
        mu_dtype=grpo.mu_dtype,
    )
    return optimizer, schedule


def learning_rate_at(schedule: optax.Schedule, step: int) -> float:
    """The learning rate the ``step``-th update (0-based) uses, as a Python float for logging."""
    return float(schedule(jnp.asarray(step, jnp.int32)))
