"""The engine's scheduler: which sequences wait, which hold a decode slot, and whose pages go where (host state
only; the engine runs the programs).

Sequences enter a queue at ``Engine.submit`` (one entry per prompt: its G completions start together), are
admitted in prefill batches while free slots and pages allow (``next_batch``, keeping a reserve of pages for the
running sequences' growth), wait "ready" for a slot, and run until their segment ends. Before each decode call
every running sequence gets the pages the call may write (``grow``); while the pool is short the newest
sequence is preempted (``preempt``) and restarted later from its prompt. When no sequence waits, decode calls
run on the smallest slot count that holds the running ones (``call_slots``, ``exit_after``). The policy is
vLLM's scheduler (Kwon et al. 2023) without swapping: a preempted sequence recomputes.
"""

from __future__ import annotations

import collections

import numpy as np

from grpax.sampler import decode
from grpax.sampler.keys import (
    SamplerConfig,
    call_pages,
    call_slots,
    fixed_prefill_prompts,
    program_group,
    slot_counts,
)
from grpax.sampler.paging import PagePool
from grpax.sampler.requests import Request, Sequence


class Scheduler:
    """The queue, the ready and running sequences and the page pool of one engine.

    Args:
      sampler_cfg: the engine's settings (page_size, decode_steps_per_call, retire_rows, max_prefill_prompts).
      num_slots: decode slots.
      fixed: whether the engine runs the fixed program set (``grpax.sampler.program_set.fixed_programs``).
      num_pages: pages in the pool (``grpax.sampler.paging.engine_pool_pages``).
      stats: the engine's counters (``preempted`` is counted here).
    """

    def __init__(self, sampler_cfg: SamplerConfig, num_slots: int, fixed: bool, num_pages: int, stats):
        self.sc, self.num_slots, self.fixed, self.stats = sampler_cfg, num_slots, fixed, stats
        self.pool = PagePool(num_pages)
        self.queue: collections.deque = collections.deque()  # (request, prompt index, its sequences)
        self.ready: collections.deque = collections.deque()
        self.running: list[Sequence] = []
        self.admitted = 0  # sequences admitted so far: each one's order (preemption takes the newest)
        # A decode call returns as soon as a sequence ends while others wait for a slot (else after its steps).
        self.refill_at_once = True

    # -- the views ---------------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a sequence is queued, ready or running (paused ones wait for the caller)."""
        return bool(self.queue or self.ready or self.running)

    def waiting(self, request: Request | None = None) -> bool:
        """Whether a sequence (of ``request``, where given) waits for a slot: queued or ready."""
        if request is None:
            return bool(self.queue or self.ready)
        return any(entry[0] is request for entry in self.queue) or any(
            s.request is request for s in self.ready
        )

    @property
    def num_in_flight(self) -> int:
        """Sequences queued, ready or running."""
        return len(self.running) + len(self.ready) + sum(len(entry[2]) for entry in self.queue)

    # -- moves -------------------------------------------------------------------------------------------------

    def enqueue(self, request: Request) -> None:
        """Queues each prompt of ``request`` with its G sequences."""
        G = request.num_generations
        for i in range(len(request.prompts)):
            self.queue.append((request, i, request.sequences[i * G : (i + 1) * G]))

    def make_ready(self, seq: Sequence) -> None:
        """``seq`` (prefilled, or resumed) waits for a slot."""
        seq.state = "ready"
        self.ready.append(seq)

    def start_ready(self) -> None:
        """Moves ready sequences into free slots."""
        while self.ready and len(self.running) < self.num_slots:
            seq = self.ready.popleft()
            seq.state = "running"
            self.running.append(seq)

    def end(self, seq: Sequence) -> None:
        """Ends ``seq`` (its pages freed)."""
        self.pool.release(seq.pages)
        seq.pages, seq.state = [], "done"

    def segment_ended(self, seq: Sequence, reason: int) -> bool:
        """Ends or pauses a sequence whose segment ended for ``reason``; True when it paused."""
        seq.reason = reason
        if seq.request.pauses and reason != decode.LENGTH:
            seq.state = "paused"
            return True
        self.end(seq)
        return False

    def cancel(self, request: Request) -> None:
        """Drops every sequence of ``request`` that has not finished (queued, ready, running or paused)."""
        self.queue = collections.deque(e for e in self.queue if e[0] is not request)
        self.ready = collections.deque(s for s in self.ready if s.request is not request)
        self.running = [s for s in self.running if s.request is not request]
        for seq in request.sequences:
            if seq.state != "done":
                self.end(seq)

    # -- admission ---------------------------------------------------------------------------------------------

    def prefill_cap(self, num_generations: int) -> int:
        """The most prompts of ``num_generations`` completions one prefill call takes: ``max_prefill_prompts``
        where set, and with the fixed set its program's prompt count; else no cap (the count is rounded up to a
        power of two)."""
        cap = self.sc.max_prefill_prompts or self.num_slots
        if not self.fixed:
            return cap
        return min(cap, fixed_prefill_prompts(self.num_slots, program_group(self.sc, True, num_generations)))

    def next_batch(self) -> list:
        """The queue entries the next prefill call admits (one group size and key kind): [] if none.

        Raises:
          ValueError: the pool cannot hold the first waiting prompt even with nothing else in flight.
        """
        sc, ps = self.sc, self.sc.page_size
        free_slots = self.num_slots - len(self.running) - len(self.ready)
        batch, pages_left = [], self.pool.num_free
        growth = -(-sc.decode_steps_per_call // ps)  # pages a sequence may take in the next call at most
        in_flight = len(self.running) + len(self.ready)
        while self.queue and free_slots > 0:
            request, i, seqs = self.queue[0]
            if batch and (len(seqs), request.key_impl) != (len(batch[0][2]), batch[0][0].key_impl):
                break  # one program per group size and key kind
            if len(batch) == self.prefill_cap(len(seqs)):
                break
            need = self.prompt_pages(len(request.prompts[i]), len(seqs))
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

    def prompt_pages(self, length: int, count: int) -> int:
        """Pages a prompt of ``length`` tokens takes for ``count`` completions: its full pages (shared when
        count > 1) and each completion's copy of its partial last page."""
        full, tail = divmod(length, self.sc.page_size)
        return (full if count > 1 else -(-length // self.sc.page_size)) + (count if tail and count > 1 else 0)

    def place_prompt(self, seqs: list[Sequence], length: int, dest: np.ndarray) -> None:
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

    # -- decode calls ------------------------------------------------------------------------------------------

    def grow(self, k: int) -> None:
        """Gives every running sequence the pages its next ``k`` decode steps write, preempting the newest
        sequences while the pool is short.

        Raises:
          ValueError: the pool cannot hold one sequence's pages.
        """
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
            self.preempt()

    def preempt(self) -> None:
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
    def retires(self) -> bool:
        """Whether decode calls shrink to the smallest slot count that holds the running sequences
        (``retire_rows``; never with the fixed program set)."""
        return self.sc.retire_rows and not self.fixed

    def call_slots(self, waiting: bool) -> int:
        """Slots the next decode call runs on (``grpax.sampler.keys.call_slots``)."""
        return call_slots(self.num_slots, len(self.running), waiting, self.retires, self.sc.slot_count_step)

    def exit_after(self, S: int, waiting: bool, pausing: bool) -> int:
        """How many segments may end in a decode call on ``S`` slots before it returns: 1 where a sequence waits
        for a slot (refilled at once) or segments pause (the host answers them); with nothing waiting and
        ``retire_rows``, as many as leave the running sequences fitting the next smaller slot count
        (``slot_counts``: the next call runs on it; the slots of ended sequences idle until then); else none
        (all its steps)."""
        if (waiting and self.refill_at_once) or pausing:
            return 1
        smaller = [b for b in slot_counts(self.num_slots, self.sc.slot_count_step) if b < S]
        if self.retires and not waiting and smaller:
            return len(self.running) - smaller[0]  # >= 1: S is the smallest count that holds them
        return S + 1

    def pack(self, S: int, width: int, F: int) -> dict[str, np.ndarray]:
        """The decode program's per-slot inputs on ``S`` slots (page tables ``width`` pages wide, ``F`` forced
        tokens at most): the running sequences in its first slots, the rest idle."""
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
