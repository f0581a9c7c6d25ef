"""The rollout engine: batched prefill + KV-cache decode, the whole decode loop inside ``jax.jit``.

GRPO spends most of its wall time sampling, so the loop never returns to Python: prompts are prefilled into a
cache of ``P_bucket + C`` slots at most (slot == position, each row at its own length), then a
``lax.while_loop`` decodes one token per row per step and exits as soon as every row has emitted a stop
token. On one device the prefill packs the prompts back to back (no FLOPs on padding; each token attends
within its own prompt), with the tokens every prompt starts with (a system prompt, an instruction template)
prefilled once and copied to every row on CPU; under a mesh it runs on the padded [B, P] batch, whose rows
stay sharded. The decode
runs in phases of ``decode_phase_length`` steps, each on a cache just long enough for it (grown between
phases), so attention work follows the filled length. On one CPU device the decode step runs on C++ kernels
(``grpax.models.cpu_kernels``): attention that writes the new key/value in place and reads only each row's
filled slots, and matmuls against weights repacked once per call into column panels; elsewhere XLA's ops.
Prefill and decode are two compiled functions; the cache passes from one to the other and lives in the
decode loop's carry, where XLA updates it in place: one copy per phase, none per step (a donated input
cannot help: XLA aliases donations only to outputs of the same shape). By default the decode runs with
per-layer weight and cache buffers (layers unrolled): scanning stacked layers copies each layer's weights
and cache slice every step. Compiled functions are cached per shape (batch size, prompt bucket, packed
length) and config: a new prompt length inside the same bucket reuses the compiled decode.

Row outputs are independent of the batch: positions are per row and each row's sampling noise comes from
``fold_in(fold_in(key, step), row)``. ``completion_mask`` comes from the loop's own stop bookkeeping, never
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
from grpax.models import cpu_kernels
from grpax.models.llama import (
    forward,
    init_cache,
    logits_from_hidden,
    pack_decode_params,
    rope_inv_freq,
    rope_tables,
)
from grpax.models.params import Params, convert_layout
from grpax.models.registry import ModelConfig
from grpax.sampler.sampling import sample_from_uniform, sample_tokens, token_logprobs

logger = logging.getLogger(__name__)

TRUNCATIONS = ("left", "drop")
KERNEL_CHOICES = ("auto", "kernel", "xla")  # decode_attention and decode_matmul


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
    # Decode with per-layer weights and cache buffers (layers unrolled) instead of scanning stacked layers:
    # no per-step copy of each layer's weights and cache slice (~2x faster on CPU), longer compile, and a
    # transient per-layer copy of the weights inside the sampler.
    unroll_layers: bool = True
    # Prefill the prompts packed back to back (no padding FLOPs; attention within each prompt) instead of as
    # a [B, P] padded batch. Used by ``generate`` on a single device; under a mesh the padded prefill keeps
    # its rows sharded.
    packed_prefill: bool = True
    # With the packed prefill on the CPU attention kernel, prefill the prompts' common first tokens (a system
    # prompt, an instruction template; ``shared_prefix_length``) once and copy their keys/values to every row.
    share_prompt_prefix: bool = True
    # Decode in phases of this many steps, each on a cache of P + (its last step) slots, grown between
    # phases: attention work follows the filled length instead of P + C (~25% less at C = 256), at the cost
    # of compiling one loop body per phase. 0 = one phase on all P + C slots.
    decode_phase_length: int = 64
    # Decode attention: "kernel" = the CPU kernel of grpax.models.cpu_kernels (reads only the filled slots;
    # one CPU device), "xla" = XLA's ops (any device, any mesh), "auto" = the kernel where it applies and
    # builds, else XLA's.
    decode_attention: str = "auto"
    # Prefill attention of the packed prefill: "kernel" = the CPU kernel of grpax.models.cpu_kernels (one
    # CPU device; ~5-10x XLA's windowed attention), "xla" = XLA's ops, "auto" = the kernel where it applies.
    prefill_attention: str = "auto"
    # Decode matmuls: "kernel" = the CPU kernel of grpax.models.cpu_kernels on weights repacked once per call
    # into column panels (one CPU device, unroll_layers; a transient packed copy of the weights), "xla" =
    # XLA's dots, "auto" = the kernel where it applies and builds, else XLA's.
    decode_matmul: str = "auto"
    # Prefill matmuls: "kernel" = the same CPU kernel on the same packed weights (one CPU device,
    # unroll_layers), "xla" = XLA's dots, "auto" = the kernel where it is the faster: a bfloat16 model
    # (``cfg.dtype``, the dtype the weights are packed in) on a CPU with AMX (``cpu_kernels.amx_enabled()``;
    # its tiles run the prefill's products 2-3x XLA's bfloat16 dots), else XLA's (its float32 dots are as
    # fast as the kernel's vector tiles at many rows).
    prefill_matmul: str = "auto"
    # Decode sampling (temperature only: no top-k / top-p, not greedy): "kernel" = the CPU kernel
    # ``cpu_kernels.sample`` (the draw and its log-probability in two passes over the vocabulary; one CPU
    # device), "xla" = XLA's ops (``sampling.sample_from_uniform`` and ``token_logprobs``), "auto" = the kernel
    # where it applies. The same distribution; a uniform within float32 rounding of a CDF step may pick the
    # neighbouring token.
    decode_sampling: str = "auto"

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
        if self.decode_attention not in KERNEL_CHOICES:
            raise ValueError(f"decode_attention={self.decode_attention!r}: expected one of {KERNEL_CHOICES}")
        if self.prefill_attention not in KERNEL_CHOICES:
            raise ValueError(
                f"prefill_attention={self.prefill_attention!r}: expected one of {KERNEL_CHOICES}"
            )
        if self.decode_sampling not in KERNEL_CHOICES:
            raise ValueError(f"decode_sampling={self.decode_sampling!r}: expected one of {KERNEL_CHOICES}")
        if self.decode_matmul not in KERNEL_CHOICES:
            raise ValueError(f"decode_matmul={self.decode_matmul!r}: expected one of {KERNEL_CHOICES}")
        if self.prefill_matmul not in KERNEL_CHOICES:
            raise ValueError(f"prefill_matmul={self.prefill_matmul!r}: expected one of {KERNEL_CHOICES}")
        if self.decode_phase_length < 0:
            raise ValueError(
                f"decode_phase_length={self.decode_phase_length} must be >= 0 (0: one phase on all slots)"
            )

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

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

    def packed_length_for(self, total: int, batch_size: int, prompt_bucket: int) -> int:
        """Packed prefill length for ``total`` prompt tokens: a multiple of 1/8 of the padded ``B * P``.

        At most 8 lengths (compiled shapes) per batch size and prompt bucket, at most B * P / 8 tokens of
        padding.
        """
        step = -(-batch_size * prompt_bucket // 8)
        return min(-(-total // step) * step, batch_size * prompt_bucket)


class GenerateOutput(NamedTuple):
    """Rollouts of one ``generate`` call; row i answers ``prompts[prompt_indices[i]]``.

    Attributes:
      prompt_ids: int32 [B, P] left-padded prompts (pad_token_id on the left).
      prompt_mask: int32 [B, P], 1 for real prompt tokens.
      completion_ids: int32 [B, C]; pad_token_id after the end.
      completion_mask: int32 [B, C], 1 for every generated token up to and including the first stop token.
      logprobs: float32 [B, C], log_softmax(logits / temperature) of each sampled token; 0 where masked.
      lengths: int32 [B] completion lengths in tokens (= completion_mask.sum(1)).
      finish_reason: "stop" (a stop token was emitted) or "length" (C tokens without one), per row.
      prompt_indices: int32 [B] index of each row's prompt in the input list (differs only with truncation
        "drop").
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: list[str]
    prompt_indices: np.ndarray


