"""The rollout engine: batched prefill + KV-cache decode, the whole decode loop inside ``jax.jit``.

GRPO spends most of its wall time sampling, so the loop never returns to Python: prompts are prefilled into a
cache of ``P_bucket + C`` slots at most (slot == position, each row at its own length), then a
``lax.while_loop`` decodes one token per row per step and exits as soon as every row has emitted a stop
token. The decode runs in phases of ``decode_phase_length`` steps, each on a cache just long enough for it
(grown between phases), so attention work follows the filled length. Prefill and decode are two compiled
functions; the cache passes from one to the other and lives in the decode loop's carry, where XLA updates it
in place: one copy per phase, none per step (a donated input cannot help: XLA aliases donations only to
outputs of the same shape; on TPU the XLA backend's compiler options keep the TPU compiler from staging it
through on-chip memory and writing it back at every step, ``grpax.sampler.backend.XLA_TPU_OPTIONS``). The
decode runs its layers unrolled, with per-layer weight and cache buffers: scanning stacked layers copies each
layer's weights and cache slice every step. The prefill, one pass, scans stacked layers (one compiled layer:
the TPU compiler spent most of an hour on 70B's 80 unrolled ones) and cuts its cache into the decode's
per-layer buffers. Compiled functions are cached per shape (batch size, prompt bucket) and config: a new
prompt length inside the same bucket reuses the compiled decode.

Sliding-window layers (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``) keep the same full-length cache
and attend through a mask, ``position - slot < sliding_window``, in prefill and decode alike. A ring buffer of
``sliding_window`` slots would save memory only for rollouts longer than the window (4096 tokens for Gemma 2,
1024 for Gemma 3 4b/12b: longer than most GRPO completions), would need a second cache layout beside the global
layers' (Gemma keeps one global layer in 2 or 6) and its own slot bookkeeping in every backend; one layout with
slot == position keeps the decode loop, the phase growth and the per-row positions unchanged.
The logits sampled from are ``grpax.models.llama.logits_from_hidden``'s, soft-capped where the model caps them
(Gemma 2), the same function the trainer scores with.

Who runs the model's prefill and decode step is one choice per call, ``SamplerConfig.backend``, made by
``grpax.sampler.backend.select_backend``; the algorithm here is the same whichever backend runs the block.

Finished rows are retired between phases (``retire_rows``): the host reads which rows are done, and when the
live ones fit half the batch (or a quarter, ...) the next phase decodes only them, their cache rows gathered
(``_decode_retiring``; one compile per row count and phase). Without it every row runs until the last one
finishes: 22-60% of GRPO's decode row-steps at C = 256 were past EOS.

Row outputs are independent of the batch: positions are per row and each row's sampling noise comes from
``fold_in(fold_in(key, step), row)`` with ``row`` its index in the whole batch, so a retired batch samples
the same tokens. ``completion_mask`` comes from the loop's own stop bookkeeping, never
from token values, so a pad id equal to the EOS id (SmolLM2) is handled. The design follows the
prefill/decode split of MaxText's and Tunix's samplers; the returned fields use TRL's names.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpax import distributed
from grpax.host_memory import release_host_memory
from grpax.models.llama import init_cache, logits_from_hidden
from grpax.models.moe import route_dtype
from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler.backend import BACKENDS, select_backend
from grpax.sampler.sampling import draw_from_uniform, filter_logits, sample_tokens, token_logprobs

logger = logging.getLogger(__name__)

TRUNCATIONS = ("left", "drop")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How completions are sampled (hashable: it is a static argument of the compiled sampler)."""

    max_prompt_length: int = 256  # longest prompt in tokens (after truncation)
    max_completion_length: int = 256  # C: new tokens per row at most
    temperature: float = 1.0  # divides the logits; logprobs are of log_softmax(logits / temperature)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus mass; 1.0 = off
    greedy: bool = False  # argmax decoding (temperature, top_k, top_p ignored; logprobs at temperature 1)
    stop_token_ids: tuple[int, ...] = ()  # a row finishes after emitting any of these (included in the mask)
    pad_token_id: int = 0  # written after a row has finished (the mask, not this id, marks real tokens)
    # Allowed prompt paddings P; () = multiples of 64, the last one capped at max_prompt_length.
    prompt_length_buckets: tuple[int, ...] = ()
    truncation: str = "left"  # prompts longer than max_prompt_length: "left" keeps the end, "drop" skips them
    cache_dtype: str | None = None  # KV cache dtype; None = the model's activation dtype
    # Decode in phases of this many steps, each on a cache of P + (its last step) slots, grown between
    # phases: attention work follows the filled length instead of P + C (~25% less at C = 256), at the cost
    # of compiling one loop body per phase. 0 = one phase on all P + C slots.
    decode_phase_length: int = 64
    # Who runs the model's prefill and decode step (grpax.sampler.backend): "xla" = XLA's ops (any device, any
    # mesh), "cpu" = the C++ kernels of grpax.backends.cpu (one CPU device), "auto" = "cpu" where it runs and
    # its kernels build, else "xla".
    backend: str = "auto"
    # Between decode phases, decode only the rows still running: when they fit half the rows (or a quarter,
    # ...), they and their cache rows are gathered into that smaller batch (one compile per row count and
    # phase). The same tokens and logprobs as false, which decodes every row until the last one finishes.
    retire_rows: bool = True
    # A mixture of experts' routing recorded (``router_replay``): each prompt and completion token's top-k
    # experts in every layer, as the prefill and the decode steps routed it (GenerateOutput's routed fields).
    record_routes: bool = False

    def __post_init__(self):
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={self.truncation!r}: expected one of {TRUNCATIONS}")
        if self.max_completion_length < 1 or self.max_prompt_length < 1:
            raise ValueError(
                f"max_prompt_length={self.max_prompt_length} and max_completion_length="
                f"{self.max_completion_length} must both be >= 1"
            )
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy=true for argmax)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {BACKENDS}")
        if not isinstance(self.retire_rows, bool):
            raise ValueError(f"retire_rows={self.retire_rows!r}: expected true or false")
        if self.decode_phase_length < 0:
            raise ValueError(
                f"decode_phase_length={self.decode_phase_length} must be >= 0 (0: one phase on all slots)"
            )

    def buckets(self) -> tuple[int, ...]:
        """Sorted prompt paddings; the last one is ``max_prompt_length``."""
        if self.prompt_length_buckets:
            return tuple(
                sorted(
                    {min(b, self.max_prompt_length) for b in self.prompt_length_buckets}
                    | {self.max_prompt_length}
                )
            )
        return (*range(64, self.max_prompt_length, 64), self.max_prompt_length)

    def bucket_for(self, length: int) -> int:
        """The smallest bucket >= ``length`` tokens."""
        return next(b for b in self.buckets() if b >= length)


