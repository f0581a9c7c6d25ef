"""Training metrics sinks: a JSONL file and TensorBoard event files, written by process 0 only.

Each ``write(step, metrics)`` appends one JSON line ``{"step": s, "time": t, **metrics}`` to
``<run_dir>/metrics.jsonl`` and one scalar per key to ``<run_dir>/tensorboard``. Non-finite and non-numeric
values are kept in the JSONL (as null / strings) and skipped in TensorBoard. The JSONL is the record of the
run: ``truncate_after`` (on a resume or a fresh restart) cuts it and rebuilds the event files from it.

Crash safety: each line is appended with one ``os.write`` on an ``O_APPEND`` descriptor and fsynced, so lines
never interleave and a kill can at worst cut off the last one; the reader drops a cut-off last line with a
warning (and the next ``truncate_after`` removes it), while a damaged line elsewhere is a one-line
``ConfigError``. ``truncate_after`` writes a temporary file and renames it over the old one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import jax

from grpax.config import ConfigError

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The records of a metrics JSONL file, and whether its last line was cut off (and dropped).

    Raises:
      ConfigError: a line other than the last is not JSON, or a line is not a record with an integer ``step``
        (names the file, the line and the fix).
    """
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                log.warning("%s line %d is cut off (a kill while it was written): dropped", path, number)
                return records, True
            raise ConfigError(
                f"{path} line {number} is not valid JSON (a damaged metrics file): delete that line, or the "
                "file to drop the run's metrics history, and run again"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(
                f"{path} line {number} holds {line[:60]!r}, not a metrics record with an integer 'step' (a "
                "damaged metrics file): delete that line, or the file to drop the run's metrics history, and run again"
            )
        records.append(record)
    return records, False


def append_line(path: Path, text: str) -> None:
    """Appends ``text`` (one line, newline included) with one write, then fsyncs: a kill never leaves half
    a line in the middle of the file, and concurrent appends never interleave."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"{path}: short write (disk full?)")
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: a temporary file beside it, fsynced, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        append_line(self.path, json.dumps(record) + "\n")
        self._add_scalars(record)
        self._tb.flush()

    def records(self) -> list[dict[str, Any]]:
        """The JSONL lines written so far, in order (empty on processes that do not write)."""
        if not self.enabled or not self.path.exists():
            return []
        return read_jsonl(self.path)[0]

    def truncate_after(self, step: int, drop_eval_at_step: bool = False) -> None:
        """Drops lines with ``step > step``, so the files match a run restored at ``step`` (-1: drop all).

        The TensorBoard event files cannot be cut in place: when lines were dropped they are deleted and
        rewritten from the kept lines (with their original wall times), so no stale point survives a restart.
        A cut-off last line (``read_jsonl``) is removed too, so that the next line starts on a line of its own.

        Args:
          step: the last step kept.
          drop_eval_at_step: also drop ``eval/`` lines at ``step`` itself (their evaluation runs again).
        """
        if not self.enabled or not self.path.exists():
            return
        records, torn = read_jsonl(self.path)

        def keep(record: dict[str, Any]) -> bool:
            if record["step"] == step and drop_eval_at_step:
                return not any(k.startswith("eval/") for k in record)
            return record["step"] <= step

        kept = [r for r in records if keep(r)]
        if len(kept) == len(records) and not torn:
            return
        replace_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if len(kept) == len(records):  # only the cut-off line went: the event files hold no point of it
            return
        self._tb.close()
        shutil.rmtree(self.tb_dir, ignore_errors=True)
        self._tb = self._open_tb()
        for record in kept:
            self._add_scalars(record, walltime=record.get("time"))
        self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the TensorBoard files; a second call does nothing. A failed flush (a full disk)
        only warns: ``close`` runs on the way out of a failing run, whose own error must be the one reported."""
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError as e:
                log.warning("%s: the last TensorBoard points could not be written (%s)", self.tb_dir, e)
