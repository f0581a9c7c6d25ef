"""GSM8K data: loading rows, a resumable shuffled prompt iterator, chat-template rendering, tokenization.

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") stores each row as a
``question`` and an ``answer`` holding the worked solution, whose last line is ``#### <number>``. Rows load
from a local JSONL / Parquet file, a folder in either layout (including the Hugging Face Hub's
``main/{split}-*.parquet``), or a Hub name through the ``datasets`` library. Offline, a Hub name fails at once
with a message asking for a local path, rather than retrying for minutes.

Prompts are rendered with the tokenizer's own chat template (``add_generation_prompt=True``) plus an
optional pre-filled ``response_prefix``, then tokenized with ``add_special_tokens=False`` because the
template already writes BOS where the model has one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpax.data.prompts import PromptPreset
from grpax.errors import ConfigError

logger = logging.getLogger(__name__)
_train_log = logging.getLogger("grpax.train")  # the name prepare_rows has always logged under

_HUB_HOST = "huggingface.co"
_HUB_TIMEOUT_S = 2.0
_TRUE = ("1", "true", "yes", "on")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetUnavailableError(ValueError):
    """A dataset name or path that cannot be loaded here; the message says what to pass instead."""


def extract_gold(answer_text: str) -> str | None:
    """Returns the gold number of a GSM8K solution.

    Args:
        answer_text: a full solution ending in ``#### <number>``, or a bare number.

    Returns:
        The text after the last ``####``, stripped, with thousands separators removed (``"1,000"`` ->
        ``"1000"``); for text without ``####`` that is a bare number, that number; else None.

    Example:
        >>> extract_gold("48/2 = 24\\n#### 1,000"), extract_gold(" 72 "), extract_gold("no marker")
        ('1000', '72', None)
    """
    if "####" in answer_text:
        return answer_text.rsplit("####", 1)[1].strip().replace(",", "")
    candidate = answer_text.strip().replace(",", "")
    try:
        float(candidate)
    except ValueError:
        return None
    return candidate


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


def _load_from_hub(name: str, split: str) -> list[dict]:
    hint = f"pass a local path instead, e.g. dataset_name=../shared/data/gsm8k (a folder with {split}.jsonl)"
    if any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise DatasetUnavailableError(f"cannot load Hub dataset {name!r}: offline mode is set; {hint}")
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise DatasetUnavailableError(
            f"cannot load Hub dataset {name!r}: the datasets library is not installed "
            f"(pip install 'grpax[hub]'); or {hint}"
        ) from e
    if not _hub_reachable():
        raise DatasetUnavailableError(f"cannot load Hub dataset {name!r}: {_HUB_HOST} is unreachable; {hint}")
    config = "main" if name.rstrip("/").endswith("gsm8k") else None
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:
        raise DatasetUnavailableError(
            f"cannot load Hub dataset {name!r} (split {split!r}): {e}; {hint}"
        ) from e


def _is_hub_name(name: str) -> bool:
    """``owner/name`` as the Hub spells a dataset (not a path: no leading ./ ~, no suffix, no local owner)."""
    owner = name.split("/", 1)[0]
    return bool(_HUB_NAME.fullmatch(name)) and not Path(owner).exists() and not name.endswith(_SUFFIXES)


def dataset_files(path_or_name: str, split: str) -> list[Path]:
    """The local files holding ``split`` of a dataset file or folder; [] for a Hub name (``owner/name``).

    Raises:
        FileNotFoundError: a path (anything but ``owner/name``) that does not exist, or a folder without
            the split; the message lists what the loader accepts.
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return _files_in_folder(path, split)
    if path.is_file():
        return [path]
    if _is_hub_name(path_or_name):
        return []
    raise FileNotFoundError(
        f"dataset path {path_or_name!r} does not exist (relative to {Path.cwd()}); pass a .jsonl/.parquet file, "
        f"a folder with {split}.jsonl or {split}.parquet, or a Hub name owner/name such as openai/gsm8k"
    )


def dataset_source(path_or_name: str, split: str) -> str:
    """What ``load_dataset_rows(path_or_name, split)`` reads: its resolved files, or the Hub name and split.

    Two sources are equal exactly when they yield the same rows (a file has no splits).
    """
    files = dataset_files(path_or_name, split)
    return ",".join(str(f.resolve()) for f in files) if files else f"hub:{path_or_name}:{split}"


def read_rows(path_or_name: str, split: str) -> tuple[list[dict], str]:
    """The raw rows (every column) of ``split`` of a file, a folder or a Hub dataset, and where they came from.

    Args:
        path_or_name: as ``load_dataset_rows`` takes it.
        split: used for folders and Hub names (a file has no splits).

    Returns:
        ``(rows, source)``: one dict per row, and the file (or ``Hub dataset NAME``) for error messages.

    Raises:
        FileNotFoundError, DatasetUnavailableError, ImportError: as ``load_dataset_rows``.
    """
    files = dataset_files(path_or_name, split)
    if files:
        source = str(files[0]) if len(files) == 1 else f"{files[0].parent}/{split}-*.parquet"
        return (_read_parquet(files) if files[0].suffix == ".parquet" else read_jsonl(files[0])), source
    return _load_from_hub(path_or_name, split), f"Hub dataset {path_or_name}"


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