class GenerateOutput(NamedTuple):
    """Rollouts of one ``generate`` call: N prompts, G = B / N completions each; completion row i answers prompt
    row i // G, which is ``prompts[prompt_indices[i // G]]``.

    Attributes:
      prompt_ids: int32 [N, P] left-padded prompts (pad_token_id on the left), one row per prompt.
      prompt_mask: int32 [N, P], 1 for real prompt tokens.
      completion_ids: int32 [B, C]; pad_token_id after the end.
      completion_mask: int32 [B, C], 1 for every generated token up to and including the first stop token.
      logprobs: float32 [B, C], each sampled token's log-probability under the distribution it was drawn from
        (logits / temperature, then top-k and top-p, renormalised: the behaviour policy; greedy: the
        unfiltered softmax at temperature 1); 0 where masked.
      lengths: int32 [B] completion lengths in tokens (= completion_mask.sum(1)).
      finish_reason: "stop" (a stop token was emitted) or "length" (C tokens without one), per row.
      prompt_indices: int32 [N] index of each prompt row in the input list (differs only with truncation
        "drop").
      decode_row_steps: rows x decode steps the model ran (0 where not counted); 1 - (sum(lengths - 1) /
        it) is the fraction of decode work spent on rows already finished.
      routed_experts: with ``record_routes`` (a mixture of experts), int8/16 [B, C, L, k]: the experts each
        completion token was routed to in each layer when the decode fed it back (the last token, never fed,
        and tokens after a row's end: 0s or padding's); else None.
      prompt_routed_experts: likewise int8/16 [N, P, L, k] of the prompt tokens (left-padded like prompt_ids).
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: list[str]
    prompt_indices: np.ndarray
    decode_row_steps: int = 0
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None


def _row_uniforms(key: jax.Array, step: jax.Array, rows: jax.Array) -> jax.Array:
    """float32 [b, 2] uniforms, row i's from fold_in(fold_in(key, step), rows[i]): keyed by the row's id in the
    whole batch (``rows`` int32 [b]), so neither the batch nor the row's place in it changes its noise."""
    with jax.named_scope("rng"):
        step_key = jax.random.fold_in(key, step)
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, rows)
        return jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(row_keys)


