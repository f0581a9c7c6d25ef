"""Output files of the commands: never overwrite one unless asked, and write each atomically.

``grpax evaluate output_path=DIR`` and ``grpax generate output_path=FILE`` used to replace whatever was there (a
run's own ``eval/after/results.jsonl`` included) by truncating it and writing in place, so a kill or a full disk
mid-write left half a file. Now an existing output is refused unless ``overwrite=true``, before any model loads,
and every file is written to a temporary name beside it, fsynced and renamed over the target: a reader sees the
old file or the new one, never a part.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from grpax.errors import ConfigError


def check_output(key: str, path: str | Path, overwrite: bool, names: Iterable[str] = ()) -> None:
    """Refuses an output that exists unless ``overwrite``.

    Args:
      key: the config key that named it (``output_path``), for the message.
      path: a file, or, with ``names``, a folder whose files ``names`` are the outputs.
      overwrite: the ``overwrite`` key: replace existing outputs.
      names: the file names written inside the folder ``path``; empty when ``path`` is the file.

    Raises:
      ConfigError: the output (or one of the folder's output files) exists and ``overwrite`` is false, or the
        path is of the wrong kind (a folder where a file goes, or the other way round).
    """
    path = Path(path).expanduser()
    names = list(names)
    if names:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{key}={path} is a file: pass a folder (it receives {', '.join(names)})")
        existing = [str(path / n) for n in names if (path / n).exists()]
    else:
        if path.is_dir():
            raise ConfigError(f"{key}={path} is a folder: pass a file name, e.g. {path}/out.jsonl")
        existing = [str(path)] if path.exists() else []
    if existing and not overwrite:
        raise ConfigError(
            f"{key}={str(path)!r}: {', '.join(existing)} already {'exist' if len(existing) > 1 else 'exists'} and would be replaced: pass overwrite=true "
            f"to replace it, or another {key}"
        )


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file beside it (fsynced, then renamed over ``path``);
    the temporary file goes on any failure (a full disk)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
