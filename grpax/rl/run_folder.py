"""The run folder ``<base_output_directory>/<run_name>``: who may write it, and what marks it as a grpax run.

``grpax train_rl`` resumes whatever run folder its ``run_name`` names, so two things must never happen: a second
job writing the folder of a running one (it would drop the first one's metrics and overwrite its checkpoints), and
a run taking over a folder that holds something else (a Hugging Face export, a dataset). ``claim_run_folder``
guards both before anything in the folder is read or written:

- A grpax run folder is one that is absent or empty, or holds ``run.lock``, ``metrics.jsonl``,
  ``checkpoints/actor/`` or a ``config.json`` with train_rl's keys (``GRPAX_CONFIG_KEYS``). Any other existing
  folder is refused.
- ``run.lock`` is held with ``fcntl.flock`` by process 0 for the whole run; the kernel releases it when the
  process ends in any way (an exception, a signal, ``kill -9``), so a lock left by a dead job never blocks. The
  file also records the holder's pid and host for the message another job prints.
- A run that fails before it wrote anything of value (a finished checkpoint step, a metrics line or an
  evaluation) removes the folder, when it created that folder itself.
- A run killed with ``kill -9`` leaves its reference copy ``<run>/.reference`` (``grpax.rl.reference``; 0.54 GB
  for 135M parameters, 32 GB for 8B in float32). Every run's start removes such copies from the run folders
  beside its own whose ``run.lock`` no live process holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from grpax.config import ConfigError

LOCK_FILE = "run.lock"
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)  # the disk, not the run, is the matter
REFERENCE_DIR = ".reference"  # grpax.rl.reference.offload_folder's folder inside a run
log = logging.getLogger("grpax.train")
GRPAX_CONFIG_KEYS = frozenset(
    {"run_name", "base_output_directory", "load_parameters_path", "num_generations"}
)


def _has_grpax_config(run_dir: Path) -> bool:
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and GRPAX_CONFIG_KEYS <= config.keys()


def check_run_folder(run_dir: Path) -> None:
    """Refuses an existing ``run_dir`` that is not a grpax run folder (see the module docstring).

    Raises:
      ConfigError: ``run_dir`` is a file, or a non-empty folder without grpax's run files (names what it holds).
    """
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} is a file: pass another run_name or base_output_directory")
    names = sorted(p.name for p in run_dir.iterdir())
    markers = (run_dir / LOCK_FILE, run_dir / "metrics.jsonl", run_dir / "checkpoints" / "actor")
    if not names or any(p.exists() for p in markers) or _has_grpax_config(run_dir):
        return
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise ConfigError(
        f"run folder {run_dir} exists and is not a grpax run (it holds {shown}; no metrics.jsonl, "
        "checkpoints/actor or train_rl config.json): train_rl never writes into it; pass another run_name "
        "or base_output_directory"
    )


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<run_dir>/run.lock``, with the holder's pid and host written in it.

    Raises:
      ConfigError: another live process holds the lock (names its pid, host and start time, and the fix).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            raise ConfigError(
                f"run folder {run_dir} is in use by another grpax train_rl (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}; lock {self.path}): wait for "
                "it to finish, or pass another run_name"
            ) from None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)

    def _holder(self) -> dict:
        try:
            return json.loads(os.pread(self.fd, 4096, 0) or b"{}")
        except ValueError:  # the holder has not written its record yet
            return {}

    def release(self) -> None:
        """Unlocks; the file stays (deleting a flock file lets two later jobs lock two different files)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _holds_results(run_dir: Path) -> bool:
    """Whether the run wrote anything of value: a finished checkpoint step, a metrics line, an evaluation."""
    steps = run_dir / "checkpoints" / "actor"
    if steps.is_dir() and any(p.name.isdigit() for p in steps.iterdir()):
        return True
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        return True
    return (run_dir / "eval").is_dir() and any((run_dir / "eval").iterdir())


def remove_stale_references(base_dir: Path) -> None:
    """Removes ``<base_dir>/*/.reference`` of runs that no live process holds (their ``run.lock`` is free).

    The lock is held while the folder goes, so a job starting that run meanwhile waits its turn (and writes its
    own copy afresh).
    """
    for reference in base_dir.glob(f"*/{REFERENCE_DIR}"):
        lock_path = reference.parent / LOCK_FILE
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:  # no lock file: not a grpax run folder's copy, or not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live run holds it
            os.close(fd)
            continue
        try:
            size = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file())
            shutil.rmtree(reference, ignore_errors=True)
            log.info(
                "removed %s (%.2f GB), the reference copy of a run that was killed", reference, size / 1e9
            )
        finally:
            os.close(fd)


@contextlib.contextmanager
def claim_run_folder(run_dir: Path, main_process: bool) -> Iterator[None]:
    """Checks ``run_dir`` (``check_run_folder``) and, on process 0, creates it and holds ``run.lock`` until the
    block ends; a failure that leaves nothing of value removes a folder this call created.

    Raises:
      ConfigError: ``run_dir`` is not a grpax run folder, or another job holds its lock.
    """
    check_run_folder(run_dir)
    if not main_process:
        yield
        return
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)  # on failure the folder stays: the holder may have created it an instant ago
    except OSError as e:  # a read-only or full base_output_directory: one line, not a traceback
        raise ConfigError(
            f"cannot write the run folder {run_dir} ({e.strerror or e}): pass a base_output_directory you can "
            "write to (with free space), or fix its permissions"
        ) from None
    try:
        remove_stale_references(run_dir.parent)
        yield
    except BaseException as e:
        if created and not _holds_results(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _DISK_ERRORS:  # say where, and that the same command resumes
            where = f" ({e.filename})" if e.filename else ""
            raise ConfigError(
                f"writing the run folder {run_dir} failed: {e.strerror}{where}: free space there (or pass a "
                "base_output_directory with room), then run the same command to resume from its last checkpoint"
            ) from e
        raise
    finally:
        lock.release()
