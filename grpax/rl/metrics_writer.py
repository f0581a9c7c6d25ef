"""Training metrics sinks: a JSONL file and TensorBoard event files, written by process 0 only.

Each ``write(step, metrics)`` appends one JSON line ``{"step": s, "time": t, **metrics}`` to
``<run_dir>/metrics.jsonl`` and one scalar per key to ``<run_dir>/tensorboard``. Non-finite and non-numeric
values are kept in the JSONL (as null / strings) and skipped in TensorBoard.
"""

from __future__ import annotations

import json
import math
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


class MetricsWriter:
    """Writes scalar metrics to ``metrics.jsonl`` and TensorBoard (``tensorboardX``).

    Args:
      run_dir: the run's folder; files go to ``run_dir/metrics.jsonl`` and ``run_dir/tensorboard/``.
      enabled: write at all (default: only on ``jax.process_index() == 0``).
    """

    def __init__(self, run_dir: str | Path, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({f"{prefix}{k}": _plain(v) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key in ("step", "time"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drops JSONL lines with ``step > step`` (after a resume, so the file matches the restored run)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
