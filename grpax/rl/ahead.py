"""Rollouts that run ahead of the update (``max_staleness`` >= 1), on the trainer's own devices.

A background thread produces the batch of step j with the params after update ``max(start, j - N)``
(N = ``max_staleness``; ``start`` = the step the run started or resumed at), while the main thread runs the
update of step j - 1 .. j - N. The version is pinned, not "the newest available", so a run is reproducible and
every batch's staleness is ``min(j - start, N)`` updates. The update donates its state, so each version the
thread will need is copied once when it is published (N + 1 weight copies at most besides the state).

Data: the thread draws the prompt rows and records the iterator's position after each batch; a checkpoint after
step j stores the position recorded with batch j, so the batches in flight are not counted as used and a resume
samples them again (no prompt skipped or repeated across a kill).

Colocated, the overlap hides the host's share of a rollout (decode loop bookkeeping, detokenisation, reward
functions, the reference pass's dispatch) behind the update; the devices still run one program after the other.
The same shape as TRL's AsyncGRPOTrainer (a rollout worker, a queue, ``max_staleness``) without a second process.

With ``overlap`` the batches also overlap each other on one running rollout engine (``Rollout.keep_engine``):
when batch j's tail has freed half the decode slots, the thread waits for the params batch j + 1 needs, swaps them
into the engine (batch j's running rows sample their remaining tokens with them, each token recording its
version) and queues batch j + 1's prompts, which enter the freed slots at once. The swap happens at a point the
tokens decide (not the clock), so a run stays reproducible; pi_old is each token's own version's
(``Rollout._old_logprobs``); a batch's ``policy_version`` is its first tokens'. Not with DAPO dynamic sampling
(its later draws would interleave with the next batch's rows in the iterator).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from grpax.errors import ConfigError
from grpax.rl.batch import Batch
from grpax.rl.rollout import Rollout

log = logging.getLogger("grpax.train")


class RolloutWorkerError(ConfigError):
    """The rollout thread failed or stopped answering; the update never saw its batch."""


class AheadRollouts:
    """Batches of steps ``start`` .. ``end - 1`` produced by a background thread, ``max_staleness`` ahead.

    Args:
      rollout: the ``Rollout`` (used only by the thread once started).
      iterator: the run's prompt iterator (``PromptIterator``: ``next`` and ``state_dict``), read only by the
        thread once started; also the rollout's ``extra_rows``.
      key_of: step -> that step's rollout key.
      max_staleness: N >= 0 (0 works too: each batch waits for the previous update; used by tests).
      start, end: the first step and one past the last.
      timeout_s: how long ``get`` waits for a batch before it calls the thread hung.
      overlap: the next batch's prompts enter the slots the current batch's tail frees (see the module
        docstring); only where max_staleness >= 1 and dynamic sampling is off.
    """

    def __init__(
        self,
        rollout: Rollout,
        iterator: Any,
        key_of: Callable[[int], jax.Array],
        max_staleness: int,
        start: int,
        end: int,
        timeout_s: float = 3600.0,
        overlap: bool = False,
    ):
        self.rollout, self.iterator, self.key_of = rollout, iterator, key_of
        self.overlap = overlap and max_staleness >= 1 and not rollout.grpo.filter_zero_std_groups
        if self.overlap:
            rollout.keep_engine()
        self._queued: dict[int, list[dict]] = {}  # rows of a batch queued on the engine at the previous tail
        self._positions: dict[int, dict] = {}  # the iterator's position after a batch, taken at its tail
        self.position: dict | None = None  # the iterator's position after the last batch ``get`` returned
        self.max_staleness, self.start, self.end, self.timeout_s = max_staleness, start, end, timeout_s
        self._versions: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._done: queue.Queue = queue.Queue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="grpax-rollout", daemon=True)

    def version_for(self, step: int) -> int:
        """The params version (updates applied) that samples ``step``'s batch."""
        return max(self.start, step - self.max_staleness)

    def publish(self, params: Any, version: int, sampler_params: Callable[[Any], Any] = lambda p: p) -> None:
        """Hands the thread the sampler's params after ``version`` updates, if a future batch needs it.

        Args:
          params: the trained params (the full model, or LoRA's adapters). They are donated to the next update,
            so they are copied here, before it runs; nothing else is.
          version: updates applied to ``params``.
          sampler_params: what the sampler reads, built from the copy (``Policy.sampler_params``: with LoRA the
            frozen base with the copied adapters, shared and never copied, or the weights merged from them).
        """
        needed = any(self.version_for(j) == version for j in range(self.start, self.end))
        if not needed:
            return
        copy = sampler_params(jax.tree.map(jnp.copy, params))
        with self._cond:
            self._versions[version] = copy
            self._cond.notify_all()
        if self._thread.ident is None and not self._stop:  # the first version: start producing
            self._thread.start()

    def get(self, step: int) -> Batch:
        """``step``'s batch; waits for the thread. ``position`` becomes the iterator's position after it (what a
        checkpoint after this step stores).

        Raises:
          RolloutWorkerError: the thread raised (its exception chained; a ``RewardFunctionError`` or other
            ``ConfigError`` is re-raised as is), died, or gave nothing for ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                got_step, batch, position = self._done.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RolloutWorkerError(
                        f"step {step + 1}: the rollout thread stopped without a batch; the last checkpoint is "
                        "kept: run the same command again to resume"
                    ) from None
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(
                        f"step {step + 1}: no rollout for {self.timeout_s:.0f} s (a hung reward function or "
                        "sampler); the last checkpoint is kept: fix it and run the same command to resume"
                    ) from None
        if isinstance(batch, BaseException):
            if isinstance(batch, ConfigError):
                raise batch
            raise RolloutWorkerError(
                f"step {got_step + 1}: the rollout failed ({type(batch).__name__}: {batch}); the last "
                "checkpoint is kept"
            ) from batch
        assert got_step == step, (got_step, step)  # one producer, in step order
        self.position = position
        return batch

    def close(self) -> None:
        """Stops the thread after its current rollout (it is a daemon: an exiting process does not wait)."""
        with self._cond:
            self._stop = True
            self._versions.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _params_for(self, step: int) -> Any | None:
        """Waits for the version ``step`` needs; drops the versions no later batch needs; None when stopped."""
        version = self.version_for(step)
        with self._cond:
            while version not in self._versions and not self._stop:
                self._cond.wait()
            if self._stop:
                return None
            for old in [v for v in self._versions if v < version]:
                del self._versions[old]
            return self._versions[version]

    def _run(self) -> None:
        for step in range(self.start, self.end):
            try:
                rows = self._queued.pop(step, None)
                if rows is None:
                    params = self._params_for(step)
                    if params is None:
                        return
                    self.rollout.update_params(params, self.version_for(step))
                    del params
                    rows = next(self.iterator)
                tail = {"on_tail": self._tail(step + 1)} if self.overlap and step + 1 < self.end else {}
                batch = self.rollout(rows, self.key_of(step), extra_rows=self.iterator, **tail)
                if not self.overlap:
                    self.rollout.params = None  # the version's copy goes once no later batch needs it
                jax.block_until_ready(batch)  # the rollout's time is its own, not the update's
                position = self._positions.pop(step, None) or self.iterator.state_dict()
                self._done.put((step, batch, position))
            except BaseException as e:  # handed to the main thread, which stops the run with one line
                self._done.put((step, e, None))
                return

    def _tail(self, step: int) -> Callable[[], None]:
        """What batch ``step - 1``'s tail runs: records the iterator's position after it, waits for the params
        ``step`` needs, swaps them in and queues ``step``'s prompts on the running engine."""

        def tail() -> None:
            self._positions[step - 1] = self.iterator.state_dict()
            params = self._params_for(step)
            if params is None:  # stopping
                return
            self.rollout.update_params(params, self.version_for(step))
            del params
            rows = next(self.iterator)
            self.rollout.presubmit(rows, self.key_of(step))
            self._queued[step] = rows

        return tail
