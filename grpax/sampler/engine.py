"""The rollout engine: a paged KV cache and continuous batching, driven from the host around two compiled programs.

GRPO spends most of its wall time sampling, and completion lengths are long-tailed, so the engine keeps memory
and decode work on the tokens that exist. The KV cache is a pool of fixed-size pages (``page_size`` tokens; per
layer one buffer, laid out by the backend), and each sequence owns a page table: its prompt's full pages, shared
by the G completions of a GRPO group (written once), then pages of its own, taken from the pool as it grows and
returned when it ends (``grpax.sampler.paging``). Sequences decode in a fixed number of slots
(``max_num_seqs``): the host hands each program call the running sequences' last tokens, positions, page tables,
row ids and keys; the call runs up to ``decode_steps_per_call`` decode steps inside one ``lax.while_loop``
(``grpax.sampler.decode``) and returns early when a sequence ends while others wait, so its slot is refilled at
once: new prompts are prefilled (``admit``, one compiled program per prompt count and bucket) between decode
calls. The page pools pass through both programs donated, so XLA updates them in place: no copy of the cache
per call or per step.

One loop serves every use: ``generate`` submits a batch of prompts and collects it in order; the GRPO rollout
submits batch_size x G sequences; a multi-turn rollout submits sequences that pause at a turn's end (a stop token,
a pause token, the turn's budget) with their pages kept, and resumes them with their observation tokens, fed as
forced tokens through the same decode step (``Engine.resume``). ``update_params`` swaps the weights between
calls of a running engine (queued and running sequences kept, the KV of those already prefilled recomputed under
the new weights before they decode on: ``refill``); each token records the version that sampled it, and its
logprob is exactly that version's.
Each request may set its own length limit (at most ``max_completion_length``) and sampling (temperature, top-k,
top-p, greedy; ``Engine.submit``): the programs read every row's limit and rule as data, so requests of any mix
share decode calls. Where every row of a call samples by the ``SamplerConfig``'s rule (the GRPO rollout, always)
the programs take it as static, the code they always ran; rows of other rules run a second program per shape
that reads each row's (``grpax.sampler.decode.sample``): one more compile per shape, none per setting.
When no sequence waits, the running ones are packed into the smallest of a ladder of slot counts that holds them
(``retire_rows``, ``slot_counts``: one compile per count), and a call returns as soon as they fit the next count
down, so the decode's tail runs on few slots. When the pool runs out of
pages, the newest sequence is preempted and restarted later from its prompt (it samples the same tokens again:
its noise depends only on its key, row and token index).

Row outputs are independent of the batch: positions are per sequence and token n of row r draws its noise from
``fold_in(fold_in(key, n), r)``, with r its index in the submitted batch, so neither its slot, its companions nor
its admission time change its tokens (the static engine this replaced drew the same noise). ``completion_mask``
comes from the loop's stop bookkeeping, never from token values, so a pad id equal to the EOS id (SmolLM2) is
handled. The logits are ``grpax.models.llama.logits_from_hidden``'s, the function the trainer scores with. The
design follows vLLM's paged attention and scheduler (Kwon et al. 2023) and the prefill/decode split of MaxText's
and Tunix's samplers; the returned fields use TRL's names.

Who runs the model's prefill and decode step is one choice per engine, ``SamplerConfig.backend``, made by
``grpax.sampler.backend.select_backend``: XLA's ops (any device; the paged attention gathers pages, or Pallas's
ragged paged attention on TPU) or the CPU backend's C++ kernels.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpax import distributed, sharding
from grpax.errors import ConfigError
from grpax.host_memory import available_host_bytes, release_host_memory
from grpax.models.moe import route_dtype
from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler import decode as programs
from grpax.sampler.backend import BACKENDS, select_backend
from grpax.sampler.paging import PagePool

logger = logging.getLogger(__name__)

TRUNCATIONS = ("left", "drop")
PROGRAM_SETS = ("auto", "fixed", "adaptive")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How completions are sampled (hashable: it is a static argument of the compiled programs).

    The sampling fields (temperature, top_k, top_p, greedy) and max_completion_length are the defaults of each
    request, which ``Engine.submit`` may override; the programs read every row's rule as data.
    """

    max_prompt_length: int = 256  # longest prompt in tokens (after truncation)
    max_completion_length: int = 256  # C: new tokens per row at most (a request may ask fewer)
    temperature: float = 1.0  # divides the logits; logprobs are of log_softmax(logits / temperature)
    top_k: int = 0  # keep the k most likely tokens; 0 = off (rows asking this k take lax.top_k's path)
    top_p: float = 1.0  # nucleus mass; 1.0 = off
    greedy: bool = False  # argmax decoding (temperature, top_k, top_p ignored; logprobs at temperature 1)
    stop_token_ids: tuple[int, ...] = ()  # a row finishes after emitting any of these (included in the mask)
    pad_token_id: int = 0  # written after a row has finished (the mask, not this id, marks real tokens)
    # Allowed prompt paddings P; () = multiples of 64, the last one capped at max_prompt_length.
    prompt_length_buckets: tuple[int, ...] = ()
    truncation: str = "left"  # prompts longer than max_prompt_length: "left" keeps the end, "drop" skips them
    cache_dtype: str | None = None  # KV cache dtype; None = the model's activation dtype
    # Where the decode's attention gathers pages (XLA backend off TPU), it reads the pages of the longest running
    # sequence rounded up to this many tokens, not the whole page table: attention work follows the filled
    # length, at the cost of one compile per width. 0 = always the whole table.
    decode_phase_length: int = 64
    # Who runs the model's prefill and decode step (grpax.sampler.backend): "xla" = XLA's ops (any device, any
    # mesh), "cpu" = the C++ kernels of grpax.backends.cpu (one CPU device), "auto" = "cpu" where it runs and
    # its kernels build, else "xla".
    backend: str = "auto"
    # When no sequence waits for a slot, decode the running ones on the smallest slot count that holds them
    # (``slot_counts``: one compile per count); false: always on max_num_seqs slots. The same tokens and logprobs.
    retire_rows: bool = True
    # The step between those slot counts (``slot_counts``): 0 = max(2, max_num_seqs // 8); 1 = every count, so
    # no slot idles in the tail (no decode row-step past EOS), at one compile per count.
    slot_count_step: int = 0
    # A mixture of experts' routing recorded (``router_replay``): each prompt and completion token's top-k
    # experts in every layer, as the prefill and the decode steps routed it (GenerateOutput's routed fields).
    record_routes: bool = False
    page_size: int = 32  # tokens per page of the KV cache
    # Decode slots: sequences decoded at once at most. 0 = every sequence of a generate call (the GRPO rollout's
    # batch_size x G), so that all of them run together.
    max_num_seqs: int = 0
    # Pages in the KV pool (page_size tokens each, one of them scratch). 0 = enough for every slot to hold
    # max_prompt_length + max_completion_length tokens, the static engine's memory; fewer pages give the same
    # rollouts while the running sequences' real lengths fit (sequences preempted and restarted otherwise).
    num_pages: int = 0
    # The fraction of each device's memory (what JAX may allocate there: memory_stats' bytes_limit) that the
    # rollout's params and its KV pool may take together (vLLM's gpu_memory_utilization, MaxText's key
    # hbm_utilization_vllm): the pool gets the pages that fit in what the fraction leaves after the params, at
    # most the num_pages=0 pool. 0 = off (num_pages sizes the pool); not with num_pages.
    hbm_utilization: float = 0.0
    # Decode steps per device call at most: between calls the host refills free slots and takes new pages. A
    # call returns early when a sequence ends while another waits for a slot.
    decode_steps_per_call: int = 16
    # Which programs the engine compiles (``program_set``): "fixed" = one decode slot count (every slot), the
    # whole page table, one prompt padding (max_prompt_length, or prompt_length_buckets where given), one prompt
    # count per group size, and sampling rules read as data, so that every use (rollout, evaluation, generate)
    # shares them: a small set known before the run, compiled once; "adaptive" = the ladders that follow the
    # work (retire_rows' slot counts, decode_phase_length's widths, 64-token buckets, power-of-two prompt
    # counts: one compile each, worth it where an idle slot costs its full work); "auto" = fixed on an
    # accelerator, where an idle slot costs far less than a compile (docs/benchmarks.md), adaptive on CPU.
    programs: str = "auto"
    # With the fixed program set, the completions per prompt its prefill program is compiled for (a GRPO run's
    # num_generations): a request of fewer (the evaluation's one pass, a preempted sequence's re-prefill) runs
    # that program, each prompt's rows past its own unused, so it compiles no prefill of its own. 0 = each
    # request's own count. Not a key: the trainer sets it.
    prefill_group: int = 0
    # Prompts one prefill call takes at most (the adaptive set's; 0 = as many as free slots allow): an engine step
    # admits more in further calls, so the prefill's prompt counts are the powers of two up to it (grpax serve on
    # CPU: 1, one prefill program per prompt bucket; a CPU prefill's time grows with its prompts anyway).
    max_prefill_prompts: int = 0
    # Every row's sampling rule read as data, the default rule's rows too (the fixed set always does): one program
    # per shape for every mix of rules, not a second one for rows of the SamplerConfig's rule.
    rules_as_data: bool = False

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
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer):
            raise ValueError(f"top_k={self.top_k!r} must be an integer (tokens kept; 0 = off)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {BACKENDS}")
        if self.programs not in PROGRAM_SETS:
            raise ValueError(f"programs={self.programs!r}: expected one of {PROGRAM_SETS}")
        if not isinstance(self.retire_rows, bool):
            raise ValueError(f"retire_rows={self.retire_rows!r}: expected true or false")
        if self.decode_phase_length < 0:
            raise ValueError(
                f"decode_phase_length={self.decode_phase_length} must be >= 0 (0: read the whole page table)"
            )
        for name in ("page_size", "decode_steps_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("max_num_seqs", "num_pages", "slot_count_step", "prefill_group", "max_prefill_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: the default)")
        if not 0.0 <= self.hbm_utilization <= 1.0:
            raise ValueError(f"hbm_utilization={self.hbm_utilization} must be in [0, 1] (0: off)")
        if self.hbm_utilization and self.num_pages:
            raise ValueError(
                f"num_pages={self.num_pages} and hbm_utilization={self.hbm_utilization} both size the KV pool: "
                "pass one"
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

    def decode_slots(self, num_sequences: int) -> int:
        """Decode slots of an engine given ``num_sequences`` to run at once (a GRPO rollout's batch_size x G):
        ``max_num_seqs``, or that many where it is 0."""
        return self.max_num_seqs or num_sequences

    def pages_per_sequence(self) -> int:
        """Pages of a sequence of max_prompt_length + max_completion_length tokens (the page table's width)."""
        return -(-(self.max_prompt_length + self.max_completion_length) // self.page_size)


def fixed_programs(sampler_cfg: SamplerConfig, params: Params) -> bool:
    """Whether an engine on ``params`` (concrete or abstract with shardings) compiles the fixed program set
    (``SamplerConfig.programs``; auto: where the params live on accelerators)."""
    if sampler_cfg.programs != "auto":
        return sampler_cfg.programs == "fixed"
    try:
        devices = jax.tree.leaves(params)[0].sharding.device_set
    except (IndexError, AttributeError, ValueError, RuntimeError):  # none, unplaced, or an abstract mesh
        devices = jax.devices()
    return all(d.platform != "cpu" for d in devices)


def program_config(sampler_cfg: SamplerConfig, fixed: bool) -> SamplerConfig:
    """The ``SamplerConfig`` the programs are compiled with (a static argument): with the fixed set, its
    sampling fields at their neutral values (every row's rule is data), so that engines of other sampling (an
    evaluation's greedy rows, a request's own) run the rollout's programs."""
    if not fixed:
        return sampler_cfg
    return dataclasses.replace(sampler_cfg, temperature=1.0, top_k=0, top_p=1.0, greedy=False)


def describe_programs(sampler_cfg: SamplerConfig, fixed: bool, uses: dict[str, tuple[int, int]]) -> str:
    """One line naming the prefill and decode programs an engine compiles for each use (``uses``: name ->
    (prompts, G) at once, e.g. {"rollout": (4, 4), "evaluation": (16, 1)}): with the fixed set their shapes
    (a decode of as many slots as an earlier use's is that program); else the adaptive ladders."""
    sc = sampler_cfg
    if not fixed:
        counts = {sc.decode_slots(n * g) for n, g in uses.values()}
        ladders = "; ".join(
            f"{S} slots: {slot_counts(S, sc.slot_count_step) if sc.retire_rows else [S]}"
            for S in sorted(counts)
        )
        widths = (
            f"page-table widths by {sc.decode_phase_length} tokens"
            if sc.decode_phase_length
            else "the whole page table"
        )
        return (
            f"adaptive: decode slot counts ({ladders}), {widths}, prompt buckets {list(sc.buckets())}, "
            "power-of-two prompt counts: one program each as met"
        )
    parts, decodes, prefills = [], set(), set()
    for use, (n, g) in uses.items():
        S, G = sc.decode_slots(n * g), program_group(sc, fixed, g)
        decode = (
            "the same decode"
            if S in decodes
            else (f"decode {S} slots x {sc.pages_per_sequence()} pages x {sc.decode_steps_per_call} steps")
        )
        decodes.add(S)
        P = list(sc.buckets()) if sc.prompt_length_buckets else sc.max_prompt_length  # Engine.prompt_width
        N = fixed_prefill_prompts(S, G)
        prefill = "the same prefill" if (N, G) in prefills else f"prefill {N} prompts x {P} tokens (G = {G})"
        prefills.add((N, G))
        parts.append(f"{use}: {prefill}, {decode}")
    return "fixed: " + "; ".join(parts)


def program_group(sampler_cfg: SamplerConfig, fixed: bool, num_generations: int) -> int:
    """The completions per prompt of the prefill program that admits groups of ``num_generations``: with the
    fixed set at least ``prefill_group`` (fewer rows run the larger group's program), else their own."""
    return max(num_generations, sampler_cfg.prefill_group) if fixed else num_generations


def fixed_prefill_prompts(num_slots: int, num_generations: int) -> int:
    """The prompt count of every prefill of a fixed program set: the most prompts of G completions that fill
    ``num_slots`` slots, rounded up to a power of two."""
    return pow2(-(-num_slots // num_generations))


class SamplingRule(NamedTuple):
    """A request's sampling as the programs read it per row (``grpax.sampler.decode.sample``).

    Attributes:
      temperature: divides the logits; 0.0 = greedy (argmax, logprobs at temperature 1).
      top_k: tokens kept; 0 = off (and for greedy).
      top_p: nucleus mass; 1.0 = off (and for greedy).
    """

    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, sampler_cfg: SamplerConfig) -> SamplingRule:
        """The rule of a ``SamplerConfig``'s sampling fields (already validated)."""
        sc = sampler_cfg
        return cls(0.0, 0, 1.0) if sc.greedy else cls(float(sc.temperature), int(sc.top_k), float(sc.top_p))


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
      decode_row_steps: slots x decode steps the model ran for these rows (0 where not counted); 1 -
        (sum(lengths - 1) / it) is the fraction of decode work spent on idle slots.
      policy_versions: int32 [B, C] the params version that sampled each token (``Engine.update_params``), -1
        where masked; None where not recorded.
      routed_experts: with ``record_routes`` (a mixture of experts), int8/16 [B, C, L, k]: the experts each
        completion token was routed to in each layer when the decode fed it back (0s for the last token, never
        fed, and past a row's end); else None.
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
    policy_versions: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None


@functools.cache
def _compiled(fn, static_argnames: tuple[str, ...], compiler_options: tuple[tuple[str, str], ...], donate=()):
    """``fn`` jitted with these XLA compiler options (the backend's) and ``donate`` donated, once per process."""
    return jax.jit(
        fn,
        static_argnames=static_argnames,
        donate_argnames=donate,
        compiler_options=dict(compiler_options) or None,
    )


ADMIT_STATIC = ("cfg", "sampler_cfg", "num_generations", "backend", "plan", "key_impl")
DECODE_STATIC = ("cfg", "sampler_cfg", "backend", "num_steps", "key_impl")
REFILL_STATIC = ("cfg", "sampler_cfg", "backend", "plan")
# Context tokens (rows x padded length) one ``refill`` call recomputes at most: a bound on its dense prefill cache.
REFILL_TOKENS = 16384


def compiled_admit(backend):
    """The jitted prefill of new prompts into the pages (``grpax.sampler.decode.admit``)."""
    return _compiled(programs.admit, ADMIT_STATIC, backend.compiler_options, ("pages",))


def compiled_decode(backend):
    """The jitted decode steps of a set of slots (``grpax.sampler.decode.decode``)."""
    return _compiled(programs.decode, DECODE_STATIC, backend.compiler_options, ("pages",))


def compiled_refill(backend):
    """The jitted recompute of sequences' keys and values after a weight swap (``grpax.sampler.decode.refill``)."""
    return _compiled(programs.refill, REFILL_STATIC, backend.compiler_options, ("pages",))


def routing_backend(backend, cfg: ModelConfig, sampler_cfg: SamplerConfig):
    """``backend`` recording a mixture of experts' routing where ``sampler_cfg.record_routes`` asks for it (the
    XLA backend: the CPU one runs dense Llama models only)."""
    if sampler_cfg.record_routes and cfg.num_experts:
        return dataclasses.replace(backend, record_routes=True)
    return backend


def _prepare(params: Params, cfg: ModelConfig, backend, num_slots: int):
    return backend.prepare_decode(params, cfg, num_slots)


def pool_pages(sampler_cfg: SamplerConfig, num_slots: int, room: tuple[int, int] | None = None) -> int:
    """Pages in the KV pool of an engine of ``num_slots`` decode slots: ``num_pages``, or where it is 0 one scratch
    page and ``pages_per_sequence`` for every slot (each can hold max_prompt_length + max_completion_length
    tokens: the static engine's memory); with ``hbm_utilization`` and ``room`` (``memory_room``: bytes the pool
    may take per device, bytes of one page per device), the pages that fit in that room, at most that many.
    ``Engine``, ``abstract_programs`` and the planner (``grpax.plan.compile_check``) all size the pool here."""
    sc = sampler_cfg
    full = sc.num_pages or 1 + num_slots * sc.pages_per_sequence()
    if not sc.hbm_utilization or room is None:
        return full
    free, page = room
    return min(full, max(0, free // page))


# Engines whose page pools are alive: ``memory_room`` leaves their bytes out of a new engine's room.
_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def bytes_limit(device) -> int | None:
    """The bytes JAX may allocate on ``device`` (``memory_stats()["bytes_limit"]``), None where it reports none."""
    return (device.memory_stats() or {}).get("bytes_limit")


def check_memory_fraction(hbm_utilization: float) -> None:
    """Refuses ``hbm_utilization_vllm`` where this host's devices report no memory size (CPU) before any model
    loads, rather than ``memory_room`` after the load (the same message).

    Raises:
      ConfigError: the key, its value and the fix (num_pages) named.
    """
    if hbm_utilization and bytes_limit(jax.local_devices()[0]) is None:
        raise ConfigError(_no_memory_size(hbm_utilization, jax.local_devices()[0].platform))


def _no_memory_size(hbm_utilization: float, kind: str) -> str:
    return (
        f"hbm_utilization_vllm={hbm_utilization}: the {kind} devices report no memory size; size the KV pool with "
        "num_pages instead (grpax train_rl compile_topology=... suggests one)"
    )


def memory_room(params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend) -> tuple[int, int]:
    """``(bytes, page bytes)``: what ``hbm_utilization`` of the smallest memory among the params' devices
    (``memory_stats()["bytes_limit"]``) leaves after the params' largest per-device share and the pools of the
    engines alive (a training run's kept rollout engine while an evaluation builds its own), and one page's bytes
    per device (its largest shard of every pool). Reference: vLLM's gpu_memory_utilization (the instance's
    weights and KV cache within the fraction; its activation profile is not counted here).

    Raises:
      ValueError: a device that reports no memory size (CPU): the key and the fix named.
    """
    sc = sampler_cfg
    leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "addressable_shards")]
    devices = {s.device for x in leaves for s in x.addressable_shards} or set(jax.local_devices()[:1])
    limits = [bytes_limit(d) for d in devices]
    if None in limits:
        raise ValueError(_no_memory_size(sc.hbm_utilization, next(iter(devices)).platform))
    held = collections.Counter()  # the params, and the pools of the engines alive (a kept rollout's)
    for x in [*leaves, *(p for engine in list(_LIVE_ENGINES) for p in jax.tree.leaves(engine.pages))]:
        for shard in x.addressable_shards:
            held[shard.device] += shard.data.nbytes
    limit = min(limits)
    page = sharding.per_chip_bytes(abstract_pool(params, cfg, sc, backend, 1))
    return int(sc.hbm_utilization * limit) - max(held.values(), default=0), int(page)


def check_host_room(
    params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_pages: int, num_slots: int
) -> None:
    """Refuses a KV pool of ``num_pages`` pages that the host's available memory cannot hold
    (``grpax.host_memory.available_host_bytes``), before it is allocated, where the pool lives on devices that
    report no memory size (CPU: there an oversized pool ends in the kernel's OOM killer, with no message).

    Raises:
      ValueError: one line naming the key that sized the pool (num_pages, else max_num_seqs), its value, the
        bytes needed and available, and the largest value that fits.
    """
    sc = sampler_cfg
    leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "addressable_shards")]
    devices = {s.device for x in leaves for s in x.addressable_shards} or set(jax.local_devices()[:1])
    room = available_host_bytes()
    if room is None or any(bytes_limit(d) is not None for d in devices):
        return
    init, _ = _pool(params, cfg, sc, backend, 1)
    page = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(init)))  # all on this host
    usable = int(room * 0.9)  # a tenth for the prefill's cache, the logits and the programs
    if num_pages * page <= usable:
        return
    fit = max(0, usable // page - 1)  # pages, less the scratch page
    gib = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"  # noqa: E731
    if sc.num_pages:
        raise ValueError(
            f"num_pages={sc.num_pages}: the KV pool needs {gib(num_pages * page)}, more than the {gib(room)} of host "
            f"memory available; pass num_pages <= {fit}"
        )
    tokens = sc.max_prompt_length + sc.max_completion_length
    key = (
        f"max_num_seqs={sc.max_num_seqs}"
        if sc.max_num_seqs
        else f"max_num_seqs=0 ({num_slots} slots: the batch)"
    )
    raise ValueError(
        f"{key}: the KV pool of {num_slots} decode slots of {tokens} tokens needs "
        f"{gib(num_pages * page)}, more than the {gib(room)} of host memory available; pass max_num_seqs <= "
        f"{fit // sc.pages_per_sequence()}, or num_pages <= {fit} (sequences then share the pool)"
    )


def prefill_prompts(sampler_cfg: SamplerConfig, num_prompts: int, num_generations: int) -> int:
    """The most prompts one prefill of a ``num_prompts`` x G rollout takes (a power of two, as ``_prefill``
    rounds them): all of them, or with fewer decode slots (``max_num_seqs``) the groups that fill the slots
    (``_admit`` starts a group while a slot is free). ``abstract_programs`` and the planner size the prefill so."""
    G = num_generations
    admitted = min(num_prompts, -(-sampler_cfg.decode_slots(num_prompts * G) // G))
    return pow2(admitted)


@functools.cache
def _zeros_program(backend, args: tuple, sharding):
    """The jitted ``backend.init_pages(*args)`` placed on ``sharding``, once per process and equal backend: an
    engine built per rollout (or per evaluation batch) compiles no new program for its pool."""
    return jax.jit(functools.partial(backend.init_pages, *args), out_shardings=sharding)


def _pool(params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_pages: int):
    """(the function that builds the zero page pools, where they are placed): the backend's layout of
    ``num_pages`` pages of ``page_size`` tokens in ``cache_dtype`` (default the model's dtype)."""
    sc = sampler_cfg
    dtype = jnp.dtype(sc.cache_dtype or cfg.dtype)
    init = functools.partial(backend.init_pages, cfg, num_pages, sc.page_size, dtype)
    return init, _pool_sharding(params, cfg, backend)


def abstract_pool(params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, backend, num_pages: int):
    """The page pools ``Engine`` allocates, as ``jax.ShapeDtypeStruct``s placed as it places them (the params'
    mesh and the backend's ``page_spec``): what ``abstract_programs`` compiles with and the planner sizes.

    Args:
      params: the rollout's params, concrete or ``jax.ShapeDtypeStruct`` with shardings (a device mesh or an
        ``AbstractMesh``).
      backend: ``select_backend``'s choice (its ``init_pages`` and ``page_spec``).
      num_pages: ``pool_pages``.
    """
    init, sharding = _pool(params, cfg, sampler_cfg, backend, num_pages)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), jax.eval_shape(init)
    )


def _pool_sharding(params: Params, cfg: ModelConfig, backend):
    """Where the page pools live: the params' devices, over their mesh as the backend places them (None: the
    default device)."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, backend.page_spec(cfg, dict(sharding.mesh.shape)))
    return sharding


class _Replicated:
    """A backend stand-in whose pools (and so the small per-slot arrays) are replicated."""

    def page_spec(self, cfg, mesh_shape):
        return jax.sharding.PartitionSpec()


def abstract_programs(
    params: Params,
    cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    backend,
    num_prompts: int,
    num_generations: int,
) -> dict[str, tuple]:
    """The engine's two programs with abstract arguments for ``num_prompts`` x G sequences in flight (the decode
    slots full, the largest prefill ``prefill_prompts``, prompts of the largest bucket, the pool, the widest page
    table, every row at ``sampler_cfg``'s sampling rule: the rollout's programs): what a compile check lowers.
    With the fixed program set (``fixed_programs``) they are exactly the programs the engine runs, its inputs
    placed as here (``Engine._put``), so that a run reads them from the persistent compilation cache.

    Args:
      params: the rollout's params, concrete or ``jax.ShapeDtypeStruct`` with shardings.
      backend: ``select_backend``'s choice.

    Returns:
      {"prefill": (jitted, args, kwargs), "decode": (jitted, args, kwargs)}: ``jitted.lower(*args, **kwargs)``.
    """
    backend = routing_backend(backend, cfg, sampler_cfg)
    fixed = fixed_programs(sampler_cfg, params)
    sc = program_config(sampler_cfg, fixed)
    G = program_group(sc, fixed, num_generations)
    S, P, V = sc.decode_slots(num_prompts * num_generations), sc.max_prompt_length, cfg.vocab_size
    N = fixed_prefill_prompts(S, G) if fixed else prefill_prompts(sc, num_prompts, G)
    pages = abstract_pool(params, cfg, sc, backend, pool_pages(sc, S))
    replicated = _pool_sharding(params, cfg, _Replicated())
    key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    key_impl = jax.config.jax_default_prng_impl  # read, not run: the default backend may be compile-only

    def spec(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    def rule(rows):  # the fixed set reads every row's sampling rule as data (Engine._rules)
        dtypes = (jnp.float32, jnp.int32, jnp.float32)
        return (
            dict(zip(programs.RULE_FIELDS, (spec((rows,), d) for d in dtypes), strict=True))
            if fixed
            else None
        )

    prefill_args = (
        params, pages, spec((N, P)), spec((N,)), spec((N, G, P)), spec((N * G, *key_data.shape), key_data.dtype),
        spec((N * G,)), rule(N * G),
    )  # fmt: skip
    prefill_kwargs = dict(
        cfg=cfg, sampler_cfg=sc, num_generations=G, backend=backend, plan=None, key_impl=key_impl
    )
    slots = {
        **{name: spec((S,)) for name in ("token", "n", "prompt_length", "rows", "num_forced", "forced_pos")},
        **{name: spec((S,)) for name in ("turn_end", "limit")},
        "active": spec((S,), bool),
        "pauses": spec((S,), bool),
        "key_data": spec((S, *key_data.shape), key_data.dtype),
        "page_table": spec((S, sc.pages_per_sequence())),
        "forced": spec((S, 1)),
    }
    prepared = params
    if backend.prepares_once:
        prepared = jax.eval_shape(
            _prepare, params, cfg, backend, sc.max_prompt_length + sc.max_completion_length
        )
    decode_args = (prepared, pages, slots, rule(S), spec((V,), bool), spec((V,), bool), spec(()))
    decode_kwargs = dict(
        cfg=cfg, sampler_cfg=sc, backend=backend, num_steps=sc.decode_steps_per_call, key_impl=key_impl
    )
    return {
        "prefill": (compiled_admit(backend), prefill_args, prefill_kwargs),
        "decode": (compiled_decode(backend), decode_args, decode_kwargs),
    }


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion in the engine: its prompt, pages and tokens so far (host state).

    ``state`` is "queued" (its prompt not yet prefilled), "ready" (prefilled, waiting for a slot), "running",
    "paused" (its segment ended; pages kept until ``Engine.resume`` or ``Engine.finish``) or "done".
    """

    request: Request
    index: int  # its row in the request: the row id of its noise
    prompt: list[int]
    state: str = "queued"
    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model: list[bool] = dataclasses.field(default_factory=list)  # sampled (True) or forced (an observation)
    versions: list[int] = dataclasses.field(default_factory=list)
    # a mixture of experts' recorded routing: int [L, k] of each token fed so far (tokens[: len(routes)])
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)
    reason: int = programs.RUNNING  # why its last segment ended
    forced: list[int] = dataclasses.field(default_factory=list)
    forced_pos: int = 0
    turn_end: int = 0
    order: int = 0  # admission order (preemption takes the newest)
    kv_epoch: int = 0  # the engine's params swap whose weights computed its keys and values

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def finish_reason(self) -> str:
        return "length" if self.reason == programs.LENGTH else "stop"

    def reset(self) -> None:
        """Back to its prompt (a preempted sequence, restarted later)."""
        self.tokens, self.logprobs, self.model, self.versions, self.routes = [], [], [], [], []
        self.pages, self.forced, self.forced_pos, self.reason = [], [], 0, programs.RUNNING
        self.state = "queued"