def _row_uniforms(key: jax.Array, step: jax.Array, num_rows: int) -> jax.Array:
    """float32 [B, 2] uniforms, row b's from fold_in(fold_in(key, step), b): independent of the batch."""
    step_key = jax.random.fold_in(key, step)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, jnp.arange(num_rows))
    return jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(row_keys)


def _sample_rows(logits: jax.Array, key: jax.Array, step: jax.Array, sc: SamplerConfig) -> jax.Array:
    """Samples int32 [B] with the noise of ``_row_uniforms``: independent of the batch."""
    if sc.greedy:
        return sample_tokens(logits, key, greedy=True)
    u = _row_uniforms(key, step, logits.shape[0])
    return sample_from_uniform(logits, u, temperature=sc.temperature, top_k=sc.top_k, top_p=sc.top_p)


def _param_devices(params: Params) -> set | None:
    """The devices holding the params (numpy leaves: the default device); None while they are traced."""
    leaves = jax.tree.leaves(params)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    return set().union(
        *(x.sharding.device_set if hasattr(x, "sharding") else {jax.devices()[0]} for x in leaves)
    )


def _on_cpu(params: Params) -> bool:
    """True when the params are concrete arrays on CPU devices only."""
    devices = _param_devices(params)
    return devices is not None and all(d.platform == "cpu" for d in devices)


