"""The jitted GRPO update: micro-batched forward/backward, gradient accumulation, a guarded optimizer step.

One call of the step function makes one optimizer update from a batch of B = num_prompts * G completions:

1. the batch is split into ``num_micro_batches`` micro-batches of whole prompts with their completions, scanned
   with ``lax.scan``;
2. for each, the policy runs each prompt once and its G completions on top of it (``forward_grouped``), and
   only the hidden states that predict completion tokens are projected to the vocabulary, in chunks
   (``completion_logprobs``);
3. each micro-batch loss is normalised by the FULL batch's normaliser (``losses.loss_normalizer``), so the
   summed gradients equal the full-batch gradient for every ``loss_agg_mode``;
4. the gradients are summed in float32 whatever the params' dtype, clipped, and given to the optimizer (a
   float32 master copy in its state for 16-bit params, ``grpax.rl.optim.with_master_weights``);
5. a non-finite loss or gradient skips the update: params, optimizer state and step stay as they were and
   ``metrics["nonfinite"]`` is True; an update that makes a weight non-finite sets
   ``metrics["nonfinite_params"]``: the caller must stop without saving that state and keep its last good
   checkpoint.

The batch is a ``grpax.rl.batch.Batch`` (or a dict of its fields): one prompt row per group, one completion
row per sample; its fields, shapes and dtypes are listed there. ``old_logprobs`` None is on-policy
(num_iterations == 1: the ratio is exp(logp - stop_gradient(logp)) = 1); ``rollout_logprobs`` (the sampler's)
are read only by the mismatch metrics; ``truncated`` is needed with ``mask_truncated_completions``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpax import distributed
from grpax.models import lora as lora_lib
from grpax.models import moe
from grpax.models.llama import forward_grouped, logits_from_hidden
from grpax.models.registry import ModelConfig
from grpax.models.sharding_rules import constrain, logical_to_spec
from grpax.rl.batch import TOKEN_FIELDS, Batch
from grpax.rl.config import GRPOConfig
from grpax.rl.losses import (
    apply_truncation_mask,
    loss_normalizer,
    policy_loss,
)
from grpax.rl.optim import apply_updates, optimizer_from_config

# Metrics averaged over tokens (weighted by each micro-batch's token count when accumulating).
_MAX_METRICS = ("mismatch/logprob_diff_max", "mismatch/is_ratio_max")
_MIN_METRICS = ("mismatch/is_ratio_min",)
_TOKEN_MEAN_METRICS = (
    "kl",
    "ratio_mean",
    "clip_low_frac",
    "clip_high_frac",
    "clip_region_frac",
    "entropy",
    "mismatch/kl",
    "mismatch/logprob_diff_mean",
    "mismatch/is_ratio_mean",
    "mismatch/is_truncated_frac",
    "mismatch/is_masked_frac",
    "distill/reverse_kl",
    "distill/teacher_logprob",
)


@flax.struct.dataclass
class TrainState:
    """What the update changes: params, optax state, and the number of applied updates (int32 scalar)."""

    params: Any
    opt_state: Any
    step: jax.Array


def completion_hidden(params, batch: Batch, cfg: ModelConfig, replay: bool = False):
    """The hidden states [B, C, D] that predict each completion token, each prompt run once (``forward_grouped``),
    and a mixture of experts' routing of the prompts and the completions (``moe.Routing`` pair; None for a dense
    model). ``replay``: route by the batch's recorded routing (``router_replay=replay``) where it has one."""
    routes = None
    if replay and batch.routed_experts is not None:
        routes = (batch.prompt_routed_experts, batch.routed_experts)
    return forward_grouped(
        params,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        cfg,
        routes=routes,
        return_routes=True,
    )