def load_dataset_rows(
    path_or_name: str,
    split: str,
    question_field: str = "question",
    answer_field: str = "answer",
) -> list[dict]:
    """Loads GSM8K-style rows from a file, a folder or the Hugging Face Hub.

    Args:
        path_or_name: a ``.jsonl`` or ``.parquet`` file; a folder with ``{split}.jsonl``, ``{split}.parquet``,
            ``{split}-*.parquet`` or ``main/{split}-*.parquet``; or a Hub name ``owner/name`` such as ``openai/gsm8k``
            (config ``main``), which needs the ``datasets`` library and a network.
        split: ``"train"`` or ``"test"`` (used for folders and Hub names).
        question_field: the column holding the question.
        answer_field: the column holding the solution (ending in ``#### N``) or a bare number.

    Returns:
        Rows ``{"question": str, "answer": str, "gold": str}``, ``gold`` being the final number without
        thousands separators.

    Raises:
        FileNotFoundError: if a path does not exist or a folder lacks the split.
        DatasetUnavailableError: (a ValueError) if a Hub name cannot be loaded here; raised at once offline.
        ImportError: for Parquet without pyarrow.
        ValueError: if a row lacks a field or its answer has no final number (file, row and field named).

    Example:
        >>> rows = load_dataset_rows("../shared/data/gsm8k", "test")  # doctest: +SKIP
        >>> rows[0]["gold"]  # doctest: +SKIP
        '18'
    """
    raw, source = read_rows(path_or_name, split)
    rows = []
    for i, r in enumerate(raw):
        require_columns(r, source, i, {"prompt_field": question_field, "answer_field": answer_field})
        answer = str(r[answer_field])
        gold = extract_gold(answer)
        if gold is None:
            raise ValueError(
                f"{source}: row {i + 1} field {answer_field!r} has no '#### <number>' line and is not a number: "
                f"{answer[-80:]!r}; the {answer_field!r} column must hold the gold answer"
            )
        rows.append({"question": str(r[question_field]), "answer": answer, "gold": gold})
    return rows


