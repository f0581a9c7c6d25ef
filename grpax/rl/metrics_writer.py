"""Training metrics sinks: a JSONL file and TensorBoard event files, written by process 0 only.

Each ``write(step, metrics)`` appends one JSON line ``{"step": s, "time": t, **metrics}`` to
``<run_dir>/metrics.jsonl`` and one scalar per key to ``<run_dir>/tensorboard``. Non-finite and non-numeric
values are kept in the JSONL (as null / strings) and skipped in TensorBoard. The JSONL is the record of the
run: ``truncate_after`` (on a resume or a fresh restart) cuts it and rebuilds the event files from it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any

import jax


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def tensorboard_tag(key: str) -> str:
    """``key`` as a TensorBoard tag: characters outside ``[-/\\w.]`` become ``_`` (``eval/pass@k`` ->
    ``eval/pass_k``), as tensorboardX would do itself with a warning at every write."""
    return re.sub(r"[^-/\w.]", "_", key)


class MetricsWriter:
    """Writes scalar metrics to ``metrics.jsonl`` and TensorBoard (``tensorboardX``).

    Args:
      run_dir: the run's folder; files go to ``run_dir/metrics.jsonl`` and ``run_dir/tensorboard/``.
      enabled: write at all (default: only on ``jax.process_index() == 0``).
    """

    def __init__(self, run_dir: str | Path, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb_dir = Path(run_dir) / "tensorboard"
        self._tb = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tb = self._open_tb()

    def _open_tb(self):
        from tensorboardX import SummaryWriter

        return SummaryWriter(str(self.tb_dir))

    def _add_scalars(self, record: dict[str, Any], walltime: float | None = None) -> None:
        for key, value in record.items():
            if key in ("step", "time"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(tensorboard_tag(key), value, record["step"], walltime=walltime)

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({f"{prefix}{k}": _plain(v) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._add_scalars(record)
        self._tb.flush()

    def records(self) -> list[dict[str, Any]]:
        """The JSONL lines written so far, in order (empty on processes that do not write)."""
        if not self.enabled or not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def truncate_after(self, step: int, drop_eval_at_step: bool = False) -> None:
        """Drops lines with ``step > step``, so the files match a run restored at ``step`` (-1: drop all).

        The TensorBoard event files cannot be cut in place: when lines were dropped they are deleted and
        rewritten from the kept lines (with their original wall times), so no stale point survives a restart.

        Args:
          step: the last step kept.
          drop_eval_at_step: also drop ``eval/`` lines at ``step`` itself (their evaluation runs again).
        """
        if not self.enabled or not self.path.exists():
            return
        records = self.records()

        def keep(record: dict[str, Any]) -> bool:
            if record["step"] == step and drop_eval_at_step:
                return not any(k.startswith("eval/") for k in record)
            return record["step"] <= step

        kept = [r for r in records if keep(r)]
        if len(kept) == len(records):
            return
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._tb.close()
        shutil.rmtree(self.tb_dir, ignore_errors=True)
        self._tb = self._open_tb()
        for record in kept:
            self._add_scalars(record, walltime=record.get("time"))
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
