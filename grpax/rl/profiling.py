"""MaxText's profiler keys for ``grpax train_rl``: a JAX profiler trace of some training steps.

``profiler=xplane`` traces steps ``skip_first_n_steps_for_profiler + 1`` .. ``+ profiler_steps`` of this run
(counted from the step it starts or resumes at; the first steps compile) with ``jax.profiler`` into
``<run_dir>/tensorboard/plugins/profile/<time>/`` (``*.xplane.pb``, ``*.trace.json.gz``), beside the run's
scalars, so TensorBoard's profile plugin (XProf) or Perfetto opens it: each step's rollout, reference and
update, the kernels and the collectives. MaxText's ``profiler=nsys`` is a process wrapper: run the command under
``nsys profile`` instead. Reference: MaxText ``base.yml`` (``profiler``, ``skip_first_n_steps_for_profiler``,
``profiler_steps``) and Tunix's ``profiler_start_invocation`` / ``profiler_num_invocations`` (aliases).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

PROFILERS = ("", "xplane")


class StepProfiler:
    """Starts a trace before step ``start_step + skip`` and stops it after ``count`` steps (or at ``close``).

    Args:
      profiler: "" (off) or "xplane".
      folder: the trace's folder (TensorBoard's log dir: ``<run_dir>/tensorboard``).
      start_step: the first step this run executes (0-based).
      skip: steps run before the trace starts.
      count: steps traced.
      end_step: the step this run ends before (``num_batches``): a trace that cannot start is warned of.

    Every host traces its own devices into ``folder`` (one ``<host>.xplane.pb`` each).
    """

    def __init__(self, profiler: str, folder: Path, start_step: int, skip: int, count: int, end_step: int):
        self.first = start_step + skip if profiler else None
        self.last = None if self.first is None else self.first + count - 1
        self.folder, self.active = Path(folder), False
        if self.first is not None and self.first >= end_step:
            logger.warning(
                "profiler=%s: no trace: this run executes steps %d-%d and skip_first_n_steps_for_profiler=%d skips "
                "them all; lower it",
                profiler, start_step + 1, end_step, skip,
            )  # fmt: skip

    def before(self, step: int) -> None:
        """Starts the trace where ``step`` is the first traced one."""
        if step == self.first:
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder))
            self.active = True
            logger.info("profiling steps %d-%d into %s", step + 1, self.last + 1, self.folder)

    def after(self, step: int, state: Any) -> None:
        """Stops the trace after the last traced step, once ``state``'s arrays are computed."""
        if self.active and step == self.last:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stops a running trace (a run that ended or failed inside the traced steps)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
            logger.info("profile written to %s (tensorboard --logdir %s)", self.folder, self.folder)