def _sample_rows(
    logits: jax.Array, key: jax.Array, step: jax.Array, rows: jax.Array, sc: SamplerConfig
) -> tuple[jax.Array, jax.Array]:
    """Samples int32 [b] with the noise of ``_row_uniforms`` (rows int32 [b]: the rows' ids); returns the tokens
    and their float32 [b] log-probabilities under the distribution drawn from (``filter_logits``; greedy: the
    unfiltered softmax at temperature 1)."""
    with jax.named_scope("sampling"):  # profiles split it: top_k, top_p, rng, draw, logprobs
        if sc.greedy:
            token = sample_tokens(logits, key, greedy=True)
            return token, token_logprobs(logits, token)
        scaled = filter_logits(logits, sc.temperature, sc.top_k, sc.top_p)
        token = draw_from_uniform(scaled, _row_uniforms(key, step, rows))
        return token, token_logprobs(scaled, token)


def generate_padded(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    num_generations: int = 1,
) -> dict[str, jax.Array]:
    """Samples completions for right-padded prompts (the array entry point; ``generate`` wraps it).

    Args:
      params: model params (any sharding).
      prompt_tokens: int32 [B, P] right-padded prompt ids.
      prompt_lengths: int32 [B] real prompt lengths in tokens, each in 1..P.
      key: PRNG key; the same key gives the same completions.
      cfg: model config (static).
      sampler_cfg: sampler config (static).
      num_generations: G (static): each prompt is prefilled once and its cache copied to G rows, which sample
        independently; output row i answers prompt i // G. The same as passing every prompt G times, with a
        G-times cheaper prefill.

    Raises:
      ValueError: ``backend="cpu"`` where it cannot run (``select_backend``).

    Returns:
      dict with ``completion_ids`` int32 [B, C], ``completion_mask`` int32 [B, C], ``logprobs`` float32 [B, C],
      ``lengths`` int32 [B], ``stopped`` bool [B] (a stop token was emitted), ``decode_row_steps`` int32 []
      (rows x decode steps the model ran); B = prompts * G. With ``record_routes`` (a mixture of experts) also
      ``routed_experts`` [B, C, L, k] and ``prompt_routed_experts`` [prompts, P, L, k] (right-padded).

    Runs two compiled functions: ``prefill`` (per prompt batch shape and the backend's plan, e.g. the CPU
    backend's packed length) and ``decode`` (per row count, prompt bucket and sampler config), so a new plan
    recompiles only the cheap prefill. With ``retire_rows`` and concrete inputs the decode runs phase by phase
    instead (``_decode_retiring``: the same rollout, finished rows dropped between phases).
    """
    sc = sampler_cfg
    concrete = not any(isinstance(x, jax.core.Tracer) for x in (prompt_tokens, prompt_lengths))
    backend = select_backend(sc.backend, params, cfg, sc.cache_dtype, concrete)
    if sc.record_routes and cfg.num_experts:  # the XLA backend (the CPU one runs Llama only)
        backend = dataclasses.replace(backend, record_routes=True)
    plan = backend.plan(prompt_tokens, prompt_lengths) if concrete else None
    cache, logits, prompt_routes = compiled_prefill(backend)(
        params, prompt_tokens, prompt_lengths, cfg, sc, num_generations, backend, plan
    )
    lengths = jnp.repeat(jnp.asarray(prompt_lengths, jnp.int32), num_generations)
    if concrete and sc.retire_rows and len(_phase_ends(sc)) > 1:
        out = _decode_retiring(params, cache, logits, lengths, key, cfg, sc, backend)
    else:
        out = compiled_decode(backend)(params, cache, logits, lengths, key, cfg, sc, backend)
    return out if prompt_routes is None else {**out, "prompt_routed_experts": prompt_routes}


def _phase_ends(sc: SamplerConfig) -> list[int]:
    """Decode phase ends: phase j runs the steps before ends[j] on a cache of P + ends[j] slots."""
    C = sc.max_completion_length
    phase_length = sc.decode_phase_length or C
    return [*range(phase_length, C, phase_length), C]