def _plain_sampling(sc: SamplerConfig) -> bool:
    """True when rows are drawn from the temperature-scaled distribution alone (what ``cpu_kernels.sample`` does)."""
    return not sc.greedy and sc.top_k == 0 and sc.top_p >= 1.0


def resolve_decode_attention(
    sampler_cfg: SamplerConfig, params: Params, cfg: ModelConfig | None = None
) -> SamplerConfig:
    """The config with its "auto" kernel choices made "kernel" or "xla" for these params.

    The choices are ``decode_attention``, ``prefill_attention``, ``decode_matmul``, ``prefill_matmul`` and
    ``decode_sampling``. The CPU kernels (``grpax.models.cpu_kernels``) apply when every param is a concrete
    array on one CPU device, params, activations and cache are float32 or bfloat16 (float16 takes XLA's
    path) and the kernels build; the matmul kernel also needs ``unroll_layers``, the sampling kernel plain
    temperature sampling (no top-k, top-p or greedy). "auto" picks the matmul kernel for
    the prefill only where it is faster than XLA's dots: the model config ``cfg`` given with dtype bfloat16,
    and AMX (``cpu_kernels.amx_enabled()``).

    Raises:
      ValueError: "kernel" asked for where it cannot run (params sharded or on an accelerator, float16,
        stacked layers for the matmul kernel) or the kernels could not be built.
    """
    sc = sampler_cfg
    kernel_choices = (sc.decode_attention, sc.prefill_attention, sc.decode_matmul, sc.prefill_matmul)
    if all(choice == "xla" for choice in (*kernel_choices, sc.decode_sampling)):
        return sc
    one_cpu = _on_cpu(params) and len(_param_devices(params)) == 1
    kernel_dtypes = (jnp.float32, jnp.bfloat16)  # float16 params, activations or cache take XLA's path
    dtypes_ok = (
        all(jnp.dtype(leaf.dtype) in kernel_dtypes for leaf in jax.tree.leaves(params))
        and (cfg is None or jnp.dtype(cfg.dtype) in kernel_dtypes)
        and (sc.cache_dtype is None or jnp.dtype(sc.cache_dtype) in kernel_dtypes)
    )
    choices = {}
    for key, value, needs in (
        ("decode_attention", sc.decode_attention, None),
        ("prefill_attention", sc.prefill_attention, None),
        ("decode_matmul", sc.decode_matmul, None if sc.unroll_layers else "unroll_layers=True"),
        ("prefill_matmul", sc.prefill_matmul, None if sc.unroll_layers else "unroll_layers=True"),
        (
            "decode_sampling",
            sc.decode_sampling,
            None if _plain_sampling(sc) else "top_k=0, top_p=1.0, greedy=False",
        ),
    ):
        if value == "kernel":
            if not one_cpu:
                raise ValueError(
                    f"{key}='kernel' runs on one CPU device only; these params are sharded or on an "
                    f"accelerator: use {key}='auto' or 'xla'"
                )
            if needs:
                raise ValueError(f"{key}='kernel' needs {needs}: set it or use {key}='auto' or 'xla'")
            if not dtypes_ok:
                raise ValueError(
                    f"{key}='kernel' takes float32 or bfloat16 params, activations and cache; use {key}='auto' "
                    "or 'xla'"
                )
            if not cpu_kernels.available():
                raise ValueError(
                    f"{key}='kernel': the CPU kernels could not be built (see the warning above); "
                    f"use {key}='auto' or 'xla'"
                )
        elif value == "auto":
            applies = one_cpu and dtypes_ok and not needs and cpu_kernels.available()
            if key == "prefill_matmul":  # faster than XLA's dots only on AMX tiles, for bfloat16
                bf16 = cfg is not None and jnp.dtype(cfg.dtype) == jnp.bfloat16
                applies = applies and bf16 and cpu_kernels.amx_enabled()
            choices[key] = "kernel" if applies else "xla"
    return dataclasses.replace(sc, **choices) if choices else sc