def router_disagreement(routing: tuple, batch: Batch) -> dict[str, jax.Array]:
    """Per layer, how many of the trainer's own top-k expert choices the sampler did not make, over the tokens
    whose routing reaches a counted logprob: the real prompt tokens and each completion token before a row's
    last counted one (the last is never an input).

    Args:
      routing: ``completion_hidden``'s (prompt, completion) ``moe.Routing`` (the trainer's own top-k, also
        when it routed by the batch's).
      batch: with ``prompt_routed_experts`` [P, Lp, L, k] and ``routed_experts`` [B, C, L, k] (the sampler's).

    Returns:
      ``router/disagreement_sum`` float32 [L] (each token's share of its k choices that differ, summed) and
      ``router/decisions`` float32 [L] (the tokens counted): summed over micro-batches, their ratio is the
      fraction of router decisions that disagree (``accumulate_gradients`` reports its mean and max over layers).
    """
    mask = batch.completion_mask.astype(jnp.int32)
    later = jnp.flip(jnp.cumsum(jnp.flip(mask[:, 1:], axis=1), axis=1), axis=1) > 0  # a counted token follows
    valid_c = jnp.pad(later, ((0, 0), (0, 1)))
    sums, counts = [], []
    pairs = (
        (routing[0].experts, batch.prompt_routed_experts, batch.prompt_mask > 0),
        (routing[1].experts, batch.routed_experts, valid_c),
    )
    for own, recorded, valid in pairs:
        own, recorded = own.astype(jnp.int32), recorded.astype(jnp.int32)
        kept = jnp.any(own[..., :, None] == recorded[..., None, :], axis=-1)  # [.., L, k]
        miss = 1.0 - jnp.mean(kept.astype(jnp.float32), axis=-1)  # [rows, T, L]
        sums.append(jnp.einsum("RTL,RT->L", miss, valid.astype(jnp.float32)))
        counts.append(jnp.sum(valid.astype(jnp.float32)) * jnp.ones_like(sums[-1]))
    return {"router/disagreement_sum": sums[0] + sums[1], "router/decisions": counts[0] + counts[1]}


def _routing_aux(routing, mb: Batch, grpo: GRPOConfig, num_micro_batches: int) -> tuple[jax.Array, dict]:
    """A mixture of experts' additions to a micro-batch's loss and metrics: the load-balancing loss times
    ``load_balance_loss_weight`` (divided by the micro-batches: their sum is the mean) and, where the batch has
    the sampler's routing, ``router_disagreement``."""
    loss, aux = jnp.float32(0.0), {}
    if routing is None:
        return loss, aux
    if grpo.load_balance_loss_weight > 0:
        both = jax.tree.map(jnp.add, *(r._replace(experts=jnp.zeros(())) for r in routing))
        balance = moe.load_balancing_loss(both) / num_micro_batches
        loss, aux["load_balance_loss"] = grpo.load_balance_loss_weight * balance, balance
    if mb.routed_experts is not None:
        aux.update(router_disagreement(routing, mb))
    return loss, aux


# Logits elements per chip in one chunk of ``completion_logprobs`` (64 MiB in float32): the [B, C, V] logits of
# a micro-batch are never materialised at once (SmolLM2 at B = 16, C = 256: 805 MB, with their softmax and
# gradient several times that), and a chunk still holds a thousand tokens or more on each chip (llama3.2-1b on
# v6e-8 at B = 16, C = 256: 4 chunks of 16 x 64 tokens, each chip a 16,032-entry slice of the vocabulary).
LOGITS_CHUNK_ELEMENTS = 2**24
# ... but on an accelerator at least this many tokens per chip in a chunk, whatever the vocabulary: every chunk
# reads the float32 head three times (projection, its recompute, the hidden states' gradient) and reads and writes
# its float32 gradient, 20 bytes per head entry, against 8 FLOPs per entry per token; below ~600 tokens a chunk is
# bound by those bytes on a TPU v5e (197 TFLOP/s over 819 GB/s). With the element budget alone a large vocabulary
# on one chip made chunks of a few tokens per row: qwen3-0.6b (151,936 entries) at 64 rows cut 256 completion
# tokens into 256 chunks of one, 43% of its update in the head's gradient accumulation (docs/benchmarks.md, issue
# 54). A CPU (~10 FLOPs per byte) keeps the element budget alone: small chunks cost it nothing.
LOGITS_CHUNK_MIN_TOKENS = 512


