"""The rollout engine: a paged KV cache and continuous batching, driven from the host around two compiled programs.

GRPO spends most of its wall time sampling, and completion lengths are long-tailed, so the engine keeps memory
and decode work on the tokens that exist. The KV cache is a pool of fixed-size pages (``page_size`` tokens; per
layer one buffer, laid out by the backend), and each sequence owns a page table: its prompt's full pages, shared
by the G completions of a GRPO group (written once), then pages of its own, taken from the pool as it grows and
returned when it ends. Sequences decode in a fixed number of slots (``max_num_seqs``): the host hands each
program call the running sequences' last tokens, positions, page tables, row ids and keys; the call runs up to
``decode_steps_per_call`` decode steps inside one ``lax.while_loop`` and returns early when a sequence ends
while others wait, so its slot is refilled at once: new prompts are prefilled between decode calls. The page
pools pass through both programs donated, so XLA updates them in place: no copy of the cache per call or step.

The sampler's rooms, each a module: ``keys`` (``SamplerConfig`` and every shape ladder: prompt buckets,
power-of-two prompt counts, slot counts), ``requests`` (``Request``, ``Sequence``, ``GenerateOutput``,
``prepare_prompts``), ``scheduler`` (admission, slots, preemption, packing: host state only), ``paging`` (the
page pool, its size and placement), ``program_set`` (which programs compile, and their abstract twins for the
planner), ``decode`` (the programs), ``backend`` (who runs the model inside them) and this one, which drives
the programs. Every consumer takes one path: ``prepare_prompts`` -> ``Engine.submit`` (with the prompts'
indices) -> ``Engine.run`` or ``step`` -> ``Engine.collect``; ``generate`` is that path on a fresh engine.

A multi-turn rollout submits sequences that pause at a turn's end (a stop token, a pause token, the turn's
budget) with their pages kept, and resumes them with their observation tokens, fed as forced tokens through the
same decode step (``Engine.resume``). ``update_params`` swaps the weights between calls of a running engine
(queued and running sequences kept, the KV of those already prefilled recomputed under the new weights before
they decode on: ``refill``); each token records the version that sampled it, and its logprob is exactly that
version's. Each request may set its own length limit and sampling (``Engine.submit``): the programs read every
row's limit and rule as data, so requests of any mix share decode calls.

Row outputs are independent of the batch: positions are per sequence and token n of row r draws its noise from
``fold_in(fold_in(key, n), r)``, with r its index in the submitted batch, so neither its slot, its companions nor
its admission time change its tokens (a preempted sequence samples the same tokens again). ``completion_mask``
comes from the loop's stop bookkeeping, never from token values, so a pad id equal to the EOS id (SmolLM2) is
handled. The logits are ``grpax.models.llama.logits_from_hidden``'s, the function the trainer scores with. The
design follows vLLM's paged attention and scheduler (Kwon et al. 2023) and the prefill/decode split of MaxText's
and Tunix's samplers; the returned fields use TRL's names.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from grpax import distributed
from grpax.host_memory import release_host_memory
from grpax.models.moe import route_dtype
from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler import decode, paging
from grpax.sampler.backend import select_backend, shape_planned
from grpax.sampler.keys import (
    SamplerConfig,
    SamplingRule,
    fixed_prefill_prompts,
    gathered_width,
    pow2,
    program_group,
)
from grpax.sampler.paging import PagePool, engine_pool_pages, pool_init
from grpax.sampler.program_set import (
    REFILL_TOKENS,
    compiled,
    compiled_admit,
    compiled_decode,
    compiled_refill,
    compiled_zeros,
    fixed_programs,
    prepare_decode,
    program_config,
    replicated_sharding,
    routing_backend,
    rule_inputs,
)
from grpax.sampler.requests import GenerateOutput, Request, Sequence, prepare_prompts, request_settings
from grpax.sampler.scheduler import Scheduler


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
      shape_plans: the backend's prefill plans by the prompts' shape only (``grpax.sampler.backend.shape_planned``:
        a server's programs known before its requests).

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
        shape_plans: bool = False,
    ):
        sc = self.sc = sampler_cfg
        self.cfg = cfg
        self.fixed = fixed_programs(sc, params)
        # the CPU kernels' prefill picks its plan per prompt lengths (a program each): the fixed set runs XLA's ops
        name = "xla" if self.fixed and sc.backend == "auto" else sc.backend
        self.backend = routing_backend(select_backend(name, params, cfg, sc.cache_dtype, True), cfg, sc)
        if shape_plans:
            self.backend = shape_planned(self.backend)
        self.num_slots = sc.decode_slots(num_slots)
        self.table_width = sc.pages_per_sequence()
        self.program_cfg = program_config(sc, self.fixed)  # the programs' static config
        # The fixed set's host inputs placed as abstract_programs' specs (replicated over the params' devices):
        # the compile check's programs are then the run's, read back from the persistent compilation cache.
        replicated = replicated_sharding(params, cfg) if self.fixed else None
        self._put = (
            functools.partial(jax.device_put, device=replicated) if replicated else (lambda tree: tree)
        )
        num_pages = engine_pool_pages(params, cfg, sc, self.backend, self.num_slots)
        # calls, steps, row_steps (row_steps_empty: of slots without a sequence at a call's start), preempted,
        # prefills; refills and recomputed_tokens: the KV recomputed at weight swaps
        self.stats = collections.Counter()
        self.scheduler = Scheduler(sc, self.num_slots, self.fixed, num_pages, self.stats)
        self.pages = self._init_pages(params, num_pages)
        paging.hold(self)
        V = cfg.vocab_size
        self.stop_table = np.zeros(V, bool)
        self.stop_table[[i for i in sc.stop_token_ids if 0 <= i < V]] = True
        self.pause_table = np.zeros(V, bool) if pause_table is None else np.array(pause_table, bool)
        self.max_forced_tokens = max(1, max_forced_tokens)
        self._epoch = -1  # update_params calls less one; a sequence's KV is stale when its epoch differs
        self.default_rule = SamplingRule.of(sc)  # a request's rule unless it sets its own (and idle slots')
        self.rules_as_data = (
            self.fixed or sc.rules_as_data
        )  # every row's rule read as data, the default's too
        self.update_params(params, version)

    def _init_pages(self, params: Params, num_pages: int):
        """The backend's page pools, zeros, on the params' devices (over their mesh as ``abstract_pool`` says)."""
        init, sharding = pool_init(params, self.cfg, self.sc, self.backend, num_pages)
        return compiled_zeros(self.backend, init.args, sharding)()

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
            fn = compiled(prepare_decode, ("cfg", "backend", "num_slots"), self.backend.compiler_options)
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
        prompt_indices: list[int] | None = None,
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
          prompt_indices: each prompt's index in the caller's list (``prepare_prompts``'), returned by
            ``collect``; default 0..N-1.

        Raises:
          ValueError: an empty prompt or one longer than max_prompt_length; num_generations above the decode
            slots; a length limit or sampling value out of range; prompt_indices not one per prompt (one line
            naming the argument); nothing is queued then.
        """
        if prompt_indices is not None and len(prompt_indices) != len(prompts):
            raise ValueError(f"prompt_indices has {len(prompt_indices)} entries for {len(prompts)} prompts")
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
        limit, rule = request_settings(
            self.sc, self.num_slots, prompts, num_generations, max_completion_length, self.default_rule, given
        )
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
        if prompt_indices is not None:
            request.prompt_indices = list(prompt_indices)
        self.scheduler.enqueue(request)
        return request

    def collect(self, request: Request) -> GenerateOutput:
        """``request``'s rows as a ``GenerateOutput``: prompts padded to ``prompt_width``, completions to the
        engine's max_completion_length, ``prompt_indices`` as submitted (the rows so far where it is not done)."""
        return request.output(
            self.sc.pad_token_id, self.prompt_width(request.prompts), self.sc.max_completion_length
        )

    @property
    def busy(self) -> bool:
        """Whether a sequence is queued, ready or running (paused ones wait for the caller)."""
        return self.scheduler.busy

    @contextlib.contextmanager
    def stops_ignored(self):
        """Within it, no stop token ends a row: each runs to its length limit (a server's warm-up of each
        program)."""
        stop_table, self.stop_table = self.stop_table, np.zeros_like(self.stop_table)
        try:
            yield
        finally:
            self.stop_table = stop_table

    @property
    def pool(self) -> PagePool:
        """The host's bookkeeping of the KV pool's pages (read it; the scheduler hands pages out)."""
        return self.scheduler.pool

    @property
    def num_running(self) -> int:
        """Sequences holding a decode slot."""
        return len(self.scheduler.running)

    @property
    def num_in_flight(self) -> int:
        """Sequences queued, ready or running (paused ones wait for the caller)."""
        return self.scheduler.num_in_flight

    def waiting(self, request: Request | None = None) -> bool:
        """Whether a sequence (of ``request``, where given) waits for a decode slot: queued, or prefilled and
        ready."""
        return self.scheduler.waiting(request)

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
        self.scheduler.start_ready()
        stale = [seq for seq in self.scheduler.running if seq.kv_epoch != self._epoch]
        if stale:
            self._refill(stale)
        if self.scheduler.running:
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
        seq.reason = decode.RUNNING
        self.scheduler.make_ready(seq)

    def finish(self, seq: Sequence) -> None:
        """Ends a paused sequence (its pages freed)."""
        assert seq.state == "paused", seq.state
        self.scheduler.end(seq)

    def cancel(self, request: Request) -> None:
        """Drops every sequence of ``request`` that has not finished (queued, ready, running or paused)."""
        self.scheduler.cancel(request)

    # -- admission -------------------------------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        """Prefills queued prompts while free slots (and pages, beyond a reserve for the running sequences'
        growth) allow: one prefill call, or (the fixed program set, ``max_prefill_prompts``) as many calls of at most
        ``Scheduler.prefill_cap`` prompts as the slots take; returns the sequences that paused at their first token."""
        paused = []
        while batch := self.scheduler.next_batch():
            paused += self._prefill(batch)
            if not (self.fixed or self.sc.max_prefill_prompts):
                break
        return paused

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
            self.scheduler.place_prompt(seqs, L, dest[j])
            for g, seq in enumerate(seqs):
                key_data[j * G + g], rows[j * G + g] = request.key_data, seq.index
        plan = self.backend.plan(tokens, lengths)
        fn = compiled_admit(self.backend)
        rule = rule_inputs(
            [req.rule for req, _, seqs in batch for _ in seqs], N * G, self.default_rule, self.rules_as_data
        )
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
                self.scheduler.admitted += 1
                seq.order, seq.kv_epoch = self.scheduler.admitted, self._epoch
                seq.turn_end = min(request.turn_budget, request.limit)
                seq.record(int(token[j * G + g]), float(logprob[j * G + g]), True, self.version)
                reason = seq.first_reason(self.stop_table, self.pause_table)
                if reason == decode.RUNNING:
                    self.scheduler.make_ready(seq)
                elif self.scheduler.segment_ended(seq, reason):
                    paused.append(seq)
        return paused

    def prompt_width(self, prompts: list[list[int]]) -> int:
        """The padding of ``prompts`` in a prefill and in an output (``Request.output``): the bucket of the
        longest, or with the fixed program set max_prompt_length (unless prompt_length_buckets are given)."""
        if self.fixed and not self.sc.prompt_length_buckets:
            return self.sc.max_prompt_length
        return self.sc.bucket_for(max(map(len, prompts)))

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

    def _decode(self) -> list[Sequence]:
        """One decode call on the running sequences; returns the ones that paused."""
        sc = self.sc
        k = sc.decode_steps_per_call
        scheduler = self.scheduler
        scheduler.grow(k)
        waiting = scheduler.waiting()
        S = scheduler.call_slots(waiting)
        width = self.table_width
        if not (self.backend.reads_filled_pages or self.fixed):
            longest = max(len(s.pages) for s in scheduler.running)
            width = gathered_width(longest, self.table_width, sc.page_size, sc.decode_phase_length)
        slots = scheduler.pack(S, width, self.max_forced_tokens)
        pausing = any(seq.request.pauses for seq in scheduler.running)
        exit_after = np.int32(scheduler.exit_after(S, waiting, pausing))
        prepared = self._prepared if self.backend.prepares_once else self.params
        fn = compiled_decode(self.backend)
        key_impl = scheduler.running[0].request.key_impl
        rule = rule_inputs(
            [seq.request.rule for seq in scheduler.running], S, self.default_rule, self.rules_as_data
        )
        self.pages, out = fn(
            prepared, self.pages, *self._put((slots, rule, self.stop_table, self.pause_table, exit_after)),
            cfg=self.cfg, sampler_cfg=self.program_cfg, backend=self.backend, num_steps=k, key_impl=key_impl,
        )  # fmt: skip
        out = distributed.fetch(out)
        steps = int(out["steps"])
        self.stats["calls"] += 1
        self.stats["steps"] += steps
        self.stats["row_steps"] += S * steps
        self.stats["row_steps_empty"] += (S - len(scheduler.running)) * steps  # slots without a sequence
        return self._collect(out, S * steps)

    def _collect(self, out: dict[str, np.ndarray], row_steps: int) -> list[Sequence]:
        """Records a decode call's tokens into its sequences (``row_steps``: its slots x steps), keeps the ones
        still running and returns the ones that paused."""
        paused, still = [], []
        running = self.scheduler.running
        for s, seq in enumerate(running):
            wrote = np.flatnonzero(out["wrote"][s])
            for i in wrote:
                if "routes" in out:  # the experts of the token fed at step i: its last one
                    seq.routes.append(out["routes"][s, i])
                seq.record(
                    int(out["tokens"][s, i]),
                    float(out["logprobs"][s, i]),
                    bool(out["model"][s, i]),
                    self.version,
                )
            seq.request.row_steps += len(wrote)
            seq.forced_pos = int(out["forced_pos"][s])
            if seq.forced_pos >= len(seq.forced):
                seq.forced, seq.forced_pos = [], 0
            reason = int(out["reason"][s])
            if reason == decode.RUNNING:
                still.append(seq)
            elif self.scheduler.segment_ended(seq, reason):
                paused.append(seq)
        idle = row_steps - int(out["wrote"].sum())
        oldest = min(running, key=lambda q: q.order).request
        oldest.row_steps += idle  # idle slots' steps count against the oldest request in flight
        self.scheduler.running = still
        return paused


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
    rows = max(num_slots or 0, len(kept) * num_generations)
    if sc.max_num_seqs > rows:  # slots (and their pages) past the call's rows would never hold a sequence
        sc = dataclasses.replace(sc, max_num_seqs=rows)
    engine = Engine(params, cfg, sc, num_slots=rows)
    request = engine.submit(kept, key, num_generations, prompt_indices=indices)
    engine.run(request)
    out = engine.collect(request)
    del engine, request
    release_host_memory()  # the page pool's buffers: before the next call allocates
    return out