def _grow(cache: dict, slots: int, repeat: int = 1) -> dict:
    """The per-layer cache with ``slots`` more (empty) slots and each row repeated ``repeat`` times."""

    def pad(c, slot_axis):
        c = jnp.pad(c, [(0, slots if axis == c.ndim + slot_axis else 0) for axis in range(c.ndim)])
        return jnp.repeat(c, repeat, axis=0) if repeat > 1 else c

    return {  # keys [B, K, H, S], values [B, K, S, H]
        "k": jax.tree.map(lambda c: pad(c, -1), cache["k"]),
        "v": jax.tree.map(lambda c: pad(c, -2), cache["v"]),
    }


_PREFILL_STATIC = ("cfg", "sampler_cfg", "num_generations", "backend", "plan")
_DECODE_STATIC = ("cfg", "sampler_cfg", "backend")


@functools.cache
def _compiled(
    fn,
    static_argnames: tuple[str, ...],
    compiler_options: tuple[tuple[str, str], ...],
    donate_argnames: tuple[str, ...] = (),
):
    """``fn`` jitted with these XLA compiler options (the backend's), once per process."""
    return jax.jit(
        fn,
        static_argnames=static_argnames,
        compiler_options=dict(compiler_options) or None,
        donate_argnames=donate_argnames,
    )


def _prefill(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    num_generations: int,
    backend,
    plan,
) -> tuple[dict, jax.Array, jax.Array | None]:
    """Prefills right-padded prompts; returns (KV cache for the first decode phase, first-token logits, the
    prompt tokens' routing int [B, P, L, k] where the backend records it, else None).

    The cache has B * G rows (each prompt's copied to its G rows) and P + (first phase length) slots, slot ==
    position; the logits are float32 [B * G, V]. Arguments as in ``generate_padded``; ``backend`` and its
    ``plan`` from ``select_backend``.
    """
    sc = sampler_cfg
    G = num_generations
    B, P = prompt_tokens.shape
    # Prefill into a P-slot cache (prompt attention never scans empty slots), then pad it for the first decode
    # phase. Slot == position; padding slots >= length are overwritten by decode before they are attended.
    cache = init_cache(cfg, B, P, sc.cache_dtype or cfg.dtype, stacked=False)
    last, cache, *routes = backend.prefill(
        params, prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), cache, cfg, plan
    )
    cache = _grow(cache, _phase_ends(sc)[0], repeat=G)  # rows x G
    if G > 1:
        last = jnp.repeat(last, G, axis=0)
    return cache, logits_from_hidden(params, last, cfg), routes[0] if routes else None  # [B * G, V]


def _record(
    state: tuple, step, logits: jax.Array, rows: jax.Array, key: jax.Array, sc: SamplerConfig, routes=None
):
    """Samples step ``step``'s token of rows ``rows`` (int32 [b], ids in the whole batch) from their logits
    float32 [b, V] and writes it into the whole batch's state (ids, mask, logprobs [B, C], done [B], and where
    routing is recorded its routes [B, C, L, k]: ``routes`` int [b, L, k], the experts of the token this step fed,
    the previous one, at column ``step - 1``); returns (state, the token fed next, int32 [b]: pad for finished
    rows)."""
    ids, mask, logprobs, done = state[:4]
    recorded = state[4:]
    if routes is not None:
        recorded = (state[4].at[rows, step - 1].set(routes.astype(state[4].dtype)),)
    token, token_logprob = _sample_rows(logits, key, step, rows, sc)
    with jax.named_scope("record"):
        stop_ids = jnp.asarray(sc.stop_token_ids or (-1,), jnp.int32)
        live = ~done[rows]
        fed = jnp.where(live, token, sc.pad_token_id)
        ids = ids.at[rows, step].set(fed)
        mask = mask.at[rows, step].set(live.astype(jnp.int32))
        logprobs = logprobs.at[rows, step].set(jnp.where(live, token_logprob, 0.0))
        is_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        done = done.at[rows].set(~live | is_stop)
    return (ids, mask, logprobs, done, *recorded), fed


