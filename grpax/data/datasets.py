"""Reading any task's rows: a JSONL / Parquet file, a folder of either, or a Hugging Face Hub dataset.

Rows load from a local JSONL / Parquet file or a glob of them (``data/train-*.parquet``), a folder in either
layout (including the Hub's ``main/{split}-*.parquet``), a Hub name ``owner/name`` or Hub files
``hf://datasets/owner/name/<glob>`` (MaxText's ``hf_train_files``) through the ``datasets`` library. Offline, a
Hub name fails at once with a message asking for a local path, rather than retrying for minutes. Rows come back as they
are stored (every column); a task (``grpax.tasks``) checks the columns it needs with ``require_columns``,
``require_values`` and ``require_text``, whose errors name the file, the row, the column and the key that chose it.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpax.errors import ConfigError

_HUB_HOST = "huggingface.co"
_HUB_TIMEOUT_S = 2.0
_TRUE = ("1", "true", "yes", "on")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_FILES = "hf://"
_GLOB = ("*", "?", "[")


class DatasetUnavailableError(ValueError):
    """A dataset name or path that cannot be loaded here; the message says what to pass instead."""


def read_jsonl(path: Path) -> list[Any]:
    """The JSON value of each non-blank line of a UTF-8 JSONL file (a byte-order mark allowed).

    Raises:
        ValueError: a line is not UTF-8 or not JSON (file and 1-based line named).
    """
    return [value for _, value in read_jsonl_lines(path)]


def read_jsonl_lines(path: Path) -> list[tuple[int, Any]]:
    """``read_jsonl``'s values with their 1-based line numbers, for messages about one line."""
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:  # a UTF-8 byte-order mark (Windows editors write one) is not part of the first row
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: line {line_no} is not UTF-8 (byte {e.start + 1} is {raw[e.start : e.start + 1]!r}): "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((line_no, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} is not valid JSON ({e.msg})") from e
    return rows


def _read_parquet(paths: Sequence[Path]) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional dependency
    except ImportError as e:  # a ValueError: the CLI prints it as one line (an ImportError was a traceback)
        raise DatasetUnavailableError(
            f"reading {paths[0]} needs pyarrow: pip install pyarrow (or pass a .jsonl file)"
        ) from e
    rows: list[dict] = []
    for p in paths:
        rows.extend(pq.read_table(p).to_pylist())
    return rows


def _files_in_folder(folder: Path, split: str) -> list[Path]:
    candidates = [
        [folder / f"{split}.jsonl"],
        [folder / f"{split}.parquet"],
        sorted(folder.glob(f"{split}-*.parquet")),
        sorted(folder.glob(f"main/{split}-*.parquet")),
    ]
    for files in candidates:
        if files and all(f.is_file() for f in files):
            return files
    raise FileNotFoundError(
        f"no {split!r} split in folder {folder}: looked for {split}.jsonl, {split}.parquet, "
        f"{split}-*.parquet and main/{split}-*.parquet. Pass a folder holding one of these, or a file path."
    )


def _read_json_array(path: Path) -> list[Any] | None:
    """The rows of a ``.json`` file holding one JSON array (as the ``datasets`` library's json builder reads it);
    None for a file in JSON Lines."""
    text = path.read_text(encoding="utf-8-sig")
    if not text.lstrip().startswith("["):
        return None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        return None  # a JSONL file whose first row is a list: read_jsonl says what is wrong
    return rows if isinstance(rows, list) else None


def _read_files(files: Sequence[Path]) -> list[dict]:
    """The rows of local files in order, each read by its suffix (Parquet; a .json file's JSON array; else
    JSONL)."""
    rows: list[dict] = []
    for f in files:
        if f.suffix == ".parquet":
            rows.extend(_read_parquet([f]))
        else:
            array = _read_json_array(f) if f.suffix == ".json" else None
            rows.extend(read_jsonl(f) if array is None else array)
    return rows


def _hub_reachable(timeout_s: float = _HUB_TIMEOUT_S) -> bool:
    # DNS lookups ignore socket timeouts, so the probe runs in a daemon thread that is abandoned if slow.
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((_HUB_HOST, 443), timeout=timeout_s).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