def head_chunk_floor() -> int:
    """``LOGITS_CHUNK_MIN_TOKENS`` where the current mesh is on an accelerator (its abstract device's platform:
    a TPU topology's too, compiled from a CPU host), else 0 (a CPU's mesh, or none)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return LOGITS_CHUNK_MIN_TOKENS if getattr(device, "platform", "cpu") not in ("cpu", None) else 0


def logits_chunk(rows_per_chip: int, vocab_per_chip: int, length: int, min_tokens: int = 0) -> int:
    """Completion positions per chunk of ``completion_logprobs``: ``LOGITS_CHUNK_ELEMENTS`` logits per chip, at
    least ``min_tokens`` tokens per chip (``head_chunk_floor``), at most ``length`` (the chunks equal, padded the
    least)."""
    by_elements = LOGITS_CHUNK_ELEMENTS // (rows_per_chip * vocab_per_chip)
    by_tokens = -(-min_tokens // rows_per_chip)
    chunk = max(1, min(length, max(by_elements, by_tokens)))
    num_chunks = -(-length // chunk)
    return -(-length // num_chunks)


def logits_chunk_bytes(vocab_per_chip: int) -> int:
    """The most bytes of one chunk's float32 logits per chip on an accelerator (``logits_chunk``'s bound with
    ``LOGITS_CHUNK_MIN_TOKENS``), for the memory plan."""
    return 4 * max(LOGITS_CHUNK_ELEMENTS, LOGITS_CHUNK_MIN_TOKENS * vocab_per_chip)


def _mesh_ways(logical_axis: str, size: int) -> int:
    """Ways ``logical_axis`` splits a dimension of ``size`` on the current mesh (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    spec = logical_to_spec((logical_axis,), shape=(size,), mesh_shape=dict(mesh.shape))
    axes = spec[0] if spec else ()
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))


def _prompt_shards(batch: Batch, num_micro_batches: int) -> int:
    """Devices a micro-batch's rows are split over on the current mesh (``Batch.split`` spreads the prompts)."""
    rows = batch.completion_ids.shape[0] // num_micro_batches
    return _mesh_ways("batch", rows)