def _first_token(
    logits: jax.Array, key: jax.Array, sampler_cfg: SamplerConfig, route_shape: tuple | None = None
) -> tuple[tuple, jax.Array]:
    """The state after step 0 (the token sampled from the prefill's logits float32 [B, V]) and that token;
    ``route_shape`` (L, k, dtype): a mixture of experts' recorded routing, zeros [B, C, L, k] in the state."""
    sc = sampler_cfg
    B, C = logits.shape[0], sc.max_completion_length
    state = (
        jnp.full((B, C), sc.pad_token_id, jnp.int32),
        jnp.zeros((B, C), jnp.int32),
        jnp.zeros((B, C), jnp.float32),
        jnp.zeros((B,), bool),
    )
    if route_shape is not None:
        state += (jnp.zeros((B, C, *route_shape[:2]), route_shape[2]),)
    return _record(state, 0, logits, jnp.arange(B, dtype=jnp.int32), key, sc)


def _route_shape(cfg: ModelConfig, backend) -> tuple | None:
    """(L, k, dtype) of the routing the decode records (``_first_token``), or None."""
    if not getattr(backend, "record_routes", False):
        return None
    return cfg.num_layers, cfg.num_experts_per_tok, route_dtype(cfg.num_experts)


def _decode_phase(prepared, token, cache, state, step, prompt_lengths, rows, key, end: int, cfg, sc, backend):
    """Decode steps ``step``..``end - 1`` of rows ``rows`` (int32 [b]; their last tokens int32 [b], prompt
    lengths int32 [b] and b-row cache), stopping early when every row of the batch is done; the state is the
    whole batch's (``_record``). The cache is a loop carry: XLA updates it in place, no per-step copy."""

    def cond(carry):
        step, _, _, state = carry
        return (step < end) & ~jnp.all(state[3])

    def body(carry):
        step, token, cache, state = carry
        pos = (prompt_lengths + step - 1)[:, None]  # position of the previous token
        logits, cache, *routes = backend.decode_step(prepared, token, pos, cache, cfg)
        state, token = _record(state, step, logits, rows, key, sc, routes[0] if routes else None)
        return step + 1, token, cache, state

    return jax.lax.while_loop(cond, body, (step, token, cache, state))


def _outputs(state: tuple, decode_row_steps: jax.Array) -> dict[str, jax.Array]:
    ids, mask, logprobs, done = state[:4]
    out = {
        "completion_ids": ids,
        "completion_mask": mask,
        "logprobs": logprobs,
        "lengths": mask.sum(axis=1).astype(jnp.int32),
        "stopped": done,
        "decode_row_steps": decode_row_steps,
    }
    return {**out, "routed_experts": state[4]} if len(state) > 4 else out


def _decode(
    params: Params,
    cache: dict,
    logits: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    backend,
) -> dict[str, jax.Array]:
    """The decode loop from a prefilled cache and first-token logits float32 [B, V], every phase in one
    compiled function, all B rows to the end (no retirement: what a traced call and the compile check run).

    The cache enters the loop carry once per phase (grown between phases) and is updated in place at every
    step; no per-step copy. ``prompt_lengths`` int32 [B] per row (already repeated G times); returns
    ``generate_padded``'s dict. The backend prepares its weights once per call (``prepare_decode``), outside
    the loop.
    """
    sc = sampler_cfg
    B = logits.shape[0]
    ends = _phase_ends(sc)
    slots = jax.tree.leaves(cache["k"])[0].shape[-1] - ends[0] + sc.max_completion_length  # P + C
    prepared = backend.prepare_decode(params, cfg, slots)
    rows = jnp.arange(B, dtype=jnp.int32)
    state, token = _first_token(logits, key, sc, _route_shape(cfg, backend))
    step = jnp.int32(1)
    for j, end in enumerate(ends):
        if j:
            cache = _grow(cache, end - ends[j - 1])
        step, token, cache, state = _decode_phase(
            prepared, token, cache, state, step, prompt_lengths, rows, key, end, cfg, sc, backend
        )
    return _outputs(state, B * (step - 1))


def _retire_phase(
    prepared,
    token,
    cache,
    state,
    step,
    prompt_lengths,
    rows,
    keep,
    key,
    end,
    grow,
    num_slots,
    cfg,
    sc,
    backend,
):
    """One phase of ``_decode_retiring`` (``prepared``: ``prepare_decode``'s output, or the params where the
    backend prepares them inside each phase, for ``num_slots`` slots): the rows at indices ``keep`` (int32
    [b'] into the current b rows; None: all) gathered from the token, cache, prompt lengths and row ids, the
    cache grown by ``grow`` slots, then ``_decode_phase``. Returns (step, token, cache, state, prompt_lengths,
    rows)."""
    if not backend.prepares_once:  # the compiler reads the weights in place, no prepared copy
        prepared = backend.prepare_decode(prepared, cfg, num_slots)
    if keep is not None:
        token, prompt_lengths, rows = token[keep], prompt_lengths[keep], rows[keep]
        cache = jax.tree.map(lambda c: c[keep], cache)
    if grow:
        cache = _grow(cache, grow)
    step, token, cache, state = _decode_phase(
        prepared, token, cache, state, step, prompt_lengths, rows, key, end, cfg, sc, backend
    )
    return step, token, cache, state, prompt_lengths, rows