def _load_from_hub(name: str, split: str, config: str | None) -> list[dict]:
    """A Hub dataset's split, or with ``name`` ``hf://...`` the rows of those Hub files (their one split)."""
    files = name.startswith(_HUB_FILES)
    what = f"Hub files {name!r}" if files else f"Hub dataset {name!r}"
    hint = (
        "download them and pass their local path or glob"
        if files
        else f"pass a local path instead, e.g. dataset_name=../shared/data/gsm8k (a folder with {split}.jsonl)"
    )
    if any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise DatasetUnavailableError(f"cannot load {what}: offline mode is set; {hint}")
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise DatasetUnavailableError(
            f"cannot load {what}: the datasets library is not installed (pip install 'grpax[hub]'); or {hint}"
        ) from e
    if not _hub_reachable():
        raise DatasetUnavailableError(f"cannot load {what}: {_HUB_HOST} is unreachable; {hint}")
    try:
        if files:
            builder = "parquet" if name.endswith(".parquet") else "json"
            return list(datasets.load_dataset(builder, data_files=name, split="train"))
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:
        raise DatasetUnavailableError(f"cannot load {what} (split {split!r}): {e}; {hint}") from e


def _is_hub_name(name: str) -> bool:
    """``owner/name`` as the Hub spells a dataset (not a path: no leading ./ ~, no suffix, no local owner)."""
    owner = name.split("/", 1)[0]
    return bool(_HUB_NAME.fullmatch(name)) and not Path(owner).exists() and not name.endswith(_SUFFIXES)


def dataset_files(path_or_name: str, split: str) -> list[Path]:
    """The local files holding ``split`` of a dataset file, glob or folder; [] for a Hub name (``owner/name``) or
    Hub files (``hf://...``).

    Raises:
        FileNotFoundError: a path (anything but ``owner/name`` or ``hf://``) that does not exist, a glob that
            matches no .jsonl / .json / .parquet file, or a folder without the split; the message lists what
            the loader accepts.
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return _files_in_folder(path, split)
    if path.is_file():
        return [path]
    if path_or_name.startswith(_HUB_FILES) or _is_hub_name(path_or_name):
        return []
    if any(c in path_or_name for c in _GLOB):
        root = Path(path.anchor) if path.is_absolute() else Path()
        files = sorted(
            f for f in root.glob(str(path.relative_to(root))) if f.suffix in _SUFFIXES and f.is_file()
        )
        if files:
            return files
        raise FileNotFoundError(
            f"no .jsonl / .json / .parquet file matches {path_or_name!r} (relative to {Path.cwd()}): pass a glob "
            "of existing files"
        )
    raise FileNotFoundError(
        f"dataset path {path_or_name!r} does not exist (relative to {Path.cwd()}); pass a .jsonl/.parquet file, "
        f"a folder with {split}.jsonl or {split}.parquet, or a Hub name owner/name such as openai/gsm8k"
    )


def read_rows(path_or_name: str, split: str, hub_config: str | None = None) -> tuple[list[dict], str]:
    """The raw rows (every column) of ``split`` of a file, a folder or a Hub dataset, and where they came from.

    Args:
        path_or_name: a ``.jsonl``, ``.json`` (JSON Lines or one array of rows) or ``.parquet`` file or a glob
            of them (read in sorted order); a folder with
            ``{split}.jsonl``, ``{split}.parquet``, ``{split}-*.parquet`` or ``main/{split}-*.parquet``; a Hub name
            ``owner/name``; or Hub files ``hf://datasets/owner/name/<glob>`` (the last two need the ``datasets``
            library and a network).
        split: used for folders and Hub names (a file has no splits, nor do Hub files).
        hub_config: the Hub dataset's config name, for a dataset that has several (None: its only one).

    Returns:
        ``(rows, source)``: one dict per row, and the file (or ``Hub dataset NAME``) for error messages.

    Raises:
        FileNotFoundError: if a path does not exist or a folder lacks the split.
        DatasetUnavailableError: (a ValueError) if a Hub name cannot be loaded here (raised at once offline), or
            a Parquet file needs pyarrow.
        ValueError: a JSONL line is not UTF-8 or not JSON (file and line named).
    """
    files = dataset_files(path_or_name, split)
    if len(files) == 1:
        return _read_files(files), str(files[0])
    if files:  # a glob as given, or a folder's shards
        glob = any(c in path_or_name for c in _GLOB)
        return _read_files(files), path_or_name if glob else f"{files[0].parent}/{split}-*.parquet"
    what = "Hub files" if path_or_name.startswith(_HUB_FILES) else "Hub dataset"
    return _load_from_hub(path_or_name, split, hub_config), f"{what} {path_or_name}"


def require_columns(row: Any, source: str, index: int, columns: dict[str, str]) -> None:
    """Raises ValueError naming the key, the missing column and the columns the row has.

    Args:
        row: one raw row.
        source: its file, for the message.
        index: its 0-based position (messages count rows from 1, as a JSONL file's lines).
        columns: key -> the column that key names, e.g. ``{"prompt_field": "question"}``.
    """
    have = sorted(row) if isinstance(row, dict) else []
    for key, name in columns.items():
        if name not in have:
            raise ValueError(
                f"{source}: row {index + 1} has no column {name!r} ({key}={name!r}); its columns are {have}: "
                f"set {key}=<one of them>"
            )


def is_missing(value: Any) -> bool:
    """Whether a cell holds no value: None (JSON null) or a float NaN (how Parquet / pandas spell a null)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def with_all_columns(rows: list[Any]) -> list[Any]:
    """Rows with every column some row has, None where a row lacks it (as a Parquet / ``datasets`` table reads
    ragged JSONL), in first-seen order; so a reward function gets the same keywords for every batch.

    Example:
        >>> with_all_columns([{"q": "a"}, {"q": "b", "hint": "h"}])
        [{'q': 'a', 'hint': None}, {'q': 'b', 'hint': 'h'}]
    """
    names = dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r)
    return [{k: r.get(k) for k in names} if isinstance(r, dict) else r for r in rows]