class Request:
    """A batch of prompts submitted together (``Engine.submit``); its sequences are its rows, G per prompt, each
    at most ``limit`` new tokens, sampled by ``rule``."""

    def __init__(
        self,
        prompts,
        key_data,
        key_impl,
        num_generations,
        pauses,
        turn_budget,
        limit: int,
        rule: SamplingRule,
        route_shape=None,
    ):
        self.prompts, self.key_data, self.key_impl = prompts, key_data, key_impl
        self.num_generations, self.pauses, self.turn_budget = num_generations, pauses, turn_budget
        self.limit, self.rule = limit, rule
        G = num_generations
        self.sequences = [Sequence(self, i, prompts[i // G]) for i in range(len(prompts) * G)]
        self.row_steps = 0
        # (L, k, dtype) of a mixture of experts' recorded routing, else None; each prompt's routes [length, L, k]
        self.route_shape = route_shape
        self.prompt_routes: dict[int, np.ndarray] = {}

    @property
    def done(self) -> bool:
        return all(s.state == "done" for s in self.sequences)

    def output(self, pad_token_id: int, bucket: int = 0, width: int = 0) -> GenerateOutput:
        """The rows in order as a ``GenerateOutput`` (prompts left-padded to ``bucket`` tokens, default the
        longest; completions to ``width``, default the length limit)."""
        N, B = len(self.prompts), len(self.sequences)
        bucket, width = bucket or max(map(len, self.prompts)), width or self.limit
        left = np.full((N, bucket), pad_token_id, np.int32)
        prompt_mask = np.zeros((N, bucket), np.int32)
        for i, p in enumerate(self.prompts):
            left[i, bucket - len(p) :], prompt_mask[i, bucket - len(p) :] = p, 1
        ids = np.full((B, width), pad_token_id, np.int32)
        mask = np.zeros((B, width), np.int32)
        logprobs = np.zeros((B, width), np.float32)
        versions = np.full((B, width), -1, np.int32)
        for b, s in enumerate(self.sequences):
            n = s.n
            ids[b, :n], mask[b, :n], logprobs[b, :n] = s.tokens, s.model, s.logprobs
            versions[b, :n] = s.versions
        versions[mask == 0] = -1
        routed = {}
        if self.route_shape is not None:  # prompts' routes left-padded like prompt_ids
            L, k, dtype = self.route_shape
            prompt_routes = np.zeros((N, bucket, L, k), dtype)
            for i, p in enumerate(self.prompts):
                prompt_routes[i, bucket - len(p) :] = self.prompt_routes[i]
            routes = np.zeros((B, width, L, k), dtype)
            for b, s in enumerate(self.sequences):
                if s.routes:
                    routes[b, : len(s.routes)] = np.stack(s.routes)
            routed = dict(routed_experts=routes, prompt_routed_experts=prompt_routes)
        return GenerateOutput(
            prompt_ids=left,
            prompt_mask=prompt_mask,
            completion_ids=ids,
            completion_mask=mask,
            logprobs=np.where(mask == 1, logprobs, 0.0).astype(np.float32),
            lengths=mask.sum(axis=1).astype(np.int32),
            finish_reason=[s.finish_reason for s in self.sequences],
            prompt_indices=np.arange(N, dtype=np.int32),
            decode_row_steps=self.row_steps,
            policy_versions=versions,
            **routed,
        )


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1): the one rounding of the engine's prompt counts, slot groups
    and refill widths (and of ``grpax.serve.worker``'s program set, which must meet the engine's shapes)."""
    return 1 << (n - 1).bit_length()


def slot_counts(num_slots: int, step: int = 0) -> list[int]:
    """Slot counts a decode call may run on, largest first: ``num_slots``, the multiples of q below it, then q
    halved while even; q = ``step`` (``slot_count_step``), 0 = max(2, num_slots // 8) (32: 32, 28, 24, ..., 4,
    2, 1; step 1: every count). A finished sequence's slot idles until the running ones fit the next count down;
    halvings alone left a quarter of the slots empty on average in the tail (docs/benchmarks.md); each count is
    one more compile of the decode."""
    q = step or max(2, num_slots // 8)
    sizes = [num_slots, *range(num_slots - num_slots % q or num_slots - q, 0, -q)]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sorted(set(sizes), reverse=True)


def call_slots(num_slots: int, running: int, waiting: bool, retire_rows: bool, step: int = 0) -> int:
    """Slots a decode call runs on with ``running`` sequences in an engine of ``num_slots``: all of them, or
    where no sequence waits for a slot and ``retire_rows`` is on, the smallest of ``slot_counts(num_slots,
    step)`` that holds the running ones. ``Engine`` and the planner's step count (``grpax.plan.step_cost``) both
    take it here."""
    if retire_rows and not waiting:
        return min(b for b in slot_counts(num_slots, step) if b >= running)
    return num_slots


def call_pages(prompt_length: int, n: int, steps: int, limit: int, page_size: int) -> int:
    """Pages a sequence of ``prompt_length`` prompt tokens and ``n`` completion tokens holds for a decode call of
    ``steps`` steps: through the last position the call may feed (its token n + steps - 1, or its token limit -
    1 where the length limit comes first; each step feeds the last token and samples the next)."""
    last = min(prompt_length + n - 1 + steps - 1, prompt_length + limit - 2)
    return last // page_size + 1


def gathered_width(longest: int, table_width: int, page_size: int, decode_phase_length: int) -> int:
    """Pages of the page table a decode call passes where its attention gathers them (``reads_filled_pages``
    false): the longest running sequence's ``longest`` pages rounded up to ``decode_phase_length // page_size``
    pages (at least 1), at most ``table_width``; ``decode_phase_length`` 0: the whole table. Every slot's row of
    the table is gathered whole at every step of the call."""
    if not decode_phase_length:
        return table_width
    step = max(1, decode_phase_length // page_size)
    return min(table_width, -(-longest // step) * step)


class Engine:
    """The rollout engine on one set of params: submit prompts, step, collect (see the module docstring).

    Args:
      params: model params (any sharding; the page pools are placed on the same devices).
      cfg: model config.
      sampler_cfg: sampling and engine settings.
      version: the params' version (recorded per token).
      num_slots: decode slots when ``sampler_cfg.max_num_seqs`` is 0 (default 64).
      pause_table: bool [V] tokens after which a pausing sequence's segment ends (multi-turn: the host checks a
        stop string), or None.
      max_forced_tokens: F, the most forced tokens (an observation) fed at once (``resume``).

    Raises:
      ValueError: ``backend="cpu"`` where it cannot run (``select_backend``); a pool too small for one sequence;
        a pool larger than the host memory available where the devices report no size (``check_host_room``).
    """

    def __init__(
        self,
        params: Params,
        cfg: ModelConfig,
        sampler_cfg: SamplerConfig,
        *,
        version: int = 0,
        num_slots: int = 64,
        pause_table: np.ndarray | None = None,
        max_forced_tokens: int = 1,
    ):
        sc = self.sc = sampler_cfg
        self.cfg = cfg
        self.fixed = fixed_programs(sc, params)
        # the CPU kernels' prefill picks its plan per prompt lengths (a program each): the fixed set runs XLA's ops
        name = "xla" if self.fixed and sc.backend == "auto" else sc.backend
        self.backend = routing_backend(select_backend(name, params, cfg, sc.cache_dtype, True), cfg, sc)
        self.num_slots = sc.decode_slots(num_slots)
        self.table_width = sc.pages_per_sequence()
        self.program_cfg = program_config(sc, self.fixed)  # the programs' static config
        # The fixed set's host inputs placed as abstract_programs' specs (replicated over the params' devices):
        # the compile check's programs are then the run's, read back from the persistent compilation cache.
        replicated = _pool_sharding(params, cfg, _Replicated()) if self.fixed else None
        self._put = (
            functools.partial(jax.device_put, device=replicated) if replicated else (lambda tree: tree)
        )
        room = memory_room(params, cfg, sc, self.backend) if sc.hbm_utilization else None
        num_pages = pool_pages(sc, self.num_slots, room)
        if room is not None and num_pages < 1 + self.table_width:
            free, page = room
            raise ValueError(
                f"hbm_utilization_vllm={sc.hbm_utilization}: the KV pool gets {max(free, 0) / 2**30:.2f} GiB per "
                f"device after the params, {num_pages} pages of {sc.page_size} tokens, fewer than one sequence of "
                f"{sc.max_prompt_length + sc.max_completion_length} tokens needs ({1 + self.table_width}); raise it, "
                "or pass num_pages"
            )
        if num_pages < 1 + self.table_width:
            raise ValueError(
                f"num_pages={num_pages} holds no sequence of max_prompt_length + max_completion_length = "
                f"{sc.max_prompt_length + sc.max_completion_length} tokens in pages of {sc.page_size}: "
                f"pass at least {1 + self.table_width}"
            )
        check_host_room(params, cfg, sc, self.backend, num_pages, self.num_slots)
        self.pool = PagePool(num_pages)
        self.pages = self._init_pages(params, num_pages)
        _LIVE_ENGINES.add(self)
        V = cfg.vocab_size
        self.stop_table = np.zeros(V, bool)
        self.stop_table[[i for i in sc.stop_token_ids if 0 <= i < V]] = True
        self.pause_table = np.zeros(V, bool) if pause_table is None else np.asarray(pause_table, bool)
        self.max_forced_tokens = max(1, max_forced_tokens)
        self.queue: collections.deque = collections.deque()  # (request, prompt index, its sequences)
        self.ready: collections.deque = collections.deque()
        self.running: list[Sequence] = []
        self._admitted = 0
        self._epoch = -1  # update_params calls less one; a sequence's KV is stale when its epoch differs
        # calls, steps, row_steps (row_steps_empty: of slots without a sequence at a call's start), preempted,
        # prefills; refills and recomputed_tokens: the KV recomputed at weight swaps
        self.stats = collections.Counter()
        # A decode call returns as soon as a sequence ends while others wait for a slot (else after its steps).
        self.refill_at_once = True
        self.default_rule = SamplingRule.of(sc)  # a request's rule unless it sets its own (and idle slots')
        self.update_params(params, version)

    def _init_pages(self, params: Params, num_pages: int):
        """The backend's page pools, zeros, on the params' devices (over their mesh as ``abstract_pool`` says)."""
        init, sharding = _pool(params, self.cfg, self.sc, self.backend, num_pages)
        return _zeros_program(self.backend, init.args, sharding)()

    def update_params(self, params: Params, version: int) -> None:
        """The params the next decode calls and prefills read (not copied) and their version. Queued, ready,
        running and paused sequences are kept: their later tokens are this version's. The keys and values of
        those already prefilled were computed by the older params, so before a sequence decodes again its whole
        context (prompt and tokens so far) is recomputed under these into its own pages (``refill``, as AReaL's
        interruptible generation does): each later token's logprob is then exactly this version's, the one it
        records. The cost shows in ``stats["recomputed_tokens"]``."""
        self.params, self.version = params, version
        self._epoch += 1
        self._prepared = None
        if self.backend.prepares_once:  # costly preparations (the CPU kernels' packing): once per version
            num_slots = self.sc.max_prompt_length + self.sc.max_completion_length
            fn = _compiled(_prepare, ("cfg", "backend", "num_slots"), self.backend.compiler_options)
            self._prepared = fn(params, self.cfg, self.backend, num_slots)

    def submit(
        self,
        prompts: list[list[int]],
        key: jax.Array,
        num_generations: int = 1,
        *,
        pauses: bool = False,
        turn_budget: int = 0,
        max_completion_length: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        greedy: bool | None = None,
    ) -> Request:
        """Queues G completions of each prompt; returns their ``Request`` (rows grouped, row i answers prompt
        i // G).

        The length limit and the sampling fields are this request's own: its rows share decode calls with
        other requests' rows of other settings (each row samples by its own rule, as data: nothing compiles per
        setting). Unset (None), each is the engine's ``SamplerConfig`` value.

        Args:
          prompts: N token-id lists, each 1..max_prompt_length tokens (``prepare_prompts`` truncates).
          key: PRNG key of the request: token n of row r draws the noise of fold_in(fold_in(key, n), r).
          num_generations: G completions per prompt (the prompt prefilled once, its full pages shared).
          pauses: segments end at stop tokens, pause tokens and turn budgets with the sequence paused (its pages
            kept) until ``resume`` or ``finish`` (multi-turn); else a stop token or the length limit ends it.
          turn_budget: tokens per turn at most (pausing sequences; 0 = the length limit).
          max_completion_length: new tokens per row at most, 1..the engine's max_completion_length.
          temperature: > 0, divides the logits (logprobs are of the scaled, filtered distribution).
          top_k: tokens kept, >= 0 (0 = off).
          top_p: nucleus mass in (0, 1] (1.0 = off).
          greedy: argmax (temperature, top_k and top_p ignored; logprobs at temperature 1).

        Raises:
          ValueError: an empty prompt or one longer than max_prompt_length; num_generations above the decode
            slots; a length limit or sampling value out of range (one line naming the argument); nothing is
            queued then.
        """
        sc = self.sc
        if not 1 <= num_generations <= self.num_slots:
            raise ValueError(
                f"num_generations={num_generations}: expected 1..{self.num_slots} (the engine's decode slots, "
                "max_num_seqs: a prompt's completions start together)"
            )
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= sc.max_prompt_length:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens: expected 1..max_prompt_length={sc.max_prompt_length} "
                    "(prepare_prompts truncates)"
                )
        limit = sc.max_completion_length if max_completion_length is None else max_completion_length
        integer = isinstance(limit, int | np.integer) and not isinstance(limit, bool)
        if not integer or not 1 <= limit <= sc.max_completion_length:
            raise ValueError(
                f"max_completion_length={limit!r}: expected an integer in 1..{sc.max_completion_length} tokens "
                "(the engine's max_completion_length; build the engine with a larger one for longer rows)"
            )
        rule = self.default_rule
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
        given = {name: value for name, value in given.items() if value is not None}
        if given:  # the SamplerConfig's checks (one line each), on the engine's values with these replaced
            rule = SamplingRule.of(dataclasses.replace(sc, **given))
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        key_data = np.asarray(distributed.fetch(jax.random.key_data(key)))
        route_shape = None
        if getattr(self.backend, "record_routes", False):
            cfg = self.cfg
            route_shape = (cfg.num_layers, cfg.num_experts_per_tok, route_dtype(cfg.num_experts))
        request = Request(
            [list(p) for p in prompts], key_data, str(jax.random.key_impl(key)), num_generations, pauses,
            turn_budget or int(limit), int(limit), rule, route_shape,
        )  # fmt: skip
        G = num_generations
        for i in range(len(prompts)):
            self.queue.append((request, i, request.sequences[i * G : (i + 1) * G]))
        return request

    @property
    def busy(self) -> bool:
        """Whether a sequence is queued, ready or running (paused ones wait for the caller)."""
        return bool(self.queue or self.ready or self.running)

    def run(self, request: Request | None = None) -> list[Sequence]:
        """Steps until ``request`` is done (or nothing is left to run); returns the sequences that paused."""
        paused = []
        while self.busy and (request is None or not request.done):
            paused += self.step()
            if request is not None and request.pauses and paused:
                break
        return paused

    def step(self) -> list[Sequence]:
        """One round: prefill queued prompts into free slots, then one decode call; returns the sequences whose
        segment paused in it (requests submitted with ``pauses``)."""
        paused = self._admit()
        while self.ready and len(self.running) < self.num_slots:
            seq = self.ready.popleft()
            seq.state = "running"
            self.running.append(seq)
        stale = [seq for seq in self.running if seq.kv_epoch != self._epoch]
        if stale:
            self._refill(stale)
        if self.running:
            paused += self._decode()
        return paused

    def resume(self, seq: Sequence, tokens: list[int] = (), turn_budget: int | None = None) -> None:
        """Continues a paused sequence: ``tokens`` (an observation, at most max_forced_tokens) are fed through the
        decode into its own pages (mask 0, logprob 0), then it samples again: a new turn of ``turn_budget``
        tokens at most after them, or (None) the rest of its current turn."""
        assert seq.state == "paused" and len(tokens) <= self.max_forced_tokens, (seq.state, len(tokens))
        seq.forced, seq.forced_pos = list(tokens), 0
        if turn_budget is not None:
            seq.turn_end = min(seq.n + len(tokens) + turn_budget, seq.request.limit)
        seq.reason, seq.state = programs.RUNNING, "ready"
        self.ready.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Ends a paused sequence (its pages freed)."""
        assert seq.state == "paused", seq.state
        self._end(seq)

    def cancel(self, request: Request) -> None:
        """Drops every sequence of ``request`` that has not finished (queued, ready, running or paused)."""
        self.queue = collections.deque(e for e in self.queue if e[0] is not request)
        self.ready = collections.deque(s for s in self.ready if s.request is not request)
        self.running = [s for s in self.running if s.request is not request]
        for seq in request.sequences:
            if seq.state != "done":
                self._end(seq)

    def _end(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages, seq.state = [], "done"

    # -- admission -------------------------------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        """Prefills queued prompts while free slots (and pages, beyond a reserve for the running sequences'
        growth) allow: one prefill call, or (the fixed program set, ``max_prefill_prompts``) as many calls of at most
        ``_prefill_cap`` prompts as the slots take; returns the sequences that paused at their first token."""
        paused = []
        while batch := self._next_batch():
            paused += self._prefill(batch)
            if not (self.fixed or self.sc.max_prefill_prompts):
                break
        return paused

    def _prefill_cap(self, num_generations: int) -> int:
        """The most prompts of ``num_generations`` completions one prefill call takes: ``max_prefill_prompts``
        where set, and with the fixed set its program's prompt count; else no cap (the count is rounded up to a
        power of two)."""
        cap = self.sc.max_prefill_prompts or self.num_slots
        if not self.fixed:
            return cap
        return min(cap, fixed_prefill_prompts(self.num_slots, program_group(self.sc, True, num_generations)))

    def _next_batch(self) -> list:
        """The queue entries the next prefill call admits (one group size and key kind): [] if none."""
        sc, ps = self.sc, self.sc.page_size
        free_slots = self.num_slots - len(self.running) - len(self.ready)
        batch, pages_left = [], self.pool.num_free
        growth = -(-sc.decode_steps_per_call // ps)  # pages a sequence may take in the next call at most
        in_flight = len(self.running) + len(self.ready)
        while self.queue and free_slots > 0:
            request, i, seqs = self.queue[0]
            if batch and (len(seqs), request.key_impl) != (len(batch[0][2]), batch[0][0].key_impl):
                break  # one program per group size and key kind
            if len(batch) == self._prefill_cap(len(seqs)):
                break
            need = self._prompt_pages(len(request.prompts[i]), len(seqs))
            if need > pages_left or pages_left - need < (in_flight + len(seqs)) * growth:
                if in_flight or batch:
                    break  # running sequences will free pages
                if need > pages_left:
                    raise ValueError(
                        f"num_pages={self.pool.num_pages}: the KV pool cannot hold a prompt of "
                        f"{len(request.prompts[i])} tokens for {len(seqs)} completions; raise it"
                    )
            pages_left -= need
            free_slots -= len(seqs)
            in_flight += len(seqs)
            batch.append(self.queue.popleft())
        return batch

    def _rules(self, rules: list[SamplingRule], size: int) -> dict[str, np.ndarray] | None:
        """A program's ``rule`` for rows sampled by ``rules`` (rows past them: the engine's), [size] per field; None
        where every row's is the engine's (the static program: the GRPO rollout's, unchanged) and rules are not data
        (``rules_as_data``, the fixed set)."""
        if not (self.fixed or self.sc.rules_as_data) and all(rule == self.default_rule for rule in rules):
            return None
        rows = [*rules, *[self.default_rule] * (size - len(rules))]
        dtypes = (np.float32, np.int32, np.float32)
        return {
            name: np.asarray(column, dtype)
            for name, column, dtype in zip(programs.RULE_FIELDS, zip(*rows, strict=True), dtypes, strict=True)
        }

    def _prompt_pages(self, length: int, count: int) -> int:
        """Pages a prompt of ``length`` tokens takes for ``count`` completions: its full pages (shared when
        count > 1) and each completion's copy of its partial last page."""
        full, tail = divmod(length, self.sc.page_size)
        return (full if count > 1 else -(-length // self.sc.page_size)) + (count if tail and count > 1 else 0)

    def _prefill(self, batch: list) -> list[Sequence]:
        """Runs ``admit`` for the queue entries ``batch`` (one group size G); returns the paused sequences."""
        sc = self.sc
        G = program_group(sc, self.fixed, len(batch[0][2]))  # rows per prompt in the program
        prompts = [req.prompts[i] for req, i, _ in batch]
        N = pow2(len(prompts))  # prompt counts rounded up to a power of two: few compiles
        if self.fixed:  # one prefill program per group size
            N = max(N, fixed_prefill_prompts(self.num_slots, G))
        P = self.prompt_width(prompts)
        tokens = np.full((N, P), sc.pad_token_id, np.int32)
        lengths = np.ones((N,), np.int32)
        dest = np.full((N, G, P), self.pool.num_pages, np.int32)  # past the pool: not written
        key_data = np.zeros((N * G, *batch[0][0].key_data.shape), batch[0][0].key_data.dtype)
        rows = np.zeros((N * G,), np.int32)
        # rows past the batch repeat its first prompt (a shared prefix stays shared) and write nothing
        tokens[:, : len(prompts[0])], lengths[:] = prompts[0], len(prompts[0])
        for j, ((request, _, seqs), prompt) in enumerate(zip(batch, prompts, strict=True)):
            L = len(prompt)
            tokens[j], lengths[j] = sc.pad_token_id, L
            tokens[j, :L] = prompt
            self._place_prompt(seqs, L, dest[j])
            for g, seq in enumerate(seqs):
                key_data[j * G + g], rows[j * G + g] = request.key_data, seq.index
        plan = self.backend.plan(tokens, lengths)
        fn = compiled_admit(self.backend)
        rule = self._rules([req.rule for req, _, seqs in batch for _ in seqs], N * G)
        self.pages, token, logprob, routes = fn(
            self.params, self.pages, *self._put((tokens, lengths, dest, key_data, rows, rule)),
            cfg=self.cfg, sampler_cfg=self.program_cfg, num_generations=G, backend=self.backend, plan=plan,
            key_impl=batch[0][0].key_impl,
        )  # fmt: skip
        token, logprob, routes = distributed.fetch((token, logprob, routes))
        self.stats["prefills"] += 1
        paused = []
        for j, (request, i, seqs) in enumerate(batch):
            if routes is not None:
                request.prompt_routes[i] = np.asarray(routes[j, : len(request.prompts[i])])
            for g, seq in enumerate(seqs):
                self._admitted += 1
                seq.order, seq.kv_epoch = self._admitted, self._epoch
                seq.turn_end = min(request.turn_budget, request.limit)
                self._record(seq, int(token[j * G + g]), float(logprob[j * G + g]), True)
                reason = self._first_reason(seq)
                if reason == programs.RUNNING:
                    seq.state = "ready"
                    self.ready.append(seq)
                elif self._segment_ended(seq, reason):
                    paused.append(seq)
        return paused

    def prompt_width(self, prompts: list[list[int]]) -> int:
        """The padding of ``prompts`` in a prefill and in an output (``Request.output``): the bucket of the
        longest, or with the fixed program set max_prompt_length (unless prompt_length_buckets are given)."""
        if self.fixed and not self.sc.prompt_length_buckets:
            return self.sc.max_prompt_length
        return self.sc.bucket_for(max(map(len, prompts)))

    def _place_prompt(self, seqs: list[Sequence], length: int, dest: np.ndarray) -> None:
        """Takes the pages of a prompt of ``length`` tokens for its completions ``seqs`` and fills ``dest``
        int32 [G, P] with each prompt token's page per completion."""
        ps, count = self.sc.page_size, len(seqs)
        full, tail = divmod(length, ps)
        shared = full if count > 1 else 0
        own = -(-length // ps) - shared  # each completion's pages of the prompt (its partial last one)
        pages = self.pool.allocate(shared + own * count)
        assert pages is not None, "admission checked the free pages"
        common, rest = pages[:shared], pages[shared:]
        if shared:
            self.pool.retain(common * (count - 1))  # one reference per completion
        for g, seq in enumerate(seqs):
            seq.pages = common + rest[g * own : (g + 1) * own]
            t = np.arange(length)
            table = np.asarray(seq.pages, np.int32)
            dest[g, :length] = table[t // ps]
            if g > 0:  # the shared pages are written once, by completion 0
                dest[g, : shared * ps] = self.pool.num_pages

    def _first_reason(self, seq: Sequence) -> int:
        """``decode.segment_end`` of a sequence's first token (sampled by the prefill)."""
        token, n = seq.tokens[-1], seq.n
        if self.stop_table[token]:
            return programs.STOP
        if seq.request.pauses and self.pause_table[token]:
            return programs.PAUSE
        if n >= seq.request.limit:
            return programs.LENGTH
        if n >= seq.turn_end:
            return programs.TURN
        return programs.RUNNING

    def _record(self, seq: Sequence, token: int, logprob: float, model: bool) -> None:
        seq.tokens.append(token)
        seq.logprobs.append(logprob if model else 0.0)
        seq.model.append(model)
        seq.versions.append(self.version)

    def _segment_ended(self, seq: Sequence, reason: int) -> bool:
        """Ends or pauses a sequence whose segment ended for ``reason``; True when it paused."""
        seq.reason = reason
        if seq.request.pauses and reason != programs.LENGTH:
            seq.state = "paused"
            return True
        self._end(seq)
        return False

    # -- weight swaps ----------------------------------------------------------------------------------------

    def _refill(self, seqs: list[Sequence]) -> None:
        """Recomputes the keys and values of ``seqs`` (prefilled under older params) under the current ones, in
        calls of at most ``REFILL_TOKENS`` padded context tokens, rows of similar lengths together."""
        ps, outside = self.sc.page_size, self.pool.num_pages
        written: set[int] = set()  # pages this pass writes already: a prompt's shared pages are written once
        rows = []
        for seq in sorted(seqs, key=lambda q: len(q.prompt) + q.n):
            context = seq.prompt + seq.tokens[: seq.n - 1]  # the last token: fed (and written) by the decode
            pages = np.asarray(seq.pages, np.int32)[np.arange(len(context)) // ps]
            dest = np.where(np.isin(pages, list(written)), outside, pages)
            written.update(seq.pages[: -(-len(context) // ps)])
            rows.append((context, dest))
            seq.kv_epoch = self._epoch
        while rows:  # the shortest row left sets the width T (a power of two); rows that fit join it
            T = min(self.table_width * ps, pow2(len(rows[0][0])))
            count = 1
            while count < len(rows) and len(rows[count][0]) <= T and pow2(count + 1) * T <= REFILL_TOKENS:
                count += 1
            self._refill_call(rows[:count], T)
            rows = rows[count:]

    def _refill_call(self, rows: list[tuple[list[int], np.ndarray]], T: int) -> None:
        """One ``refill`` call: (context tokens, their pages) per row, padded to ``T`` tokens and a power of two
        of rows (rows past them repeat the first one's context and write nothing)."""
        R = pow2(len(rows))
        tokens = np.full((R, T), self.sc.pad_token_id, np.int32)
        lengths = np.full((R,), len(rows[0][0]), np.int32)
        dest = np.full((R, T), self.pool.num_pages, np.int32)
        tokens[:, : len(rows[0][0])] = rows[0][0]
        for r, (context, pages) in enumerate(rows):
            tokens[r], lengths[r] = self.sc.pad_token_id, len(context)
            tokens[r, : len(context)], dest[r, : len(context)] = context, pages
        fn = compiled_refill(self.backend)
        self.pages = fn(
            self.params, self.pages, tokens, lengths, dest,
            cfg=self.cfg, sampler_cfg=self.program_cfg, backend=self.backend, plan=self.backend.plan(tokens, lengths),
        )  # fmt: skip
        self.stats["refills"] += 1
        self.stats["recomputed_tokens"] += int(sum(len(context) for context, _ in rows))

    # -- decode ----------------------------------------------------------------------------------------------

    def _grow(self, k: int) -> None:
        """Gives every running sequence the pages its next ``k`` decode steps write, preempting the newest
        sequences while the pool is short."""
        ps = self.sc.page_size
        while True:
            short = []
            for seq in self.running:
                need = call_pages(len(seq.prompt), seq.n, k, seq.request.limit, ps)
                short.append(max(0, need - len(seq.pages)))
            if sum(short) <= self.pool.num_free:
                for seq, count in zip(self.running, short, strict=True):
                    if count:
                        seq.pages += self.pool.allocate(count)
                return
            if len(self.running) == 1 and not self.ready:
                raise ValueError(
                    f"num_pages={self.pool.num_pages}: the KV pool cannot hold one sequence's pages; raise it"
                )
            self._preempt()

    def _preempt(self) -> None:
        """Frees the newest running (else ready) sequence and queues it to restart from its prompt."""
        pool = self.running if self.running else list(self.ready)
        seq = max(pool, key=lambda s: s.order)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.ready.remove(seq)
        self.pool.release(seq.pages)
        seq.reset()
        self.queue.appendleft((seq.request, seq.index // seq.request.num_generations, [seq]))
        self.stats["preempted"] += 1

    @property
    def _retires(self) -> bool:
        """Whether decode calls shrink to the smallest slot count that holds the running sequences
        (``retire_rows``; never with the fixed program set)."""
        return self.sc.retire_rows and not self.fixed

    def _exit_after(self, S: int, waiting: bool, pausing: bool) -> int:
        """How many segments may end in a decode call on ``S`` slots before it returns: 1 where a sequence waits
        for a slot (refilled at once) or segments pause (the host answers them); with nothing waiting and
        ``retire_rows``, as many as leave the running sequences fitting the next smaller slot count
        (``slot_counts``: the next call runs on it; the slots of ended sequences idle until then); else none
        (all its steps)."""
        if (waiting and self.refill_at_once) or pausing:
            return 1
        smaller = [b for b in slot_counts(self.num_slots, self.sc.slot_count_step) if b < S]
        if self._retires and not waiting and smaller:
            return len(self.running) - smaller[0]  # >= 1: S is the smallest count that holds them
        return S + 1

    def _decode(self) -> list[Sequence]:
        """One decode call on the running sequences; returns the ones that paused."""
        sc = self.sc
        k = sc.decode_steps_per_call
        self._grow(k)
        waiting = bool(self.queue or self.ready)
        S = call_slots(self.num_slots, len(self.running), waiting, self._retires, sc.slot_count_step)
        width = self.table_width
        if not (self.backend.reads_filled_pages or self.fixed):
            longest = max(len(s.pages) for s in self.running)
            width = gathered_width(longest, self.table_width, sc.page_size, sc.decode_phase_length)
        slots = self._slots(S, width)
        pausing = any(seq.request.pauses for seq in self.running)
        exit_after = np.int32(self._exit_after(S, waiting, pausing))
        prepared = self._prepared if self.backend.prepares_once else self.params
        fn = compiled_decode(self.backend)
        key_impl = self.running[0].request.key_impl
        rule = self._rules([seq.request.rule for seq in self.running], S)
        self.pages, out = fn(
            prepared, self.pages, *self._put((slots, rule, self.stop_table, self.pause_table, exit_after)),
            cfg=self.cfg, sampler_cfg=self.program_cfg, backend=self.backend, num_steps=k, key_impl=key_impl,
        )  # fmt: skip
        out = distributed.fetch(out)
        steps = int(out["steps"])
        self.stats["calls"] += 1
        self.stats["steps"] += steps
        self.stats["row_steps"] += S * steps
        self.stats["row_steps_empty"] += (S - len(self.running)) * steps  # slots without a sequence
        return self._collect(out, S * steps)

    def _slots(self, S: int, width: int) -> dict[str, np.ndarray]:
        """The decode program's per-slot inputs: the running sequences in its first slots, the rest idle."""
        F = self.max_forced_tokens
        slots = {
            "token": np.zeros((S,), np.int32),
            "n": np.ones((S,), np.int32),
            "prompt_length": np.ones((S,), np.int32),
            "active": np.zeros((S,), bool),
            "rows": np.zeros((S,), np.int32),
            "key_data": np.zeros((S, *self.running[0].request.key_data.shape), np.uint32),
            "page_table": np.zeros((S, width), np.int32),
            "forced": np.zeros((S, F), np.int32),
            "num_forced": np.zeros((S,), np.int32),
            "forced_pos": np.zeros((S,), np.int32),
            "turn_end": np.zeros((S,), np.int32),
            "limit": np.ones((S,), np.int32),
            "pauses": np.zeros((S,), bool),
        }
        for s, seq in enumerate(self.running):
            slots["token"][s], slots["n"][s], slots["prompt_length"][s] = (
                seq.tokens[-1],
                seq.n,
                len(seq.prompt),
            )
            slots["active"][s], slots["rows"][s], slots["key_data"][s] = True, seq.index, seq.request.key_data
            slots["page_table"][s, : min(width, len(seq.pages))] = seq.pages[:width]
            slots["forced"][s, : len(seq.forced)] = seq.forced
            slots["num_forced"][s], slots["forced_pos"][s] = len(seq.forced), seq.forced_pos
            slots["turn_end"][s], slots["limit"][s] = seq.turn_end, seq.request.limit
            slots["pauses"][s] = seq.request.pauses
        return slots

    def _collect(self, out: dict[str, np.ndarray], row_steps: int) -> list[Sequence]:
        """Records a decode call's tokens into its sequences (``row_steps``: its slots x steps), keeps the ones
        still running and returns the ones that paused."""
        paused, still = [], []
        for s, seq in enumerate(self.running):
            wrote = np.flatnonzero(out["wrote"][s])
            for i in wrote:
                if "routes" in out:  # the experts of the token fed at step i: its last one
                    seq.routes.append(out["routes"][s, i])
                self._record(
                    seq, int(out["tokens"][s, i]), float(out["logprobs"][s, i]), bool(out["model"][s, i])
                )
            seq.request.row_steps += len(wrote)
            seq.forced_pos = int(out["forced_pos"][s])
            if seq.forced_pos >= len(seq.forced):
                seq.forced, seq.forced_pos = [], 0
            reason = int(out["reason"][s])
            if reason == programs.RUNNING:
                still.append(seq)
            elif self._segment_ended(seq, reason):
                paused.append(seq)
        idle = row_steps - int(out["wrote"].sum())
        oldest = min(self.running, key=lambda q: q.order).request
        oldest.row_steps += idle  # idle slots' steps count against the oldest request in flight
        self.running = still
        return paused


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
    num_slots: int | None = None,
) -> GenerateOutput:
    """Samples ``num_generations`` completions per prompt (a GRPO group), rows grouped contiguously.

    Args:
      params: model params.
      prompts: N token-id lists (no padding).
      cfg: model config.
      sampler_cfg: sampling settings; prompts are padded to ``Engine.prompt_width`` tokens (the longest's bucket,
        or max_prompt_length with the fixed program set).
      key: PRNG key (one per call; rows get independent noise).
      num_generations: G completions per prompt; row i answers prompt i // G (each prompt is prefilled once).
      num_slots: the engine's decode slots where ``max_num_seqs`` is 0; default every row at once (a caller of
        batches passes its full batch's rows, so that a short last batch runs the same programs).

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
    rows = max(num_slots or 0, len(kept) * num_generations)
    if sc.max_num_seqs > rows:  # slots (and their pages) past the call's rows would never hold a sequence
        sc = dataclasses.replace(sc, max_num_seqs=rows)
    engine = Engine(params, cfg, sc, num_slots=rows)
    request = engine.submit(kept, key, num_generations)
    engine.run(request)
    out = request.output(sc.pad_token_id, engine.prompt_width(kept), sc.max_completion_length)
    del engine, request
    release_host_memory()  # the page pool's buffers: before the next call allocates
    return out._replace(prompt_indices=np.array(indices, np.int32))