def _row_buckets(num_rows: int, row_multiple: int) -> list[int]:
    """The row counts a retiring decode may shrink to: ``num_rows`` halved while it stays a multiple of
    ``row_multiple`` (the devices the rows are split over), largest first."""
    sizes = [num_rows]
    while sizes[-1] % 2 == 0 and (sizes[-1] // 2) % row_multiple == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def _decode_retiring(
    params: Params,
    cache: dict,
    logits: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    backend,
) -> dict[str, jax.Array]:
    """``_decode`` with finished rows retired between phases (``SamplerConfig.retire_rows``).

    Each phase is its own compiled function (per row count and phase). Before each phase after the first, the
    host reads which rows are done; when the live rows fit a smaller bucket (``_row_buckets``: halvings of
    B), the phase gathers them (and enough finished rows to fill the bucket) with their cache rows and decodes
    only those. Every row writes its tokens at its own row of the whole batch's state and draws the noise of
    its row id (``_row_uniforms``), so the rollout is the same as ``_decode``'s, token for token; only the
    rows x steps the model runs (``decode_row_steps``) shrink. The loop stops as soon as every row is done.

    Memory: the first phase (the prefill's cache, its shape unchanged) takes its cache donated, so it decodes in
    place and the prefill's cache is gone after it (it was held through the whole decode: one cache more at
    every phase); later phases grow or gather the cache (a new buffer, which a donation could not reuse).
    Between phases the host hands the freed caches back (``release_host_memory``): each phase's cache is
    larger than the last one's, so glibc could not reuse their blocks and the process grew by a cache a phase.
    """
    sc = sampler_cfg
    B = logits.shape[0]
    ends = _phase_ends(sc)
    slots = jax.tree.leaves(cache["k"])[0].shape[-1] - ends[0] + sc.max_completion_length  # P + C
    options = backend.compiler_options
    prepared = params
    if backend.prepares_once:
        prepared = _compiled(_prepare, ("cfg", "backend", "num_slots"), options)(params, cfg, backend, slots)
    leaf = jax.tree.leaves(cache["k"])[0]
    shard_rows = leaf.sharding.shard_shape(leaf.shape)[0] if hasattr(leaf, "sharding") else B
    buckets = _row_buckets(B, max(1, B // shard_rows))
    rows = jnp.arange(B, dtype=jnp.int32)
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    first = _compiled(_first_token, ("sampler_cfg", "route_shape"), options)
    state, token = first(logits, key, sc, _route_shape(cfg, backend))
    statics = ("end", "grow", "num_slots", "cfg", "sc", "backend")
    phases = [
        _compiled(_retire_phase, statics, options, ("cache",)),
        _compiled(_retire_phase, statics, options),
    ]
    step, row_ids, row_steps = jnp.int32(1), np.arange(B), 0
    for j, end in enumerate(ends):
        keep = None
        if j:
            release_host_memory()  # the last phase's input cache, freed when its output replaced it
            done = distributed.fetch(state[3])
            live = np.flatnonzero(~done[row_ids])  # indices into the current rows
            if live.size == 0:  # every row done: no phase left to run
                break
            size = next(b for b in reversed(buckets) if b >= live.size)
            if size < len(row_ids):
                finished = np.flatnonzero(done[row_ids])[: size - live.size]
                keep = np.sort(np.concatenate([live, finished])).astype(np.int32)
                row_ids = row_ids[keep]
        before = step
        step, token, cache, state, lengths, rows = phases[min(j, 1)](
            prepared, token, cache, state, step, lengths, rows, keep, key,
            end=end, grow=end - ends[j - 1] if j else 0, num_slots=slots, cfg=cfg, sc=sc, backend=backend,
        )  # fmt: skip
        row_steps += len(row_ids) * int(distributed.fetch(step - before))
    return _outputs(state, jnp.int32(row_steps))


def _prepare(params: Params, cfg: ModelConfig, backend, num_slots: int):
    return backend.prepare_decode(params, cfg, num_slots)


def compiled_prefill(backend):
    """The jitted prefill with ``backend``'s compiler options (what ``generate_padded`` runs; for the compile
    check: ``compiled_prefill(backend).lower(params, tokens, lengths, cfg, sc, G, backend, None)``)."""
    return _compiled(_prefill, _PREFILL_STATIC, backend.compiler_options)


def compiled_decode(backend):
    """The jitted decode of every phase and row (``_decode``) with ``backend``'s compiler options."""
    return _compiled(_decode, _DECODE_STATIC, backend.compiler_options)


def prepare_prompts(
    prompts: list[list[int]], sampler_cfg: SamplerConfig
) -> tuple[list[list[int]], list[int]]:
    """Applies the truncation policy; returns (kept prompts, their indices in ``prompts``).

    Raises:
      ValueError: if a prompt is empty.
    """
    sc = sampler_cfg
    kept, indices, num_long = [], [], 0
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) > sc.max_prompt_length:
            num_long += 1
            if sc.truncation == "drop":
                continue
            prompt = prompt[-sc.max_prompt_length :]
        kept.append(list(prompt))
        indices.append(i)
    if num_long:
        action = "dropped" if sc.truncation == "drop" else "left-truncated (kept their last tokens)"
        logger.warning(
            "%d of %d prompts are longer than max_prompt_length=%d (key max_prefill_predict_length) and were %s",
            num_long,
            len(prompts),
            sc.max_prompt_length,
            action,
        )
    return kept, indices


def generate(
    params: Params,
    prompts: list[list[int]],
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    key: jax.Array,
    num_generations: int = 1,
) -> GenerateOutput:
    """Samples ``num_generations`` completions per prompt (a GRPO group), rows grouped contiguously.

    Args:
      params: model params.
      prompts: N token-id lists (no padding).
      cfg: model config.
      sampler_cfg: sampling settings; prompts are padded to ``sampler_cfg.bucket_for(longest)`` tokens.
      key: PRNG key (one per call; rows get independent noise).
      num_generations: G completions per prompt; row i answers prompt i // G (each prompt is prefilled once).

    Returns:
      A ``GenerateOutput`` of numpy arrays.

    Raises:
      ValueError: an empty prompt, or no prompt left after truncation "drop".
    """
    sc = sampler_cfg
    kept, indices = prepare_prompts(prompts, sc)
    if not kept:
        raise ValueError(
            "no prompt left to generate from (all longer than max_prompt_length, truncation=drop)"
        )
    B = len(kept)
    lengths = np.array([len(p) for p in kept], np.int32)
    P = sc.bucket_for(int(lengths.max()))
    right = np.full((B, P), sc.pad_token_id, np.int32)
    left = np.full((B, P), sc.pad_token_id, np.int32)
    prompt_mask = np.zeros((B, P), np.int32)
    for i, p in enumerate(kept):
        right[i, : len(p)] = p
        left[i, P - len(p) :] = p
        prompt_mask[i, P - len(p) :] = 1
    # fetch, not device_get: with several JAX processes the outputs span other hosts' devices.
    out = distributed.fetch(generate_padded(params, right, lengths, key, cfg, sc, num_generations))
    release_host_memory()  # the cache, the prefill's and the decode's buffers: before the next call allocates
    finish = ["stop" if s else "length" for s in out["stopped"]]
    routed = {}
    if "routed_experts" in out:  # the prompts' routes left-padded like prompt_ids
        on_right = np.asarray(out["prompt_routed_experts"])
        on_left = np.zeros_like(on_right)
        for i, n in enumerate(lengths):
            on_left[i, P - n :] = on_right[i, :n]
        routed = dict(routed_experts=np.asarray(out["routed_experts"]), prompt_routed_experts=on_left)
    return GenerateOutput(
        prompt_ids=left,
        prompt_mask=prompt_mask,
        completion_ids=np.asarray(out["completion_ids"]),
        completion_mask=np.asarray(out["completion_mask"]),
        logprobs=np.asarray(out["logprobs"]),
        lengths=np.asarray(out["lengths"]),
        finish_reason=finish,
        prompt_indices=np.array(indices, np.int32),
        decode_row_steps=int(out["decode_row_steps"]),
        **routed,
    )