def generate_padded(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    num_generations: int = 1,
    packed_length: int | None = None,
    prefix_length: int = 0,
) -> dict[str, jax.Array]:
    """Samples completions for right-padded prompts (the array entry point; ``generate`` wraps it).

    Args:
      params: model params (any sharding), or on one CPU device already packed for the matmul kernel
        (``pack_decode_params``; then used for both prefill and decode).
      prompt_tokens: int32 [B, P] right-padded prompt ids.
      prompt_lengths: int32 [B] real prompt lengths in tokens, each in 1..P.
      key: PRNG key; the same key gives the same completions.
      cfg: model config (static).
      sampler_cfg: sampler config (static).
      num_generations: G (static): each prompt is prefilled once and its cache copied to G rows, which sample
        independently; output row i answers prompt i // G. The same as passing every prompt G times, with a
        G-times cheaper prefill.
      packed_length: static; when set (>= the sum of ``prompt_lengths``, less (B - 1) * ``prefix_length``), the
        prompts are prefilled packed
        back to back in one sequence of this many tokens instead of as the padded [B, P] batch: the same
        cache and logits without the padding FLOPs (``forward(packed_rows=...)``).
      prefix_length: static A; with ``packed_length`` and the prefill attention kernel, the first A tokens are
        the same in every prompt (e.g. the system prompt, ``shared_prefix_length``) and are prefilled once:
        packed first, written to every row's cache. Every prompt must be longer than A (and the packed length
        at least A + the sum of ``prompt_lengths - A``). Checked for concrete arrays only: under an outer jit a
        wrong A gives wrong rows silently.

    Raises:
      ValueError: ``packed_length`` below the tokens to pack; ``prefix_length`` without ``packed_length``,
        with a prompt not longer than it or not starting with prompt 0's first ``prefix_length`` tokens, or
        without the prefill attention kernel; a kernel asked for where it cannot run
        (``resolve_decode_attention``); params already packed (``pack_decode_params``) with
        ``prefill_matmul`` or ``decode_matmul`` "xla".

    Returns:
      dict with ``completion_ids`` int32 [B, C], ``completion_mask`` int32 [B, C], ``logprobs`` float32 [B, C],
      ``lengths`` int32 [B], ``stopped`` bool [B] (a stop token was emitted); B = prompts * G.

    Runs two compiled functions: ``prefill`` (per prompt batch shape, packed length and prefix length) and
    ``decode`` (per
    row count, prompt bucket and sampler config), so a new packed length recompiles only the cheap prefill.
    """
    if prefix_length and packed_length is None:
        raise ValueError(f"prefix_length={prefix_length} needs the packed prefill: pass packed_length too")
    if packed_length is not None and not isinstance(prompt_lengths, jax.core.Tracer):
        lengths = np.asarray(prompt_lengths)
        if prefix_length and (lengths.min() <= prefix_length):
            raise ValueError(
                f"prefix_length={prefix_length}: every prompt must be longer than the shared prefix, the "
                f"shortest has {lengths.min()} tokens (shared_prefix_length keeps one token per prompt)"
            )
        if prefix_length and not isinstance(prompt_tokens, jax.core.Tracer):
            head = np.asarray(prompt_tokens)[:, :prefix_length]
            if not np.all(head == head[:1]):
                row = int(np.flatnonzero(np.any(head != head[:1], axis=1))[0])
                raise ValueError(
                    f"prefix_length={prefix_length}: prompt {row} does not start with prompt 0's first "
                    f"{prefix_length} tokens; pass the tokens all prompts share (shared_prefix_length) or 0"
                )
        total = int(np.sum(lengths)) - (len(lengths) - 1) * prefix_length
        if total > packed_length:
            raise ValueError(
                f"packed_length={packed_length} is less than the {total} prompt tokens to pack; pass at least "
                "their sum (SamplerConfig.packed_length_for) or packed_length=None for the padded prefill"
            )
    if _packed(params):  # pack_decode_params's layout: only the matmul kernel reads it
        explicit = [key for key in ("prefill_matmul", "decode_matmul") if getattr(sampler_cfg, key) == "xla"]
        if explicit:
            raise ValueError(
                f"params packed for the CPU matmul kernel (pack_decode_params) need it in prefill and decode; "
                f"{', '.join(f'{key}=xla' for key in explicit)} asks for XLA's dots: pass the params unpacked "
                "or set them to 'auto' or 'kernel'"
            )
        sampler_cfg = dataclasses.replace(sampler_cfg, prefill_matmul="kernel", decode_matmul="kernel")
    sampler_cfg = resolve_decode_attention(sampler_cfg, params, cfg)
    if prefix_length and sampler_cfg.prefill_attention != "kernel":
        raise ValueError(
            f"prefix_length={prefix_length} shares a prefix on the CPU prefill-attention kernel, not in use here "
            f"(prefill_attention={sampler_cfg.prefill_attention!r}): pass prefix_length=0"
        )
    on_cpu = _on_cpu(params)
    if sampler_cfg.prefill_matmul == sampler_cfg.decode_matmul == "kernel" and not _packed(params):
        params = _pack_cpu(params, cfg)  # one packed copy for both
    cache, logits = (_prefill_cpu if on_cpu else prefill)(
        params,
        prompt_tokens,
        prompt_lengths,
        cfg,
        sampler_cfg,
        num_generations,
        packed_length=packed_length,
        prefix_length=prefix_length,
    )
    lengths = jnp.repeat(jnp.asarray(prompt_lengths, jnp.int32), num_generations)
    return (_decode_cpu if on_cpu else decode)(params, cache, logits, lengths, key, cfg, sampler_cfg)