def require_values(row: dict, source: str, index: int, columns: dict[str, str]) -> None:
    """Raises ValueError naming the key and the column when a cell the task needs is null (``is_missing``).

    Args:
        row: one raw row (``require_columns`` has passed).
        source: its file, for the message.
        index: its 0-based position (messages count rows from 1, as a JSONL file's lines).
        columns: key -> the column that key names, e.g. ``{"prompt_field": "problem"}``.
    """
    for key, name in columns.items():
        if is_missing(row[name]):
            raise ValueError(
                f"{source}: row {index + 1} has no value in column {name!r} ({key}={name!r}): it is null or absent; fill "
                "it in or drop the row"
            )


def require_text(row: dict, source: str, index: int, key: str, name: str) -> str:
    """The cell of column ``name`` as text; raises ValueError (file, row, column and value named) when it is not a
    non-blank string: a number, a dict or a list of chat messages would otherwise reach the model as its Python
    printed form.

    Args:
        row: one raw row (``require_columns`` and ``require_values`` have passed).
        source: its file, for the message.
        index: its 0-based position (messages count rows from 1, as a JSONL file's lines).
        key: the key naming the column, e.g. ``"prompt_field"``.
        name: the column.
    """
    value = row[name]
    if isinstance(value, str) and value.strip():
        return value
    hint = (
        " (a list of chat messages, TRL's conversational format, is not read: put the user turn's text in a "
        "column and render it with prompt_preset or prompt_template_path)"
        if isinstance(value, list)
        else ""
    )
    raise ValueError(
        f"{source}: row {index + 1} column {name!r} ({key}={name!r}) holds {_short_value(value)}, not text{hint}: "
        "fix the row or drop it"
    )


def _short_value(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)  # one line: JSON escapes newlines
    return text if len(text) <= 60 else text[:57] + "..."


def too_few_rows(
    key: str, dataset: str, split_key: str, split: str, got: str, need: str, fix: str
) -> ConfigError:
    """The error for a dataset with fewer rows than a run needs (the keys that chose it named)."""
    return ConfigError(f"{key}={dataset!r} ({split_key}={split!r}) has {got}, fewer than {need}: {fix}")