class PromptIterator:
    """Endless, seeded, resumable iterator over batches of rows.

    Each epoch visits the rows in a fresh permutation drawn from ``numpy.random.default_rng((seed, epoch))``.
    Batches always hold ``batch_size`` rows, so leftover rows at the end of an epoch (fewer than a batch) are
    skipped for that epoch. ``state_dict`` / ``load_state_dict`` resume exactly where a run stopped.

    Args:
        rows: the rows to serve (already length-filtered).
        batch_size: rows per batch.
        seed: shuffle seed.

    Raises:
        ValueError: if batch_size < 1 or there are fewer rows than batch_size.

    Example:
        >>> it = PromptIterator([{"q": i} for i in range(5)], batch_size=2, seed=0)
        >>> len(next(it)), it.state_dict()["index"]
        (2, 2)
    """

    def __init__(self, rows: Sequence[dict], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(rows) < batch_size:
            raise ValueError(f"need at least batch_size={batch_size} rows, got {len(rows)}")
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    @property
    def num_batches_per_epoch(self) -> int:
        """Full batches per epoch (leftover rows are skipped)."""
        return len(self.rows) // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.rows))

    def __iter__(self) -> Iterator[list[dict]]:
        return self

    def __next__(self) -> list[dict]:
        if self.index + self.batch_size > len(self.rows):
            self.epoch += 1
            self.index = 0
            self._order = self._permutation(self.epoch)
        batch = [self.rows[j] for j in self._order[self.index : self.index + self.batch_size]]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"epoch", "index", "seed"}``: enough to resume at the next batch."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores a position saved by ``state_dict``.

        Args:
            state: ``{"epoch": int, "index": int, "seed": int}``.

        Raises:
            ValueError: if the index is out of range for these rows.
        """
        if not 0 <= int(state["index"]) <= len(self.rows):
            raise ValueError(f"iterator index {state['index']} out of range for {len(self.rows)} rows")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)


def build_messages(
    question: str, system_prompt: str, template: str = "{question}", system_role: bool = True
) -> list[dict[str, str]]:
    """Builds the chat messages for one question.

    Args:
        question: the problem text.
        system_prompt: system text; empty for none.
        template: user-turn text with a ``{question}`` slot (plain replacement; other braces are kept).
        system_role: if False (for chat templates without a system role), the system text is put at the top
            of the user turn instead.

    Returns:
        ``[{"role": "system", "content": ...}, {"role": "user", "content": ...}]`` (no system message if
        ``system_prompt`` is empty or ``system_role`` is False).

    Example:
        >>> build_messages("1+1?", "Be brief.", "Q: {question}")
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Q: 1+1?'}]
    """
    user = template.replace("{question}", question)
    if system_prompt and not system_role:
        return [{"role": "user", "content": f"{system_prompt}\n\n{user}"}]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": user}]


def render_prompt(tokenizer: Any, question: str, preset: PromptPreset, system_role: bool = True) -> str:
    """Renders one question as prompt text with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        question: the problem text.
        preset: the system prompt, user template and response prefix (a named one:
            ``grpax.tasks.prompts.get_prompt_preset``).
        system_role: see ``build_messages``.

    Returns:
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` followed by the
        preset's ``response_prefix``.

    Example:
        >>> render_prompt(tok, "1+1?", PromptPreset("", response_prefix="<reasoning>\\n")).endswith("<reasoning>\\n")  # doctest: +SKIP
        True
    """
    messages = build_messages(question, preset.system_prompt, preset.user_template, system_role)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + preset.response_prefix


def tokenize_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Tokenizes rendered prompts without adding special tokens (the chat template wrote them).

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: rendered prompt strings.

    Returns:
        Token ids per prompt (lengths vary; no padding).

    Example:
        >>> tokenize_prompts(tok, ["<s>user: hi"])  # doctest: +SKIP
        [[1, 5, 6]]
    """
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def filter_by_length(
    rows: Sequence[dict], token_ids: Sequence[Sequence[int]], max_prompt_length: int
) -> tuple[list[dict], list[list[int]], int]:
    """Drops prompts longer than ``max_prompt_length`` tokens and logs how many.

    Args:
        rows: dataset rows.
        token_ids: prompt token ids, aligned with rows.
        max_prompt_length: the longest prompt kept, in tokens.

    Returns:
        ``(kept_rows, kept_ids, num_dropped)``.

    Raises:
        ValueError: if rows and token_ids differ in length.

    Example:
        >>> filter_by_length([{"q": 1}, {"q": 2}], [[1, 2, 3], [1]], max_prompt_length=2)
        ([{'q': 2}], [[1]], 1)
    """
    if len(rows) != len(token_ids):
        raise ValueError(f"rows ({len(rows)}) and token_ids ({len(token_ids)}) must have the same length")
    kept = [(r, list(ids)) for r, ids in zip(rows, token_ids, strict=True) if len(ids) <= max_prompt_length]
    num_dropped = len(rows) - len(kept)
    if num_dropped:
        logger.info(
            "dropped %d of %d prompts longer than %d tokens", num_dropped, len(rows), max_prompt_length
        )
    return [r for r, _ in kept], [ids for _, ids in kept], num_dropped


def too_few_rows(
    key: str, dataset: str, split_key: str, split: str, got: str, need: str, fix: str
) -> ConfigError:
    """The error for a dataset with fewer rows than a run needs (the keys that chose it named)."""
    return ConfigError(f"{key}={dataset!r} ({split_key}={split!r}) has {got}, fewer than {need}: {fix}")


def prepare_rows(
    tokenizer: Any,
    dataset: str,
    split: str,
    preset: PromptPreset,
    max_prompt_length: int,
    limit: int = -1,
    *,
    need: tuple[str, str, int] = ("dataset_name", "split", 0),
    load: Callable[[str, str], list[dict]] = load_dataset_rows,
    render: Callable[[dict], str] | None = None,
) -> list[dict]:
    """Loads a split, renders and tokenizes its prompts (``row["prompt_ids"]``), drops over-long ones.

    Args:
      limit: keep the first ``limit`` rows after filtering (-1: all).
      need: ``(dataset key, split key, rows)``: refuse fewer rows than that after the length filter.
      load: ``(dataset, split) -> rows`` with a ``question`` each (a task's ``load_rows``; GSM8K's by default).
      render: a row's prompt text as it is sampled, when it is not ``render_prompt`` of its question with
        ``preset`` (an environment adds its instructions: ``grpax.rl.multi_turn.prompt_renderer``), so that
        the length filter measures the prompt the sampler gets; None: ``render_prompt``.

    Raises:
      ConfigError: fewer rows than ``need`` fit max_prefill_predict_length (the keys, counts and fix named).
    """
    rows = load(dataset, split)
    if render is None:
        texts = [render_prompt(tokenizer, row["question"], preset) for row in rows]
    else:
        texts = [render(row) for row in rows]
    ids = tokenize_prompts(tokenizer, texts)
    rows, ids, dropped = filter_by_length(rows, ids, max_prompt_length)
    _train_log.info(
        "%s/%s: %d prompts (%d longer than max_prefill_predict_length=%d dropped)",
        dataset,
        split,
        len(rows),
        dropped,
        max_prompt_length,
    )
    key, split_key, count = need
    if len(rows) < count:
        got = f"{len(rows)} prompts of at most max_prefill_predict_length={max_prompt_length} tokens ({dropped} longer)"
        fix = "raise max_prefill_predict_length or pass a larger dataset"
        raise too_few_rows(key, dataset, split_key, split, got, f"the {count} needed", fix)
    for row, row_ids in zip(rows, ids, strict=True):
        row["prompt_ids"] = row_ids
    return rows if limit < 0 else rows[:limit]
