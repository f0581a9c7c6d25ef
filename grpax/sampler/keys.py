"""The sampler's keys and buckets: ``SamplerConfig``, the shape ladders its programs are compiled for, and the one
builder of ``train_rl``'s, ``evaluate``'s, ``generate``'s and ``serve``'s config from MaxText's decode keys.

Every shape the engine compiles a program for is rounded here, once: a prefill's prompt count to a power of two
(``pow2``), its prompt padding to a bucket (``SamplerConfig.buckets``; a server's doubling ones,
``bucket_lengths``), a decode call's slots to a count of ``slot_counts``, its page-table width to
``gathered_width``. The engine (``grpax.sampler.engine``), the program set (``grpax.sampler.program_set``), the
planner (``grpax.plan``) and the server's warm-up (``grpax.serve.worker``) read these functions, so what one
plans is what another runs.

The commands name the sampler's budgets as MaxText does (``max_prefill_predict_length``; the completion budget
from ``max_target_length``) and take the stop tokens from the tokenizer and the model
(``grpax.data.tokenizer.stop_token_ids``). A finished row is padded with the model's ``pad_token_id``, else
with its first stop token (else 0): the mask, not this id, marks real tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from grpax.sampler.backend import BACKENDS

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


def prefill_prompts(sampler_cfg: SamplerConfig, num_prompts: int, num_generations: int) -> int:
    """The most prompts one prefill of a ``num_prompts`` x G rollout takes (a power of two, as ``Engine``'s prefill
    rounds them): all of them, or with fewer decode slots (``max_num_seqs``) the groups that fill the slots
    (``Scheduler.next_batch`` starts a group while a slot is free). ``abstract_programs`` and the planner size the prefill so."""
    G = num_generations
    admitted = min(num_prompts, -(-sampler_cfg.decode_slots(num_prompts * G) // G))
    return pow2(admitted)


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


def powers_of_two(top: int) -> list[int]:
    """1, 2, 4, ... up to ``pow2(top)``, ascending: every prompt count a prefill of at most ``top`` prompts runs
    (``pow2`` rounds each call's)."""
    return [1 << i for i in range(pow2(top).bit_length())]


def doubling_lengths(longest: int, first: int = 64) -> tuple[int, ...]:
    """Paddings ``first``, 2 x ``first``, 4 x ``first``, ... below ``longest`` tokens, then ``longest``."""
    lengths, t = [], first
    while t < longest:
        lengths.append(t)
        t *= 2
    return (*lengths, longest)


def bucket_lengths(max_prompt_length: int) -> tuple[int, ...]:
    """Prompt paddings of a server (``grpax.serve.worker.bounded``): 64, 128, 256... tokens, the last one
    ``max_prompt_length``."""
    return doubling_lengths(max_prompt_length)


def scoring_lengths(max_prompt_length: int, max_completion_length: int) -> tuple[int, ...]:
    """Paddings of a server's scoring forward (``top_logprobs``): 64, 128, 256... tokens, the last one the server's
    longest sequence rounded up to 64."""
    return doubling_lengths(-(-(max_prompt_length + max_completion_length) // 64) * 64)


def prefill_counts(max_prefill_prompts: int, num_slots: int) -> list[int]:
    """The prompt counts of a server's prefills: the powers of two up to ``max_prefill_prompts`` (at most the
    slots) rounded up to one, as the engine rounds a call's prompts, ascending."""
    return powers_of_two(min(max_prefill_prompts or num_slots, num_slots))


def sampler_config(
    max_prefill_predict_length: int,
    max_completion_length: int,
    stop_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    **sampling: Any,
) -> SamplerConfig:
    """The ``SamplerConfig`` of a command's keys.

    Args:
      max_prefill_predict_length: max prompt tokens (``SamplerConfig.max_prompt_length``).
      max_completion_length: new tokens per row at most (tokens).
      stop_token_ids: ids that end a row.
      pad_token_id: the model's pad id; None: the first stop token, else 0.
      **sampling: the other ``SamplerConfig`` fields (temperature, top_k, top_p, greedy, ...).

    Raises:
      ValueError: a value ``SamplerConfig`` refuses.
    """
    if pad_token_id is None:
        pad_token_id = stop_token_ids[0] if stop_token_ids else 0
    return SamplerConfig(
        max_prompt_length=max_prefill_predict_length,
        max_completion_length=max_completion_length,
        stop_token_ids=tuple(stop_token_ids),
        pad_token_id=pad_token_id,
        **sampling,
    )
