"""The jitted GRPO update: micro-batched forward/backward, gradient accumulation, a guarded optimizer step.

One call of the step function makes one optimizer update from a batch of B = num_prompts * G completions:

1. the batch rows are split into ``num_micro_batches`` contiguous micro-batches, scanned with ``lax.scan``;
2. for each, the policy runs on concat(prompt, completion) and only the completion's hidden states are projected
   to vocabulary logits (the logits of completion token t come from position P - 1 + t);
3. each micro-batch loss is normalised by the FULL batch's normaliser (``losses.loss_normalizer``), so the
   summed gradients equal the full-batch gradient for every ``loss_agg_mode``;
4. a non-finite loss or gradient skips the update: params, optimizer state and step stay as they were and
   ``metrics["nonfinite"]`` is True, so the caller can stop and keep its last good checkpoint.

The batch is a dict of arrays (numpy or jax):
  prompt_ids int32 [B, P] left-padded, prompt_mask [B, P] (1 = real), completion_ids int32 [B, C],
  completion_mask [B, C] (1 = real, EOS included), advantages float32 [B], old_logprobs float32 [B, C] or None
  (on-policy, num_iterations == 1), ref_logprobs float32 [B, C] or None (required when beta > 0), and
  truncated bool [B] when ``mask_truncated_completions`` is on.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from grpax.models.llama import default_positions, forward, logits_from_hidden
from grpax.models.registry import ModelConfig
from grpax.rl.config import GRPOConfig
from grpax.rl.losses import (
    apply_truncation_mask,
    loss_normalizer,
    per_token_logprobs,
    policy_loss,
    token_entropy,
)

# Metrics averaged over tokens (weighted by each micro-batch's token count when accumulating).
_MAX_METRICS = ("logprob_diff_max",)
_TOKEN_MEAN_METRICS = ("kl", "ratio_mean", "clip_low_frac", "clip_high_frac", "clip_region_frac", "entropy")


@flax.struct.dataclass
class TrainState:
    """What the update changes: params, optax state, and the number of applied updates (int32 scalar)."""

    params: Any
    opt_state: Any
    step: jax.Array


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh TrainState at step 0."""
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def completion_logits(params, batch: dict, cfg: ModelConfig, temperature: float) -> jax.Array:
    """Logits / temperature for each completion token: float32 [B, C, V].

    Runs the model on concat(prompt_ids, completion_ids) with attention_mask = concat(prompt_mask,
    completion_mask) and per-row positions (``default_positions``), and projects to the vocabulary only the
    hidden states at positions P - 1 .. P + C - 2, the ones that predict the completion tokens.
    """
    P = batch["prompt_ids"].shape[1]
    C = batch["completion_ids"].shape[1]
    tokens = jnp.concatenate([batch["prompt_ids"], batch["completion_ids"]], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([batch["prompt_mask"], batch["completion_mask"]], axis=1).astype(jnp.int32)
    hidden, _ = forward(
        params,
        tokens,
        cfg,
        positions=default_positions(tokens, mask),
        attention_mask=mask,
        return_hidden=True,
    )
    hidden = hidden[:, P - 1 : P - 1 + C]  # [B, C, D]
    return logits_from_hidden(params, hidden, cfg) / temperature


def _split(tree, num_micro_batches: int):
    """[B, ...] leaves -> [M, B / M, ...] (contiguous row blocks); None leaves stay None."""

    def split(x):
        if x.shape[0] % num_micro_batches:
            raise ValueError(
                f"batch of {x.shape[0]} rows is not divisible by num_micro_batches={num_micro_batches}"
            )
        return x.reshape(num_micro_batches, x.shape[0] // num_micro_batches, *x.shape[1:])

    return jax.tree.map(split, tree)


def _check_batch(batch: dict, grpo: GRPOConfig) -> None:
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
        if batch.get(key) is None:
            raise ValueError(f"the train batch has no '{key}'")
    if grpo.beta > 0 and batch.get("ref_logprobs") is None:
        raise ValueError(f"beta={grpo.beta} needs batch['ref_logprobs'] (from the frozen reference model)")
    if grpo.mask_truncated_completions and batch.get("truncated") is None:
        raise ValueError("mask_truncated_completions=True needs batch['truncated'] bool [B]")


def _micro_loss(params, mb: dict, normalizer: jax.Array, cfg: ModelConfig, grpo: GRPOConfig):
    logits = completion_logits(params, mb, cfg, grpo.temperature)
    logprobs = per_token_logprobs(logits, mb["completion_ids"])
    loss, aux = policy_loss(
        logprobs,
        mb.get("old_logprobs"),
        mb.get("ref_logprobs"),
        mb["advantages"],
        mb["completion_mask"],
        epsilon=grpo.epsilon,
        epsilon_high=grpo.epsilon_high,
        beta=grpo.beta,
        kl_estimator=grpo.kl_estimator,
        loss_agg_mode=grpo.loss_agg_mode,
        importance_sampling_level=grpo.importance_sampling_level,
        max_completion_length=mb["completion_ids"].shape[1],
        normalizer=normalizer,
        truncated=mb.get("truncated"),
        mask_truncated_completions=grpo.mask_truncated_completions,
    )
    mask = mb["completion_mask"].astype(jnp.float32)
    if grpo.mask_truncated_completions:
        mask = apply_truncation_mask(mask, mb["truncated"])
    entropy = token_entropy(jax.lax.stop_gradient(logits))
    aux["entropy"] = jnp.sum(jnp.where(mask > 0, entropy, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)
    # How far the sampler's logprobs are from the trainer's for the same params (num_iterations = 1): ~0 in
    # float32; a large value means the sampler and the trainer compute different distributions.
    old = mb.get("old_logprobs")
    diff = jnp.abs(jax.lax.stop_gradient(logprobs) - old) if old is not None else jnp.zeros_like(logprobs)
    aux["logprob_diff_max"] = jnp.max(jnp.where(mask > 0, diff, 0.0))
    return loss, aux


def accumulate_gradients(params, batch: dict, cfg: ModelConfig, grpo: GRPOConfig, num_micro_batches: int = 1):
    """Loss and gradient of the full batch, computed ``num_micro_batches`` row blocks at a time.

    Each micro-batch loss is divided by the full batch's normaliser, so the summed loss and gradients equal
    those of one pass over the whole batch (up to float summation order). Call inside ``jax.jit``.

    Args:
      params: policy params.
      batch: the train batch (module docstring); None entries are ignored.
      cfg: model config.
      grpo: algorithm config.
      num_micro_batches: M; B must be a multiple of M.

    Returns:
      (loss float32 scalar, grads like params, aux) where aux holds ``policy_loss`` and ``num_tokens`` (sums),
      ``logprob_diff_max`` (max |logprobs - old_logprobs| over completion tokens)
      and the token-weighted means ``kl``, ``ratio_mean``, ``clip_*_frac``, ``entropy``.

    Raises:
      ValueError: a missing batch key, or B not divisible by num_micro_batches.
    """
    _check_batch(batch, grpo)
    batch = {k: v for k, v in batch.items() if v is not None}
    mask = batch["completion_mask"].astype(jnp.float32)
    if grpo.mask_truncated_completions:
        mask = apply_truncation_mask(mask, batch["truncated"])
    normalizer = loss_normalizer(mask, grpo.loss_agg_mode)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def body(carry, mb):
        grads_sum, loss_sum, aux_sum = carry
        (loss, aux), grads = grad_fn(params, mb, normalizer, cfg, grpo)
        n = aux["num_tokens"]
        aux_sum = {
            k: jnp.maximum(aux_sum[k], aux[k])
            if k in _MAX_METRICS
            else aux_sum[k] + (aux[k] * n if k in _TOKEN_MEAN_METRICS else aux[k])
            for k in aux_sum
        }
        return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss, aux_sum), None

    keys = (*_TOKEN_MEAN_METRICS, *_MAX_METRICS, "policy_loss", "num_tokens")
    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros((), jnp.float32),
        {k: jnp.zeros((), jnp.float32) for k in keys},
    )
    (grads, loss, aux), _ = jax.lax.scan(body, init, _split(batch, num_micro_batches))
    num_tokens = aux["num_tokens"]
    aux = {k: (aux[k] / jnp.maximum(num_tokens, 1.0) if k in _TOKEN_MEAN_METRICS else aux[k]) for k in aux}
    return loss, grads, aux


def make_train_step(
    cfg: ModelConfig,
    grpo: GRPOConfig,
    optimizer: optax.GradientTransformation,
    num_micro_batches: int | None = None,
    lr_schedule: optax.Schedule | None = None,
):
    """Builds the jitted update ``step(state, batch) -> (state, metrics)``; ``state`` is donated.

    Args:
      cfg: the policy's model config.
      grpo: algorithm config (epsilon, beta, kl_estimator, loss_agg_mode, temperature, ...).
      optimizer: from ``grpax.rl.optim.make_optimizer``.
      num_micro_batches: micro-batches per update (default ``grpo.num_micro_batches``); B must divide.
      lr_schedule: the optimizer's schedule, only to report ``learning_rate`` (NaN without it).

    Returns:
      A jitted function. Its metrics are float32 scalars: ``loss``, ``policy_loss``, ``kl`` (NaN without
      ref_logprobs), ``ratio_mean``, ``clip_low_frac``, ``clip_high_frac``, ``clip_region_frac``, ``entropy``
      (mean policy entropy in nats over completion tokens), ``grad_norm`` (before clipping), ``learning_rate``
      (of this update), ``num_tokens``; and ``nonfinite`` (bool: the update was skipped).

    Raises:
      ValueError (at the first call): a missing batch key, or B not divisible by num_micro_batches.
    """
    M = grpo.num_micro_batches if num_micro_batches is None else num_micro_batches

    def step(state: TrainState, batch: dict):
        loss, grads, metrics = accumulate_gradients(state.params, batch, cfg, grpo, M)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
        new_state = TrainState(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt_state, state.opt_state),
            step=state.step + ok.astype(jnp.int32),
        )
        lr = lr_schedule(state.step) if lr_schedule is not None else jnp.nan
        metrics.update(
            loss=loss, grad_norm=grad_norm, learning_rate=jnp.asarray(lr, jnp.float32), nonfinite=~ok
        )
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,))


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "num_micro_batches"))
def compute_logprobs(
    params, batch: dict, cfg: ModelConfig, temperature: float, num_micro_batches: int = 1
) -> jax.Array:
    """Per-token log-probabilities of the completion tokens under ``params``: float32 [B, C], 0 at padding.

    Used for the frozen reference model (``ref_logprobs``) and, when num_iterations > 1, for the sampling
    policy's ``old_logprobs`` before the first update. Needs prompt_ids, prompt_mask, completion_ids,
    completion_mask; rows are processed ``num_micro_batches`` blocks at a time to bound the [b, C, V] logits.
    """
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    inputs = {k: batch[k] for k in keys}

    def one(mb):
        logits = completion_logits(params, mb, cfg, temperature)
        logprobs = per_token_logprobs(logits, mb["completion_ids"])
        return jnp.where(mb["completion_mask"].astype(bool), logprobs, 0.0)

    out = jax.lax.map(one, _split(inputs, num_micro_batches))  # [M, B / M, C]
    return out.reshape(-1, out.shape[-1])