def _packed(params: Params) -> bool:
    """True for params already in the matmul kernel's layout (``pack_decode_params``)."""
    return "packed_lm_head" in params


_pack_cpu = jax.jit(pack_decode_params, static_argnames="cfg")


def _phase_ends(sc: SamplerConfig) -> list[int]:
    """Decode phase ends: phase j runs the steps before ends[j] on a cache of P + ends[j] slots."""
    C = sc.max_completion_length
    phase_length = sc.decode_phase_length or C
    return [*range(phase_length, C, phase_length), C]


def _grow(cache: dict, slots: int, batch_axis: int, repeat: int = 1) -> dict:
    """The cache with ``slots`` more (empty) slots and each row repeated ``repeat`` times."""

    def pad(c, slot_axis):
        c = jnp.pad(c, [(0, slots if axis == c.ndim + slot_axis else 0) for axis in range(c.ndim)])
        return jnp.repeat(c, repeat, axis=batch_axis) if repeat > 1 else c

    return {  # keys [.., B, K, H, S], values [.., B, K, S, H]
        "k": jax.tree.map(lambda c: pad(c, -1), cache["k"]),
        "v": jax.tree.map(lambda c: pad(c, -2), cache["v"]),
    }


_PREFILL_STATIC = ("cfg", "sampler_cfg", "num_generations", "packed_length", "prefix_length")
_DECODE_STATIC = ("cfg", "sampler_cfg")


