"""The GRPO optimizer: AdamW on a warmup + decay learning-rate schedule (the train step clips the gradients'
global norm before it, ``grpax.rl.train_step``).

As MaxText's RL optimizer (``utils_rl.get_optimizer``): linear warmup to the peak learning rate over
``warmup_ratio * num_train_steps`` steps, then a cosine decay to ``end_lr_ratio * peak`` at the last step. The
warmup's first update already moves the weights, as nanoGPT's and nanochat's do: update s < W runs at
``peak * (s + 1) / (W + 1)``, not MaxText's and Hugging Face's ``peak * s / W`` (0 at the first update), which
in a short run throws away a whole rollout: 6 steps at ratio 0.1 trained only 5 of their batches.
The schedule is always sized from the real number of optimizer steps of the run, which the caller must pass:
a schedule sized for a default length would decay too early or never.

Weight decay is applied to the weight matrices and embeddings only, chosen by name (``decays``): not to the
RMSNorm scales (the per-layer ``[L, D]`` stacks of ``scan_layers`` included), Qwen's and Gemma's q/k norms or
the q/k/v biases, as Hugging Face's ``Trainer`` and TRL exclude biases and norm weights (decaying a norm scale
toward 0 shrinks the activations it scales). MaxText decays every leaf.

Params stored in a 16-bit ``weight_dtype`` are trained through a float32 master copy kept in the optimizer
state (``with_master_weights``; mixed-precision training, Micikevicius et al. 2018): AdamW updates the master
and the params are its rounding, so no update is lost to bfloat16's 8-bit mantissa (at lr 3e-6 one AdamW
step changed 0.57% of SmolLM2's bfloat16 weights without it, and weight decay never applied).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpax.rl.config import LR_SCHEDULES


def num_warmup_steps(num_train_steps: int, warmup_ratio: float = 0.0, warmup_steps: int | None = None) -> int:
    """Warmup length in steps: ``warmup_steps`` when given, else ``ceil(warmup_ratio * num_train_steps)``.

    Rounded up as Hugging Face's ``TrainingArguments.get_warmup_steps`` does: 9 steps at ratio 0.1 warm up
    for 1 step, not 0 (the product is first rounded to 12 digits, so 0.1 * 30 = 3.0000000000000004 gives 3).
    A ratio's warmup leaves at least one step after it (a 1-step run has none), so that some update runs at
    a non-zero learning rate.
    """
    if warmup_steps is not None:
        return int(warmup_steps)
    return min(math.ceil(round(warmup_ratio * num_train_steps, 12)), max(num_train_steps - 1, 0))


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
      An optax schedule: lr(s) = eta * (s + 1) / (W + 1) for the warmup's updates s < W (never 0: each update
      of the run moves the weights), lr(W) = eta, lr(num_train_steps) = end_lr_ratio * eta for the decaying
      schedules.

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
    start = learning_rate / (warmup + 1)  # the first warmup update's: eta (s + 1) / (W + 1) at s = 0
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            start, learning_rate, warmup, num_train_steps, end_value=end
        )
    decay_steps = num_train_steps - warmup
    if schedule == "linear":
        after = optax.linear_schedule(learning_rate, end, decay_steps)
    else:
        after = optax.constant_schedule(learning_rate)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(start, learning_rate, warmup), after], [warmup])


# The params leaves that weight decay applies to (``grpax.models.params``' names): the matrices and embeddings.
# Norm scales (attn_norm, mlp_norm, final_norm, q_norm, k_norm, *_post_norm) and biases (q/k/v_bias) are not.
DECAYED_WEIGHTS = frozenset({"embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})


def decays(path) -> bool:
    """Whether weight decay applies to the leaf at ``path`` (a ``jax.tree_util`` key path): by its name."""
    names = [getattr(k, "key", None) for k in path]
    return any(name in DECAYED_WEIGHTS for name in names if isinstance(name, str))


def _decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


class MasterWeightsState(NamedTuple):
    """``with_master_weights``' state: the float32 master copy of the params and the inner optimizer's state."""

    master: Any
    inner: Any


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run on a float32 master copy of the params, kept in the optimizer state.

    The gradients are cast to float32, ``inner`` updates the master (its moments, weight decay and step all
    float32), and ``apply_updates`` makes the params the master rounded to their own dtype. Costs 4 bytes per
    parameter beside the 16-bit params (docs/algorithm.md, "Dtypes").
    """

    def init(params):
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return MasterWeightsState(master, inner.init(master))

    def update(grads, state, params=None):
        del params  # the master is what the inner optimizer sees
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        return updates, MasterWeightsState(optax.apply_updates(state.master, updates), inner_state)

    return optax.GradientTransformation(init, update)


def apply_updates(params, updates, opt_state):
    """The params after an optimizer step: the master rounded to the params' dtypes (``with_master_weights``),
    else ``optax.apply_updates``."""
    if isinstance(opt_state, MasterWeightsState):
        return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params)
    return optax.apply_updates(params, updates)


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
    master_weights: bool = False,
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
      weight_decay: decoupled weight decay, applied to the matrices and embeddings (``decays``).
      mu_dtype: the dtype m is stored in ('' = the params'); each update computes in float32 (optax).
      master_weights: keep a float32 master copy in the state (``with_master_weights``): for params stored
        in bfloat16 or float16.

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
    adamw = optax.adamw(
        lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_decay_mask, mu_dtype=mu_dtype or None
    )
    return with_master_weights(adamw) if master_weights else adamw


def optimizer_from_config(
    grpo, num_train_steps: int, weight_dtype: str = "float32"
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, lr schedule) from a ``GRPOConfig``, the run's number of optimizer updates and the params'
    dtype (a 16-bit ``weight_dtype`` trains through a float32 master copy: ``with_master_weights``)."""
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
        master_weights=jnp.dtype(weight_dtype) != jnp.float32,
    )
    return optimizer, schedule


def learning_rate_at(schedule: optax.Schedule, step: int) -> float:
    """The learning rate the ``step``-th update (0-based) uses, as a Python float for logging."""
    return float(schedule(jnp.asarray(step, jnp.int32)))