def completion_logprobs(
    params,
    hidden: jax.Array,
    tokens: jax.Array,
    cfg: ModelConfig,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probabilities of ``tokens`` under softmax(logits / temperature), the vocabulary projected in chunks.

    The head (``lm_head`` or the tied ``embed``) is split over the vocabulary on the ``tensor`` and ``fsdp``
    mesh axes ("vocab-parallel cross-entropy", Megatron-LM): once per pass its fsdp shards are exchanged
    (an all-to-all of one chip's shard, instead of gathering the whole head), and each chunk's hidden states
    are gathered over fsdp instead (tokens x D, a small fraction of the head's V x D). Each chip projects the
    chunk's tokens to its slice of the vocabulary; the log-normaliser, the chosen token's logit and the entropy
    are sums over the vocabulary, reduced across the slices ([tokens]-sized all-reduces). In the backward pass
    each chip's head gradient stays local: it is accumulated in float32 across the chunks (the scan's carry),
    exchanged back to the head's layout once, and no chunk reduce-scatters a head-sized gradient.

    The completion axis is cut into chunks (``logits_chunk``: at most ``LOGITS_CHUNK_ELEMENTS`` logits per chip,
    on an accelerator at least ``LOGITS_CHUNK_MIN_TOKENS`` tokens per chip, the larger where they disagree); each chunk
    is projected, reduced to its chosen-token log-probability (and entropy) and rematerialised in the backward
    pass (``jax.checkpoint``), so only one chunk's logits exist at a time, forward or backward ("fused linear
    cross-entropy", as Liger-Kernel's, in plain JAX). Outside a mesh the same code runs on one device.

    Args:
      params: the params (the head: ``lm_head`` or tied ``embed``).
      hidden: [B, C, D] final-normed hidden states (``completion_hidden``).
      tokens: int [B, C] the tokens they predict.
      cfg: model config.
      temperature: tau > 0.
      with_entropy: also return the entropy in nats of each position's distribution (no gradient).

    Returns:
      (logprobs float32 [B, C], entropy float32 [B, C] or None).
    """
    B, C, D = hidden.shape
    V = cfg.vocab_size
    rows_per_chip = -(-B // _mesh_ways("head_batch", B))
    vocab_per_chip = -(-V // _mesh_ways("head_vocab", V))
    chunk = logits_chunk(rows_per_chip, vocab_per_chip, C, head_chunk_floor())
    num_chunks = -(-C // chunk)
    pad = num_chunks * chunk - C
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, num_chunks, chunk, D).swapaxes(0, 1)
    t = jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, pad))).reshape(B, num_chunks, chunk).swapaxes(0, 1)
    # float32 whatever the params' dtype: the scan's transpose accumulates the head's gradient in this dtype
    if "lm_head" in params:
        head = {"lm_head": constrain(params["lm_head"].astype(jnp.float32), (None, "head_vocab"))}
    else:
        head = {"embed": constrain(params["embed"].astype(jnp.float32), ("head_vocab", None))}
    vocab = jnp.arange(V, dtype=jnp.int32)

    @jax.checkpoint
    def one(args):
        h, t = args
        h = constrain(h, ("head_batch", None, None))
        logits = logits_from_hidden(head, h, cfg) / temperature  # [B, chunk, V] float32
        logits = constrain(logits, ("head_batch", None, "head_vocab"))
        logz = jax.nn.logsumexp(logits, axis=-1)
        # a masked sum, not take_along_axis: a sum over the split vocabulary is a [B, chunk] all-reduce
        chosen = jnp.sum(jnp.where(vocab == t[..., None], logits, 0.0), axis=-1)
        logprobs = constrain(chosen - logz, ("batch", None))
        if not with_entropy:
            return logprobs, jnp.zeros_like(logprobs)
        z = jax.lax.stop_gradient(logits)
        probs = jnp.exp(z - jax.lax.stop_gradient(logz)[..., None])
        entropy = jax.lax.stop_gradient(logz) - jnp.sum(probs * z, axis=-1)  # H = log Z - E_p[z]
        return logprobs, constrain(entropy, ("batch", None))

    logprobs, entropy = jax.lax.map(one, (h, t))  # [num_chunks, B, chunk]
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, -1)[:, :C]  # noqa: E731
    return unchunk(logprobs), unchunk(entropy) if with_entropy else None


def _micro_loss(
    params,
    mb: Batch,
    normalizer: jax.Array,
    cfg: ModelConfig,
    grpo: GRPOConfig,
    max_completion_length: int,
    num_micro_batches: int = 1,
):
    hidden, routing = completion_hidden(params, mb, cfg, replay=grpo.router_replay == "replay")
    logprobs, entropy = completion_logprobs(
        params, hidden, mb.completion_ids, cfg, grpo.temperature, with_entropy=True
    )
    loss, aux = policy_loss(
        logprobs,
        mb.old_logprobs,
        mb.ref_logprobs,
        mb.advantages,
        mb.completion_mask,
        grpo,
        max_completion_length=max_completion_length,
        normalizer=normalizer,
        truncated=mb.truncated,
        rollout_logprobs=mb.rollout_logprobs,
        teacher_logprobs=mb.teacher_logprobs,
    )
    mask = mb.completion_mask.astype(jnp.float32)
    if grpo.mask_truncated_completions:
        mask = apply_truncation_mask(mask, mb.truncated)
    aux["entropy"] = jnp.sum(jnp.where(mask > 0, entropy, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)
    # pi_old: the trainer's logprobs at the params that sampled (the batch's, when the update runs later)
    old = jax.lax.stop_gradient(logprobs) if mb.old_logprobs is None else mb.old_logprobs
    aux.update(_mismatch(old, mb.rollout_logprobs, mask))
    extra, routing_aux = _routing_aux(routing, mb, grpo, num_micro_batches)
    aux.update(routing_aux)
    return loss + extra, aux


def _mismatch(
    old_logprobs: jax.Array, rollout_logprobs: jax.Array | None, mask: jax.Array
) -> dict[str, jax.Array]:
    """How far the sampler's logprobs (mu) are from the trainer's pi_old, over the counted tokens (``mask``
    [B, C]).

    pi_old is the trainer's own logprobs at the params that sampled: the batch's ``old_logprobs`` when the
    update runs at a later version (num_iterations > 1, max_staleness > 0), else this update's own (the same
    params). Both score the same params, so staleness never shows here: ~1e-5 nats in float32; bfloat16 compute,
    a top-k / top-p filter (the sampler reports the filtered distribution's logprobs) or a sampler that
    computes another distribution do. ``mismatch/kl`` is the k3 estimate of KL(mu || pi_old) from the sampler's
    own draws (Schulman 2020), the two others the mean and max |logprob difference|, as TRL and verl compare
    the old and the rollout logprobs.
    """
    if rollout_logprobs is None:
        zero = jnp.float32(0.0)
        return {"mismatch/kl": zero, "mismatch/logprob_diff_mean": zero, "mismatch/logprob_diff_max": zero}
    counted = mask > 0
    # log(pi_old / mu) of each counted token
    log_rho = jnp.where(counted, old_logprobs.astype(jnp.float32) - rollout_logprobs.astype(jnp.float32), 0.0)
    num = jnp.maximum(jnp.sum(mask), 1.0)
    k3 = jnp.expm1(jnp.clip(log_rho, -20.0, 20.0)) - log_rho
    return {
        "mismatch/kl": jnp.sum(jnp.where(counted, k3, 0.0)) / num,
        "mismatch/logprob_diff_mean": jnp.sum(jnp.abs(log_rho)) / num,
        "mismatch/logprob_diff_max": jnp.max(jnp.abs(log_rho)),
    }


def accumulate_gradients(
    params,
    batch: Batch | dict,
    cfg: ModelConfig,
    grpo: GRPOConfig,
    num_micro_batches: int = 1,
    lora: lora_lib.LoraConfig | None = None,
    base=None,
    max_completion_length: int | None = None,
):
    """Loss and gradient of the full batch, computed ``num_micro_batches`` row blocks at a time.

    Each micro-batch loss is divided by the full batch's normaliser, so the summed loss and gradients equal
    those of one pass over the whole batch (up to float summation order). Call inside ``jax.jit``.

    Args:
      params: policy params.
      batch: the train batch (``grpax.rl.batch.Batch``); None fields are absent.
      cfg: model config.
      grpo: algorithm config.
      num_micro_batches: M; B must be a multiple of M.
      lora: with LoRA, ``params`` are the adapters (``grpax.models.lora``) on the frozen ``base`` params: the
        policy is ``lora.apply(base, params)`` and the gradients are the adapters' only.
      base: the frozen base params (with ``lora``).
      max_completion_length: L_max of "sequence-mean-token-sum-norm" in tokens, the sampler's; None = the
        batch's C (a batch trimmed to its longest completion, ``Batch.trim_completions``, needs the real one).

    Returns:
      (loss float32 scalar, float32 grads like params, aux) where aux holds ``policy_loss`` and
      ``num_tokens`` (sums), ``mismatch/logprob_diff_max`` (max |logprobs - rollout_logprobs| over completion
      tokens) and the token-weighted means ``kl``, ``ratio_mean``, ``clip_*_frac``, ``entropy``,
      ``mismatch/kl`` and ``mismatch/logprob_diff_mean`` (``_mismatch``); with a teacher ``distill/reverse_kl``
      and ``distill/teacher_logprob``.

    Raises:
      ValueError: a missing batch key, or B not divisible by num_micro_batches.
    """
    batch = Batch.of(batch).device()
    batch.check(
        grpo.beta,
        grpo.mask_truncated_completions,
        grpo.rollout_is_mode is not None,
        grpo.distillation_coef > 0,
    )
    mask = batch.completion_mask.astype(jnp.float32)
    if grpo.mask_truncated_completions:
        mask = apply_truncation_mask(mask, batch.truncated)
    normalizer = loss_normalizer(mask, grpo.loss_agg_mode)
    L_max = max_completion_length or batch.completion_ids.shape[1]

    def loss_fn(trainable, mb):
        policy = trainable if lora is None else lora_lib.apply(base, trainable, lora)
        return _micro_loss(policy, mb, normalizer, cfg, grpo, L_max, num_micro_batches)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro_step(mb):
        (loss, aux), grads = grad_fn(params, mb)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # summed in float32 whatever the params'
        weights = {k: aux["num_tokens"] if k in _TOKEN_MEAN_METRICS else 1.0 for k in aux}
        return grads, loss, {k: aux[k] * weights[k] for k in aux}

    def body(carry, mb):
        grads_sum, loss_sum, aux_sum = carry
        grads, loss, aux = micro_step(mb)
        combine = {k: jnp.maximum for k in _MAX_METRICS} | {k: jnp.minimum for k in _MIN_METRICS}
        aux_sum = {k: combine.get(k, jnp.add)(aux_sum[k], aux[k]) for k in aux_sum}
        return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss, aux_sum), None

    # The first micro-batch starts the sums (no zero-filled gradient tree); one micro-batch needs no loop.
    blocks = batch.split(num_micro_batches, _prompt_shards(batch, num_micro_batches))
    carry = micro_step(jax.tree.map(lambda x: x[0], blocks))
    if num_micro_batches > 1:
        carry, _ = jax.lax.scan(body, carry, jax.tree.map(lambda x: x[1:], blocks))
    grads, loss, aux = carry
    num_tokens = aux["num_tokens"]
    aux = {k: (aux[k] / jnp.maximum(num_tokens, 1.0) if k in _TOKEN_MEAN_METRICS else aux[k]) for k in aux}
    if "router/decisions" in aux:  # per layer [L]: the fraction of router decisions that disagree
        share = aux.pop("router/disagreement_sum") / jnp.maximum(aux.pop("router/decisions"), 1.0)
        aux.update({"router/disagreement_mean": jnp.mean(share), "router/disagreement_max": jnp.max(share)})
    # The ratio's extremes over no token at all (every row masked) are +-inf: report the on-policy 1.
    aux.update(
        {
            k: jnp.where(num_tokens > 0, aux[k], 1.0)
            for k in ("mismatch/is_ratio_min", "mismatch/is_ratio_max")
            if k in aux
        }
    )
    return loss, grads, aux


def make_train_step(
    cfg: ModelConfig,
    grpo: GRPOConfig,
    optimizer: optax.GradientTransformation,
    num_micro_batches: int | None = None,
    lr_schedule: optax.Schedule | None = None,
    lora: lora_lib.LoraConfig | None = None,
    base=None,
    max_completion_length: int | None = None,
    compiler_options: tuple[tuple[str, Any], ...] = (),
):
    """Builds the jitted update ``step(state, batch) -> (state, metrics)``; ``state`` is donated.

    The step: gradients of the GRPO loss, their global norm clipped, then the optimizer; a non-finite loss or
    gradient norm skips the update (state unchanged, ``nonfinite`` True); non-finite weights after the update
    set ``nonfinite_params`` (the returned state must then be dropped, never saved).

    Args:
      cfg: the policy's model config.
      grpo: algorithm config (epsilon, beta, kl_estimator, loss_agg_mode, temperature, ...).
      optimizer: from ``grpax.rl.optim.make_optimizer`` (AdamW); the step clips the gradients' global norm to
        ``grpo.max_grad_norm`` (0: no clipping) before it with ``optax.clip_by_global_norm``.
      num_micro_batches: micro-batches per update (default ``grpo.num_micro_batches``); B must divide.
      lr_schedule: the optimizer's schedule, only to report ``learning_rate`` (NaN without it).
      lora, base: LoRA: ``state.params`` are the adapters, trained on the frozen ``base`` params (passed to
        each call, never donated or copied; ``accumulate_gradients``).
      max_completion_length: L_max in tokens ("sequence-mean-token-sum-norm"); None = each batch's C. The
        trainer passes its own: its batches are trimmed to their longest completion's bucket.
      compiler_options: XLA's options of this program (``TrainConfig.training_compile_options``); () = the
        compiler's defaults.

    Returns:
      A jitted function. Its metrics are float32 scalars: ``loss``, ``policy_loss``, ``kl`` (NaN without
      ref_logprobs), ``ratio_mean``, ``clip_low_frac``, ``clip_high_frac``, ``clip_region_frac``, ``entropy``
      (mean policy entropy in nats over completion tokens), ``grad_norm`` (before clipping), ``learning_rate``
      (of this update), ``num_tokens``; and the bools ``nonfinite`` (the update was skipped) and
      ``nonfinite_params`` (the updated weights hold NaN/inf).

    Raises:
      ValueError (at the first call): a missing batch key, or B not divisible by num_micro_batches.
    """
    M = grpo.num_micro_batches if num_micro_batches is None else num_micro_batches

    def step(state: TrainState, batch: Batch, base=None):
        loss, grads, metrics = accumulate_gradients(
            state.params, batch, cfg, grpo, M, lora, base, max_completion_length
        )
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if grpo.max_grad_norm > 0:  # outside the branch: the clipped gradients overwrite the raw ones
            grads, _ = optax.clip_by_global_norm(grpo.max_grad_norm).update(grads, optax.EmptyState())

        def update(params, opt_state):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return apply_updates(params, updates, opt_state), opt_state

        # A branch, not a select of new and old values: the update runs in place on the donated state (a
        # select kept both copies alive, one more params-sized tree of temporaries per optimizer leaf).
        params, opt_state = jax.lax.cond(ok, update, lambda *state: state, state.params, state.opt_state)
        # Finite gradients can still give non-finite weights (an overflow in a 16-bit dtype): such a state is
        # flagged, never kept. The check reads the params once; undoing the update would need a second copy.
        finite_params = jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))
        new_state = TrainState(params=params, opt_state=opt_state, step=state.step + ok.astype(jnp.int32))
        lr = lr_schedule(state.step) if lr_schedule is not None else jnp.nan
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            learning_rate=jnp.asarray(lr, jnp.float32),
            nonfinite=~ok,
            nonfinite_params=~finite_params,
        )
        return new_state, metrics

    jitted = jax.jit(step, donate_argnums=(0,), compiler_options=dict(compiler_options) or None)
    return jitted if lora is None else functools.partial(jitted, base=base)


def make_run_update(
    grpo: GRPOConfig,
    cfg: ModelConfig,
    num_batches: int,
    num_micro_batches: int,
    max_completion_length: int,
    lora: lora_lib.LoraConfig | None = None,
    base=None,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> tuple[optax.GradientTransformation, optax.Schedule, Any]:
    """A run's optimizer, its learning-rate schedule and its jitted update: the one builder the trainer and the
    compile check (``compile_topology``, ``check_fit``) share, so the planner compiles the run's own program.

    Args:
      grpo: the algorithm and optimizer keys.
      cfg: the policy's model config (``weight_dtype``: a 16-bit one trains through float32 master weights).
      num_batches: training steps; the schedule spans ``grpo.schedule_steps(num_batches)`` optimizer updates
        (``num_batches * grpo.num_iterations`` unless ``learning_rate_schedule_steps`` is set).
      num_micro_batches: micro-batches of the update (``TrainConfig.micro_batches``).
      max_completion_length: L_max in tokens (the sampler's; the batches are trimmed below it).
      lora, base: LoRA: the adapters' config and the frozen base (float32 adapters are what the optimizer
        trains); None = a full fine-tune.
      compiler_options: the update's XLA options (``TrainConfig.training_compile_options``).

    Returns:
      (optimizer, lr schedule, ``make_train_step``'s jitted step).
    """
    keys = (grpo, cfg, num_batches, num_micro_batches, max_completion_length, lora, tuple(compiler_options))
    optimizer, lr_schedule, step = _run_update(*keys)
    return optimizer, lr_schedule, step if lora is None else functools.partial(step, base=base)


@functools.lru_cache(maxsize=4)
def _run_update(grpo, cfg, num_batches, num_micro_batches, max_completion_length, lora, compiler_options):
    """``make_run_update``'s optimizer, schedule and jitted step (LoRA: the base an argument), once per process
    and equal keys: the fit check (``grpax.plan.compile_check``) and the trainer get the same jitted function, so
    the run calls the executable the check compiled (JAX's in-memory caches), with no new trace, lowering or
    read of the persistent cache. Four kept: a process that builds several runs' updates (tests) keeps only the
    latest executables."""
    optimizer, lr_schedule = optimizer_from_config(
        grpo, grpo.schedule_steps(num_batches), "float32" if lora is not None else cfg.weight_dtype
    )
    step = make_train_step(
        cfg,
        grpo,
        optimizer,
        num_micro_batches,
        lr_schedule,
        lora=lora,
        max_completion_length=max_completion_length,
        compiler_options=compiler_options,
    )
    return optimizer, lr_schedule, step if lora is None else step.func


def make_update(train_step, num_iterations: int):
    """``update(state, batch) -> (state, metrics)``: ``num_iterations`` calls of ``train_step`` on one batch.

    The metrics are the last update's, except ``mismatch/*`` (the first update's: the params that sampled;
    later ones moved them) and ``nonfinite`` / ``nonfinite_params`` (True if any update's was), fetched to the
    host as numpy scalars (``distributed.fetch``: with several processes they span other hosts' devices).
    """

    def update(state: TrainState, batch: Batch):
        batch = Batch.of(batch).device()
        updates = []
        for _ in range(num_iterations):
            state, metrics = train_step(state, batch)
            updates.append(metrics)
        metrics = {**updates[-1], **{k: v for k, v in updates[0].items() if k.startswith("mismatch/")}}
        flags = ("nonfinite", "nonfinite_params")
        metrics, fetched = distributed.fetch((metrics, [[u[f] for f in flags] for u in updates]))
        for i, flag in enumerate(flags):  # on the host: an eager jnp.any compiles two small programs
            metrics[flag] = np.any([u[i] for u in fetched])
        return state, metrics

    return update


def compute_logprobs(
    params,
    batch: Batch | dict,
    cfg: ModelConfig,
    temperature: float,
    num_micro_batches: int = 1,
    replay: bool = False,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> jax.Array:
    """Per-token log-probabilities of the completion tokens under ``params``: float32 [B, C], 0 at padding.

    Used for the frozen reference model (``ref_logprobs``) and, when num_iterations > 1, for the sampling
    policy's ``old_logprobs`` before the first update. Needs prompt_ids, prompt_mask (one row per prompt),
    completion_ids, completion_mask (``grpax.rl.batch``); the batch is processed in ``num_micro_batches`` blocks
    (``Batch.split``) to bound memory. ``replay``: a mixture of experts routes by the batch's recorded routing
    (``router_replay=replay``), where it has one. ``compiler_options``: the program's XLA options
    (``logprobs_program``).
    """
    batch = Batch.of(
        {k: v for k, v in batch.items() if k in TOKEN_FIELDS} if isinstance(batch, dict) else batch
    )
    program = logprobs_program(compiler_options)
    return program(params, batch.tokens(routes=replay), cfg, temperature, num_micro_batches)


_LOGPROBS_STATIC = ("cfg", "temperature", "num_micro_batches")


@functools.partial(jax.jit, static_argnames=_LOGPROBS_STATIC)
def token_logprobs(
    params, batch: Batch, cfg: ModelConfig, temperature: float, num_micro_batches: int
) -> jax.Array:
    """``compute_logprobs`` of a ``Batch.tokens()`` batch, jitted with the compiler's defaults (``compile_topology``
    lowers this one, or ``logprobs_program``'s)."""

    def one(mb):
        hidden, _ = completion_hidden(
            params, mb, cfg, replay=True
        )  # the batch's routes where it carries them
        logprobs, _ = completion_logprobs(params, hidden, mb.completion_ids, cfg, temperature)
        return jnp.where(mb.completion_mask.astype(bool), logprobs, 0.0)

    out = jax.lax.map(
        one, batch.split(num_micro_batches, _prompt_shards(batch, num_micro_batches))
    )  # [M, B / M, C]
    return out.reshape(-1, out.shape[-1])


@functools.cache
def logprobs_program(compiler_options: tuple[tuple[str, Any], ...] = ()):
    """The jitted logprob pass compiled with XLA's ``compiler_options`` (``TrainConfig.training_compile_options``;
    () = ``token_logprobs``, the compiler's defaults): one program per options, reused by every call."""
    if not compiler_options:
        return token_logprobs
    return jax.jit(
        token_logprobs.__wrapped__, static_argnames=_LOGPROBS_STATIC, compiler_options=dict(compiler_options)
    )
