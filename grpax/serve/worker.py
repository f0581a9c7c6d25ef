"""The engine loop of ``grpax serve``: one thread owns the rollout engine and steps it while work is pending.

HTTP handlers never touch the engine (it is not thread-safe): they hand the worker a ``Job`` and read its
progress from an asyncio queue. Between engine steps the worker takes commands (submit, cancel, swap params),
submits pending jobs so that new requests join the running batch at the next step (the engine prefills them into
free slots: continuous batching), then runs ``Engine.step`` and posts each job's new tokens, logprobs and
per-token policy versions to its queue (thread-safely, on the server's event loop).

A job's sampling rule (temperature, top_p, top_k) and ``max_tokens`` are its own (``Engine.submit``'s per-request
settings): jobs of any mix of rules join the running batch at once, each row sampled by its own rule, read by the
engine's programs as data (``rules_as_data``: one program per shape for every rule, the default's included).

The server's programs are a small set known from its keys (``bounded``, ``warmup_plan``), so that XLA:CPU, which
maps each kernel of every live program on pages of its own, stays far from ``vm.max_map_count``: prompts padded to
power-of-two buckets (64, 128, 256... tokens, the last ``max_prompt_length``); prefills of at most
``max_prefill_prompts`` prompts (1 by default: one prefill program per bucket; the engine rounds a call's prompts up
to a power of two); ``n`` completions of a prompt submitted as ``n`` copies of it (one prefill shape for every ``n``:
the rows and their noise are those of a group of ``n``, the prompt prefilled ``n`` times); the decode over the whole
page table on the halvings of the slots (``slot_count_step`` 0: 32, 16, 8, 4, 2, 1); the scoring forward of
``top_logprobs`` on the same buckets of the longest sequence (``scoring_lengths``). ``warmup`` runs each program
once: the first request's (the smallest bucket's one-prompt prefill, the decode on the fewest slots) before the port
opens, and the rest either then too or (``background``) from the engine thread while it has no request to step.

``update_params`` swaps the weights between steps (``Engine.update_params``): queued and running sequences are
kept, and every token records the version that sampled it. Top log-probabilities (the alternatives OpenAI's
``top_logprobs`` lists) are not a by-product of sampling: ``top_logprobs`` scores a prompt and its completion
with one forward of the model (``grpax.models.llama.forward``, the trainer's) at the request's temperature.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpax.host_memory import memory_mappings
from grpax.models import llama
from grpax.models.params import Params
from grpax.models.registry import ModelConfig
from grpax.sampler.engine import Engine
from grpax.sampler.keys import SamplerConfig, bucket_lengths, prefill_counts, scoring_lengths
from grpax.sampler.keys import slot_counts as engine_slot_counts
from grpax.serve.protocol import MAX_TOP_LOGPROBS, Sampling

logger = logging.getLogger(__name__)


class WarmupItem(NamedTuple):
    """One program of a server's set, as the warm-up runs it: ``kind`` "prefill" (``count`` prompts of ``tokens``
    tokens, their first token sampled), "decode" (a decode call on ``slots`` slots, holding ``count`` rows) or
    "scoring" (``top_logprobs``' forward over ``tokens`` tokens)."""

    kind: str
    tokens: int
    count: int
    slots: int = 0

    def describe(self) -> str:
        if self.kind == "prefill":
            return f"prefill of {self.count} prompt{'s' * (self.count > 1)} x {self.tokens} tokens"
        if self.kind == "scoring":
            return f"top_logprobs scoring of {self.tokens} tokens"
        return f"decode on {self.slots} slot{'s' * (self.slots > 1)}"


def warmup_plan(sampler_cfg: SamplerConfig, num_slots: int) -> list[WarmupItem]:
    """The programs a server's engine (``bounded``'s config, ``num_slots`` slots) runs, in warm-up order: first
    the ones a first short request needs (the smallest bucket's one-prompt prefill, the decode on the fewest
    slots), then each bucket's one-prompt prefill, the other slot counts ascending, the other prompt counts, and
    last the scoring forward of ``top_logprobs`` at each of its lengths (``scoring_lengths``).

    A decode item holds one row more than the next smaller slot count (the engine picks the smallest count that
    holds its rows); its rows are one-token prompts, prefilled by the smallest bucket's programs."""
    sc = sampler_cfg
    buckets, counts = sc.buckets(), prefill_counts(sc.max_prefill_prompts, num_slots)
    slots = sorted(engine_slot_counts(num_slots, sc.slot_count_step)) if sc.max_completion_length > 1 else []
    decodes = [WarmupItem("decode", buckets[0], ([0, *slots][i] + 1), s) for i, s in enumerate(slots)]
    prefills = [WarmupItem("prefill", b, n) for n in counts for b in buckets]
    first = [prefills[0], *decodes[:1]]
    scoring = [
        WarmupItem("scoring", t, 1) for t in scoring_lengths(sc.max_prompt_length, sc.max_completion_length)
    ]
    return [*first, *prefills[1 : len(buckets)], *decodes[1:], *prefills[len(buckets) :], *scoring]


DEFAULT_SLOTS = 64  # an Engine's slots where max_num_seqs is 0


def bounded(sampler_cfg: SamplerConfig) -> SamplerConfig:
    """``sampler_cfg`` with the server's program set (the module docstring): power-of-two prompt buckets (unless
    it sets its own), one-prompt prefills (unless ``max_prefill_prompts`` is set), the halvings of the slots as
    decode slot counts (unless ``slot_count_step`` is set), the decode over the whole page table (backends that
    read only the filled pages ignore it), every rule as data, on the adaptive program set on any device (the
    fixed set, an accelerator's default elsewhere, would prefill max_num_seqs prompts for a request of one: a
    server's first token waits for it)."""
    sc = sampler_cfg
    return dataclasses.replace(
        sc,
        prompt_length_buckets=sc.prompt_length_buckets or bucket_lengths(sc.max_prompt_length),
        max_prefill_prompts=sc.max_prefill_prompts or 1,
        slot_count_step=sc.slot_count_step or max(1, sc.decode_slots(DEFAULT_SLOTS) // 2),
        decode_phase_length=0,
        rules_as_data=True,
        programs="adaptive",
    )


class _ProgramCounter(collections.Counter):
    """A ``jax.monitoring`` listener counting the programs obtained (the engine's admit and decode, others),
    compiled or read from the persistent compilation cache (``cached``: those read)."""

    def __call__(self, event: str, duration: float, fun_name: str = "", **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self[next((n for n in ("admit", "decode") if fun_name == f"jit({n})"), "other")] += 1
        elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
            self["cached"] += 1

    def copy(self) -> collections.Counter:
        return collections.Counter(self)


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request's sequences: G = ``n`` completions of each prompt, rows grouped (row i answers prompt
    i // n), at most ``max_tokens`` new tokens each, sampled with ``sampling`` and the PRNG key of ``seed``.

    The worker posts ``Progress`` records to ``updates`` on ``loop``.
    """

    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    seed: int
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    sent: list[int] = dataclasses.field(default_factory=list)  # tokens posted per row
    request: Any = None  # the engine's Request once submitted

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.n


@dataclasses.dataclass
class RowUpdate:
    """New tokens of one row since the last update (and its finish reason once it ended)."""

    row: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None = None


@dataclasses.dataclass
class Progress:
    """What one engine step added to a job; ``done`` once every row ended; ``error`` when the engine failed."""

    rows: list[RowUpdate]
    done: bool = False
    error: str | None = None


class EngineWorker:
    """Owns an ``Engine`` and its thread (see the module docstring).

    Args:
      params: the model params.
      cfg: the model config.
      sampler_cfg: the engine's settings (``max_prompt_length``, ``max_completion_length``, ``max_num_seqs``,
        stop tokens...); its sampling fields are the default rule, its shapes bounded (``bounded``).
      version: the params' version.
    """

    def __init__(self, params: Params, cfg: ModelConfig, sampler_cfg: SamplerConfig, *, version: int = 0):
        self.cfg = cfg
        self.engine = Engine(params, cfg, bounded(sampler_cfg), version=version, shape_plans=True)
        self.params, self.version = params, version
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self._thread = threading.Thread(target=self._loop, name="grpax-serve-engine", daemon=True)
        self._stopped = False
        self._warm: collections.deque[tuple[int, WarmupItem]] = (
            collections.deque()
        )  # a warm-up's programs left
        self._warm_start = 0.0
        self.stats = {
            "steps": 0,
            "cancelled": 0,
            "peak_rows": 0,
        }  # engine steps, jobs cancelled, rows in flight

    @property
    def max_prompt_length(self) -> int:
        return self.engine.sc.max_prompt_length

    @property
    def max_completion_length(self) -> int:
        return self.engine.sc.max_completion_length

    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    # -- the API (any thread) ----------------------------------------------------------------------------------

    def start(self) -> EngineWorker:
        """Starts the loop's thread (once; later calls do nothing)."""
        if not self._thread.is_alive() and not self._stopped:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the loop (running jobs are cancelled) and waits for the thread."""
        self._stopped = True
        if self._thread.is_alive():
            self.commands.put(("stop",))
            self._thread.join()

    def submit(self, job: Job) -> None:
        """Queues ``job``; it joins the running batch at the next step, whatever its sampling rule."""
        self.commands.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Drops ``job``'s unfinished rows (a client that went away, stop strings met); their pages are freed."""
        self.commands.put(("cancel", job))

    def update_params(self, params: Params, version: int, timeout: float | None = None) -> None:
        """Swaps the engine's params between steps and waits until it did (queued and running sequences kept;
        their later tokens are ``version``'s).

        Raises:
          TimeoutError: the loop did not take the params within ``timeout`` seconds.
        """
        done = threading.Event()
        self.commands.put(("update", params, version, done))
        if not done.wait(timeout):
            raise TimeoutError(f"the engine loop did not take params version {version} in {timeout} s")

    def warmup(self, background: bool = False) -> int:
        """Runs each program of the server's set once (``warmup_plan``), so that serving compiles nothing: all of
        them now, or (``background``) the first request's now and the rest from the engine thread once it runs
        (``start``), one program at a time while no request is in flight (a request arriving meanwhile waits for
        the one being compiled, at most). Call it before ``start`` (it drives the engine from this thread). Stop
        tokens are ignored meanwhile (every row decodes). Logs the set first, then a line per program: compiled
        (or loaded from the compilation cache), its seconds, and the memory mappings the process holds
        (``grpax.host_memory.memory_mappings``: XLA:CPU keeps some per compiled kernel); then a line at the end.

        Returns:
          The programs run now: the whole set, or with ``background`` the first request's (2; 1 where the
          completion budget is one token: no decode).
        """
        if self._thread.is_alive():
            raise RuntimeError("warmup drives the engine: call it before start")
        e = self.engine
        e.update_params(e.params, e.version)  # the params' preparation for this backend (swaps reuse it)
        plan = warmup_plan(e.sc, self.num_slots)
        first = 2 if len(plan) > 1 and plan[1].kind == "decode" else 1
        now = first if background else len(plan)
        logger.info(
            "warm-up: %d programs (%s), %d before the port opens%s",
            len(plan),
            "; ".join(item.describe() for item in plan),
            now,
            ", the rest while the engine has no request" if now < len(plan) else "",
        )
        self._warm = collections.deque(enumerate(plan, 1))
        self._warm_start = time.perf_counter()
        for _ in range(now):
            self._warm_next()
        return now

    def _warm_next(self) -> None:
        """Runs the next program of the warm-up (``warmup``) on an idle engine and logs it."""
        e = self.engine
        i, item = self._warm.popleft()
        total = i + len(self._warm)
        counted = _ProgramCounter()
        jax.monitoring.register_event_duration_secs_listener(counted)
        start = time.perf_counter()
        try:
            if item.kind == "scoring":
                ones = np.ones((1, item.tokens), np.int32)
                jax.block_until_ready(_top_logprobs(self.params, ones, ones, np.float32(1.0), cfg=self.cfg))
            else:
                prompts = [[0] * (item.tokens if item.kind == "prefill" else 1)] * item.count
                limit = (
                    1 if item.kind == "prefill" else 2
                )  # decode: the prefill's token, then one decode call
                with e.stops_ignored():  # every row runs to its limit
                    e.run(e.submit(prompts, jax.random.key(0), max_completion_length=limit, greedy=True))
        except Exception:  # noqa: BLE001 - a program that fails here compiles (or fails) at its first request
            logger.exception("warm-up %d/%d (%s) failed", i, total, item.describe())
            return
        finally:
            jax.monitoring.unregister_event_duration_listener(counted)
        held = memory_mappings()
        logger.info(
            "warm-up %d/%d (%s): %d programs (%d of the engine's; %d of them read from the compilation cache) "
            "in %.1f s%s",
            i,
            total,
            item.describe(),
            counted["admit"] + counted["decode"] + counted["other"],
            counted["admit"] + counted["decode"],
            counted["cached"],
            time.perf_counter() - start,
            f"; {held[0]} memory mappings held (vm.max_map_count {held[1]})" if held else "",
        )
        if not self._warm:
            logger.info("warm-up: done, %d programs in %.1f s", total, time.perf_counter() - self._warm_start)

    # -- the loop (the worker thread) ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            idle = not self.engine.busy and not self.pending
            try:
                command = self.commands.get(block=idle and not self._warm)
                while True:
                    if command[0] == "stop":
                        for job in [*self.active, *self.pending]:
                            self._cancel(job)
                        return
                    self._handle(command)
                    command = self.commands.get_nowait()
            except queue.Empty:
                pass
            self._admit()
            if self.engine.busy:
                try:
                    e = self.engine
                    in_flight = e.num_in_flight
                    self.engine.step()
                    self.stats["steps"] += 1
                    self.stats["peak_rows"] = max(self.stats["peak_rows"], in_flight)
                except Exception as e:  # noqa: BLE001 - a failed step fails its jobs, never the server
                    logger.exception("engine step failed")
                    self._fail(f"the engine failed: {type(e).__name__}: {e}")
                    continue
                self._publish()
            elif self._warm:  # nothing to step: the next program of a background warm-up
                self._warm_next()

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "submit":
            job = command[1]
            job.sent = [0] * job.num_rows
            self.pending.append(job)
        elif kind == "cancel":
            self._cancel(command[1])
        elif kind == "update":
            _, params, version, done = command
            self.engine.update_params(params, version)
            self.params, self.version = params, version
            done.set()

    def _admit(self) -> None:
        """Submits the pending jobs, each with its own rule and length limit: they join the running batch."""
        while self.pending:
            job = self.pending.popleft()
            try:
                job.request = self.engine.submit(
                    [p for p in job.prompts for _ in range(job.n)],  # n copies: one prefill shape for every n
                    jax.random.key(job.seed),
                    max_completion_length=job.max_tokens,
                    **job.sampling.sampler_fields(),
                )
            except ValueError as e:  # the server checked the limits; this is a last guard
                self._post(job, Progress([], done=True, error=str(e)))
                continue
            self.active.append(job)

    def _publish(self) -> None:
        """Posts every active job's new tokens; a finished job leaves the active list."""
        still = []
        for job in self.active:
            rows = []
            for r, seq in enumerate(job.request.sequences):
                start = job.sent[r]
                finished = seq.state == "done"
                if start < 0:  # its end was posted
                    continue
                if seq.n > start or finished:  # (a preempted row restarts below start: nothing new yet)
                    reason = seq.finish_reason if finished else None
                    rows.append(
                        RowUpdate(r, seq.tokens[start:], seq.logprobs[start:], seq.versions[start:], reason)
                    )
                    job.sent[r] = -1 if finished else seq.n
            done = job.request.done
            if rows or done:
                self._post(job, Progress(rows, done=done))
            if not done:
                still.append(job)
        self.active = still

    def _cancel(self, job: Job) -> None:
        if job in self.pending:
            self.pending.remove(job)
        if job in self.active:
            self.engine.cancel(job.request)
            self.active.remove(job)
            self.stats["cancelled"] += 1
        self._post(job, Progress([], done=True, error="cancelled"))

    def _fail(self, message: str) -> None:
        for job in self.active:
            self.engine.cancel(job.request)
            self._post(job, Progress([], done=True, error=message))
        self.active = []

    @staticmethod
    def _post(job: Job, progress: Progress) -> None:
        try:
            job.loop.call_soon_threadsafe(job.updates.put_nowait, progress)
        except RuntimeError:  # the server's loop has closed (shutdown)
            pass

    # -- top log-probabilities (any thread) ----------------------------------------------------------------------

    def top_logprobs(
        self, prompt: list[int], completion: list[int], start: int, k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """The ``k`` most likely tokens and their log-probabilities at each completion position ``start..``,
        scored with the current params at ``temperature`` (1.0 for greedy), unfiltered by top-k / top-p.

        Returns:
          One list of (token id, logprob) per position, most likely first.
        """
        tokens = [*prompt, *completion]
        # 64, 128, 256... tokens, the last the server's longest sequence: one program each (run by the warm-up)
        lengths = scoring_lengths(self.max_prompt_length, self.max_completion_length)
        T = next((t for t in lengths if t >= len(tokens)), lengths[-1])
        padded = np.zeros((1, T), np.int32)
        mask = np.zeros((1, T), np.int32)
        padded[0, : len(tokens)], mask[0, : len(tokens)] = tokens, 1
        values, ids = _top_logprobs(self.params, padded, mask, np.float32(temperature), cfg=self.cfg)
        values, ids = np.asarray(values)[0], np.asarray(ids)[0]
        L = len(prompt)
        # completion token j (position L + j) is predicted by the logits at position L + j - 1
        return [
            [(int(ids[p, i]), float(values[p, i])) for i in range(k)]
            for p in range(L - 1 + start, L - 1 + len(completion))
        ]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _top_logprobs(params, tokens, mask, temperature, cfg):
    """float32 [1, T, 20] top log-probabilities and int32 [1, T, 20] their ids at each position."""
    logits, _ = llama.forward(params, tokens, cfg, attention_mask=mask)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