@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC)
def prefill(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    num_generations: int = 1,
    packed_length: int | None = None,
    prefix_length: int = 0,
) -> tuple[dict, jax.Array]:
    """Prefills right-padded prompts; returns (KV cache for the first decode phase, first-token logits).

    The cache has B * G rows (each prompt's copied to its G rows) and P + (first phase length) slots, slot ==
    position; the logits are float32 [B * G, V]. Arguments as in ``generate_padded`` (with
    ``prefill_matmul="kernel"`` the params may come packed, ``pack_decode_params``).
    """
    sc = sampler_cfg
    G = num_generations
    B, P = prompt_tokens.shape
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_lengths = prompt_lengths.astype(jnp.int32)

    # Prefill into a P-slot cache (prompt attention never scans empty slots), then pad it for the first decode
    # phase. Slot == position; padding slots >= length are overwritten by decode before they are attended.
    dtype = jnp.dtype(sc.cache_dtype or cfg.dtype)
    if sc.prefill_matmul == "kernel":  # the matmul kernel's panels (given by generate_padded, or made here)
        params = params if _packed(params) else pack_decode_params(params, cfg)
    else:
        params = convert_layout(params, cfg, scan_layers=not sc.unroll_layers)
    cache = init_cache(cfg, B, P, dtype, stacked=not sc.unroll_layers)
    if packed_length is None:
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        hidden, cache = forward(
            params, prompt_tokens, cfg, positions=positions, cache=cache, return_hidden=True
        )
        last = hidden[jnp.arange(B), prompt_lengths - 1]  # [B, D]
    else:
        # The shared prefix (A tokens, taken from row 0) first, then token t >= A of prompt b at packed index
        # offsets[b] + t - A. The prefix and the padding get row B, which the layers' scatter drops; they write
        # the prefix to every row themselves.
        A = prefix_length
        suffix = prompt_lengths - A
        offsets = A + jnp.cumsum(suffix) - suffix
        t = jnp.arange(P, dtype=jnp.int32)[None, :]
        index = jnp.where((t >= A) & (t < prompt_lengths[:, None]), offsets[:, None] + t - A, packed_length)
        index = index.at[0, :A].set(jnp.arange(A, dtype=jnp.int32))
        packed = jnp.zeros((packed_length,), jnp.int32).at[index].set(prompt_tokens, mode="drop")
        rows = (
            jnp.full((packed_length,), B, jnp.int32)
            .at[index]
            .set(jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, P)), mode="drop")
            .at[:A]
            .set(B)
        )
        positions = (
            jnp.zeros((packed_length,), jnp.int32).at[index].set(jnp.broadcast_to(t, (B, P)), mode="drop")
        )
        hidden, cache = forward(
            params,
            packed[None],
            cfg,
            positions=positions[None],
            cache=cache,
            return_hidden=True,
            packed_rows=rows,
            packed_window=P,
            packed_kernel=sc.prefill_attention == "kernel",
            packed_prefix=A,
        )
        last = hidden[0, offsets + suffix - 1]  # [B, D]

    cache = _grow(cache, _phase_ends(sc)[0], 0 if sc.unroll_layers else 1, repeat=G)  # rows x G
    if G > 1:
        last = jnp.repeat(last, G, axis=0)
    return cache, logits_from_hidden(params, last, cfg)  # [B * G, V]


@functools.partial(jax.jit, static_argnames=_DECODE_STATIC)
def decode(
    params: Params,
    cache: dict,
    logits: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
) -> dict[str, jax.Array]:
    """The decode loop from a prefilled cache and first-token logits float32 [B, V].

    The cache enters the loop carry once per call (grown between phases) and is updated in place at every
    step; no per-step copy.

    ``prompt_lengths`` int32 [B] per row (already repeated G times); returns ``generate_padded``'s dict.
    ``sampler_cfg.decode_attention`` and ``decode_matmul`` are taken as resolved: "kernel" uses the CPU kernel
    (the caller checks that it applies, ``resolve_decode_attention``; the matmul kernel repacks the weights
    once per call, ``pack_decode_params``, unless they come packed), anything else XLA's ops.
    """
    sc = sampler_cfg
    B = logits.shape[0]
    C = sc.max_completion_length
    stop_ids = jnp.asarray(sc.stop_token_ids or (-1,), jnp.int32)
    temperature = sc.logprob_temperature
    if sc.decode_matmul == "kernel":  # per-layer packed weights, copied straight from stacked layers
        params = params if _packed(params) else pack_decode_params(params, cfg)
    else:
        params = convert_layout(params, cfg, scan_layers=not sc.unroll_layers)
    batch_axis = 0 if sc.unroll_layers else 1
    ends = _phase_ends(sc)
    # RoPE cos/sin of every position the loop reaches (P + C slots), computed once: computed inside the step,
    # XLA:CPU re-derived them in every layer's fusions.
    slots = jax.tree.leaves(cache["k"])[0].shape[-1] - ends[0] + C
    cos, sin = rope_tables(jnp.arange(slots, dtype=jnp.int32)[None], rope_inv_freq(cfg))
    rope_table = (cos[0, :, 0], sin[0, :, 0])  # [P + C, H/2]

    def record(state, step, logits):
        ids, mask, logprobs, done = state
        if sc.decode_sampling == "kernel":  # the draw and its logprob in one CPU kernel
            token, token_logprob = cpu_kernels.sample(logits, _row_uniforms(key, step, B), sc.temperature)
        else:
            token = _sample_rows(logits, key, step, sc)
            token_logprob = token_logprobs(logits, token, temperature)
        live = ~done
        ids = ids.at[:, step].set(jnp.where(live, token, sc.pad_token_id))
        mask = mask.at[:, step].set(live.astype(jnp.int32))
        logprobs = logprobs.at[:, step].set(jnp.where(live, token_logprob, 0.0))
        is_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        done = done | (live & is_stop)
        return (ids, mask, logprobs, done), jnp.where(live, token, sc.pad_token_id)

    state = (
        jnp.full((B, C), sc.pad_token_id, jnp.int32),
        jnp.zeros((B, C), jnp.int32),
        jnp.zeros((B, C), jnp.float32),
        jnp.zeros((B,), bool),
    )
    state, token = record(state, 0, logits)

    def phase(end):  # the loop of decode steps up to ``end`` (exclusive)
        def cond(carry):
            step, _, _, state = carry
            return (step < end) & ~jnp.all(state[3])

        def body(carry):
            step, token, cache, state = carry
            pos = (prompt_lengths + step - 1)[:, None]  # position of the previous token
            hidden, cache = forward(
                params,
                token[:, None],
                cfg,
                positions=pos,
                cache=cache,
                return_hidden=True,
                decode_kernel=sc.decode_attention == "kernel",
                rope_table=rope_table,
            )
            logits = logits_from_hidden(params, hidden[:, 0], cfg)
            state, token = record(state, step, logits)
            return step + 1, token, cache, state

        return cond, body

    step = jnp.int32(1)
    for j, end in enumerate(ends):
        if j:
            cache = _grow(cache, end - ends[j - 1], batch_axis)
        step, token, cache, state = jax.lax.while_loop(*phase(end), (step, token, cache, state))
    ids, mask, logprobs, done = state
    return {
        "completion_ids": ids,
        "completion_mask": mask,
        "logprobs": logprobs,
        "lengths": mask.sum(axis=1).astype(jnp.int32),
        "stopped": done,
    }


# XLA:CPU options of the sampler's jits. Its YNNPACK fusions made the decode's small-batch matmuls (weights
# streamed from memory at every step) slower: at batch 16 on a 2-core AVX2 machine 81-93 ms per decode step
# without them against 112-117 with them; no clear change at batch 64 (docs/benchmarks.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
_prefill_cpu = jax.jit(
    prefill.__wrapped__, static_argnames=_PREFILL_STATIC, compiler_options=CPU_COMPILER_OPTIONS
)
_decode_cpu = jax.jit(
    decode.__wrapped__, static_argnames=_DECODE_STATIC, compiler_options=CPU_COMPILER_OPTIONS
)


def shared_prefix_length(prompts: list[list[int]], multiple: int = 8) -> int:
    """Tokens every prompt starts with, rounded down to a ``multiple`` and leaving each prompt one token.

    The rounding keeps the number of compiled prefills small when batches share different numbers of tokens
    by chance. Returns 0 for fewer than two prompts.
    """
    if len(prompts) < 2:
        return 0
    first = prompts[0]
    common = min(len(p) for p in prompts) - 1  # each prompt keeps one token of its own
    for p in prompts[1:]:
        common = min(
            common, next((i for i, (a, b) in enumerate(zip(first, p, strict=False)) if a != b), common)
        )
    return max(common, 0) // multiple * multiple


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
      sampler_cfg: sampling settings; prompts are padded to ``sampler_cfg.bucket_for(longest)`` tokens. With
        ``share_prompt_prefix`` (and the packed prefill on the CPU kernel) the prompts' common first tokens
        (``shared_prefix_length``) are prefilled once.
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
    packed_length, prefix = None, 0
    if sc.packed_prefill and len(_param_devices(params)) == 1:
        if sc.share_prompt_prefix and resolve_decode_attention(sc, params, cfg).prefill_attention == "kernel":
            prefix = shared_prefix_length(kept)
        packed_length = sc.packed_length_for(int(lengths.sum()) - (B - 1) * prefix, B, P)
    out = distributed.fetch(
        generate_padded(
            params,
            right,
            lengths,
            key,
            cfg,
            sc,
            num_generations,
            packed_length=packed_length,
            prefix_length=prefix,
        )
    )
    finish = ["stop" if s else "length" for s in out["stopped"]]
    G = num_generations
    return GenerateOutput(
        prompt_ids=np.repeat(left, G, axis=0),
        prompt_mask=np.repeat(prompt_mask, G, axis=0),
        completion_ids=np.asarray(out["completion_ids"]),
        completion_mask=np.asarray(out["completion_mask"]),
        logprobs=np.asarray(out["logprobs"]),
        lengths=np.asarray(out["lengths"]),
        finish_reason=finish,
        prompt_indices=np.repeat(np.array(indices, np.int32), G),
    )
