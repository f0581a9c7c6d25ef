"""The task seam: what every task provides, and how reward functions are run and checked.

A task (``grpax.tasks.gsm8k``, ``grpax.tasks.math``, ``grpax.tasks.custom``) provides four things: its rows
(``load_rows``: the dataset's columns, the prompt text and the gold answer of each), the prompt it renders
(the prompt preset or template in ``self.preset``), its reward functions (``score``) and the correctness check
that evaluation counts (``records``). The trainer and ``grpax evaluate`` only talk to this interface.

User reward functions follow MaxText's RL trainer (``reward_functions_path`` / ``reward_functions``) and TRL's
GRPOTrainer (every dataset column as a keyword argument)::

    fn(prompts=[...], completions=[...], tmvp_config=<the run's config>, **columns) -> list[float]

with one value per completion; None or NaN abstains (adds nothing to the weighted total). Built-in rewards that
fail abstain with a warning (``grpax.tasks.gsm8k_rewards.score_completions``); a user's function that raises (or calls
``sys.exit``), returns the wrong number of values or a value that is not a number, or runs past
``reward_timeout_seconds``, stops the run with ``RewardFunctionError`` before the update, so that a broken reward
file never trains a policy on garbage. Each call gets its own copies of the prompts, completions and columns: a
function that edits its inputs in place changes what no other function (and no later epoch) sees.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from grpax.data.datasets import read_rows
from grpax.data.prompts import PromptPreset
from grpax.errors import ConfigError

RewardFn = Callable[..., Sequence[Any]]


class RewardFunctionError(ConfigError):
    """A user reward function raised, returned the wrong number of values or a value that is not a number."""


@dataclass(frozen=True)
class UserRewards:
    """User reward functions, their weights, and the keywords every call gets besides prompts and completions.

    Attributes:
      fns: name -> function, in the order of ``reward_functions``.
      weights: name -> weight of its points in the total (``reward_weights``; 1.0 each by default).
      source: where the functions come from (the file), for error messages.
      extra_kwargs: passed to every call, e.g. ``{"tmvp_config": cfg}``.
      timeout_s: seconds a call may take before the run stops (``reward_timeout_seconds``); 0: no limit.
    """

    fns: Mapping[str, RewardFn]
    weights: Mapping[str, float]
    source: str = ""
    extra_kwargs: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 0.0


def read_dataset(dataset: str, split: str, hf_subset: str = "") -> tuple[list[dict], str]:
    """``grpax.data.datasets.read_rows`` of a task's dataset: its raw rows and their source, for ``Task.load_rows``.

    ``hf_subset`` (MaxText's key) is a Hub dataset's config; '' = its only one, or for GSM8K's Hub copy
    (``openai/gsm8k``, configs ``main`` and ``socratic``: a Hub name ending in ``gsm8k``) ``main``, whichever task
    reads it.

    Raises:
      FileNotFoundError, DatasetUnavailableError, ValueError: as ``read_rows``.
    """
    gsm8k = dataset.rstrip("/").endswith("gsm8k")
    return read_rows(dataset, split, hf_subset or ("main" if gsm8k else None))


def _short(value: Any) -> str:
    """``repr(value)`` on one line, at most 80 characters (a returned array can be long)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _to_points(name: str, source: str, row: int, value: Any) -> float:
    """One returned value as float points; None and NaN abstain (NaN). A 0-d numpy / JAX / torch number counts."""
    if value is None:
        return math.nan
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()  # a 0-d numpy / JAX / torch value: its Python value (a bool stays a bool)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            points = float(value)
        except OverflowError:  # an int beyond float's range (10**400)
            points = math.inf
        if math.isnan(points) or math.isfinite(points):
            return points
    hint = " (a bool: return float(flag))" if isinstance(value, (bool, np.bool_)) else ""
    raise RewardFunctionError(
        f"reward function {name!r} ({source}) returned {_short(value)} for row {row}: expected a finite number, "
        f"or None / NaN to abstain{hint}"
    )


def _as_values(name: str, source: str, raw: Any, n: int) -> list[Any]:
    """What a function returned as a list of N values: a list, tuple, iterator or 1-d array (numpy, JAX).

    Raises:
      RewardFunctionError: a single value, a string, a mapping, an array not 1-d, or other than N values.
    """
    shape = getattr(raw, "shape", None)
    if (
        (shape is not None and len(shape) != 1)
        or isinstance(raw, (str, bytes, Mapping))
        or not hasattr(raw, "__iter__")
    ):
        what = (
            f"an array of shape {tuple(shape)}"
            if shape is not None
            else f"{_short(raw)} (a {type(raw).__name__})"
        )
        raise RewardFunctionError(
            f"reward function {name!r} ({source}) returned {what}: expected a list of {n} numbers, one per completion"
        )
    values = np.asarray(raw).tolist() if shape is not None else list(raw)
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {name!r} ({source}) returned {len(values)} values for {n} "
            "completions: expected one per completion"
        )
    return values


def check_keywords(name: str, fn: RewardFn, source: str, keywords: list[str], partial: bool = False) -> None:
    """Raises RewardFunctionError when ``fn``'s parameters cannot take the call's keywords (checked before a
    call, so that a missing ``**kwargs`` or a parameter named after no column is reported as such, not as a
    crash). ``partial``: only that these keywords are accepted (the columns are not known yet)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: let the call tell
        return
    try:
        (signature.bind_partial if partial else signature.bind)(**dict.fromkeys(keywords))
    except TypeError as e:
        more = " and every dataset column" if partial else ""
        raise RewardFunctionError(
            f"reward function {name!r} ({source}) cannot take this call's keywords {keywords}{more}: {e}; name only "
            "these as parameters and end the list with **kwargs"
        ) from None


def _first_failing_row(fn: RewardFn, prompts, completions, columns, extra) -> tuple[int, Exception] | None:
    """The first row whose call alone raises too (a batch-level failure pinned to a row), or None."""
    for i in range(len(completions)):
        try:
            _invoke(
                fn,
                {
                    "prompts": prompts[i : i + 1],
                    "completions": completions[i : i + 1],
                    **{k: v[i : i + 1] for k, v in columns.items()},
                },
                extra,
                0.0,
            )
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported, with its row
            return i, e
    return None


class TimedOut(Exception):
    """A user call (a reward function, an environment) ran past its time limit (``call_within``)."""


def _invoke(fn: RewardFn, inputs: Mapping[str, Any], extra: Mapping[str, Any], timeout_s: float) -> Any:
    """``fn(**copies of inputs, **extra)``, a generator read to its end; with ``timeout_s`` > 0, in a daemon
    thread that may run at most that long (a hung function cannot be stopped, but the run no longer waits).

    Raises:
      whatever ``fn`` raised (``SystemExit`` included), or ``TimedOut``.
    """

    def call() -> Any:
        raw = fn(**copy.deepcopy(dict(inputs)), **extra)
        return list(raw) if isinstance(raw, Iterator) else raw  # a generator runs its code as it is read

    return call_within(call, timeout_s, "grpax-reward")


def call_within(call: Callable[[], Any], timeout_s: float, thread_name: str) -> Any:
    """``call()``; with ``timeout_s`` > 0, in a daemon thread named ``thread_name`` that may run at most that long
    (a hung call cannot be stopped, but the caller no longer waits for it). Rewards and environments share it.

    Raises:
      whatever ``call`` raised (``SystemExit`` included), or ``TimedOut``.
    """
    if timeout_s <= 0:
        return call()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_reward_function(
    name: str,
    fn: RewardFn,
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
    *,
    source: str = "",
    extra_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 0.0,
) -> list[float]:
    """Calls one user reward function on a batch and checks what it returns.

    Args:
      name: the function's name (as in ``reward_functions``).
      fn: the function, called as ``fn(prompts=, completions=, **extra_kwargs, **columns)``.
      prompts: prompt texts [N] (the dataset's prompt column, before the chat template).
      completions: completion texts [N] (the response prefix, if any, prepended).
      columns: column name -> its values [N], one per completion (every dataset column, TRL's convention).
      source: the file, named in errors.
      extra_kwargs: e.g. ``{"tmvp_config": cfg}`` (MaxText's reward signature).
      timeout_s: seconds the call may take (``reward_timeout_seconds``); 0: no limit.

    Returns:
      Points [N]; NaN where the function abstained (None or NaN).

    Raises:
      RewardFunctionError: the function's parameters cannot take the call's keywords (no ``**kwargs``, or one
        named after no column), it raised or called ``sys.exit`` (the first row that raises alone is named), ran
        past ``timeout_s``, returned other than a
        list / 1-d array of N values, or a value that is neither a finite number nor None / NaN (row and value
        named).

    Example:
      >>> call_reward_function("short", lambda prompts, completions, **kw: [len(c) < 5 for c in completions],
      ...                      ["q"], ["abc"], {})  # doctest: +IGNORE_EXCEPTION_DETAIL
      Traceback (most recent call last):
      RewardFunctionError: reward function 'short' () returned True for row 0: expected a finite number, ...
    """
    extra = dict(extra_kwargs or {})
    check_keywords(name, fn, source, ["prompts", "completions", *extra, *columns])
    try:
        # Its own copies: an in-place edit must not change what the next function (or a later epoch) scores.
        raw = _invoke(fn, {"prompts": prompts, "completions": completions, **columns}, extra, timeout_s)
    except TimedOut:
        raise RewardFunctionError(
            f"reward function {name!r} ({source}) did not return within reward_timeout_seconds={timeout_s:g} on a "
            f"batch of {len(completions)} completions (a hang?): fix the function, or raise reward_timeout_seconds "
            "(0: no limit)"
        ) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - one line naming the function and the row
        failing = _first_failing_row(fn, prompts, completions, columns, extra)
        row, err = failing if failing is not None else (None, e)
        where = f"on row {row} (completion {completions[row][:60]!r})" if row is not None else "on the batch"
        message = " ".join(str(err).split())  # one line
        if isinstance(err, SystemExit):
            raise RewardFunctionError(
                f"reward function {name!r} ({source}) called sys.exit({message}) {where}: a reward function must "
                "return its points (raise an exception to stop the run)"
            ) from None
        raise RewardFunctionError(
            f"reward function {name!r} ({source}) raised {type(err).__name__}: {message} {where}"
        ) from e
    values = _as_values(name, source, raw, len(completions))
    return [_to_points(name, source, i, v) for i, v in enumerate(values)]


def weighted_total(scores: Mapping[str, Sequence[float]], weights: Mapping[str, float]) -> list[float]:
    """Sum over functions of weight * points, abstentions (NaN) skipped; NaN where every function abstained.

    Example:
      >>> weighted_total({"a": [1.0, float("nan")], "b": [2.0, float("nan")]}, {"a": 1.0, "b": 0.5})
      [2.0, nan]
    """
    n = len(next(iter(scores.values()))) if scores else 0
    totals = []
    for i in range(n):
        terms = [weights[k] * v[i] for k, v in scores.items() if not math.isnan(v[i])]
        totals.append(sum(terms) if terms else math.nan)
    return totals


def run_user_rewards(
    rewards: UserRewards, prompts: list[str], completions: list[str], columns: Mapping[str, list[Any]]
) -> dict[str, list[float]]:
    """Every user function's points [N] by name, plus their weighted ``"total"`` [N] (see ``call_reward_function``)."""
    scores = {
        name: call_reward_function(
            name,
            fn,
            prompts,
            completions,
            columns,
            source=rewards.source,
            extra_kwargs=rewards.extra_kwargs,
            timeout_s=rewards.timeout_s,
        )
        for name, fn in rewards.fns.items()
    }
    return {**scores, "total": weighted_total(scores, rewards.weights)}


class Task:
    """A task: its rows, its prompt, its rewards and its correctness check (subclasses fill them in).

    Rows are dicts with ``question`` (the prompt column's text, what the template's ``{question}`` slot holds),
    ``gold`` (the reference answer as text) and whatever the task keeps; ``columns(row)`` is what reward
    functions receive as keyword arguments.

    Attributes:
      name: the ``task`` key's value.
      preset: how a row's question becomes a chat prompt (system prompt, user template, response prefix).
      user_rewards: the user's reward functions, replacing the built-in ones (MaxText), or None.
    """

    name = "task"
    # What a file of completions made elsewhere holds (``read_completions``), for the message naming a missing one.
    completions_file = "a .jsonl / .parquet file of"

    def __init__(self, preset: PromptPreset, user_rewards: UserRewards | None = None):
        self.preset = preset
        self.user_rewards = user_rewards
        self.hf_subset = ""  # a Hub dataset's config (``read_dataset``), set by ``build_task``

    def load_rows(self, dataset: str, split: str) -> list[dict]:
        """The rows of ``split`` of ``dataset`` (a file, a folder or a Hub name)."""
        raise NotImplementedError

    def rows_from(self, raw: list[dict], source: str) -> list[dict]:
        """Task rows from raw rows (every column) read from ``source`` (e.g. a completions file's lines).

        Raises:
          ValueError: a row lacks a column the task needs (the columns it has named).
        """
        raise NotImplementedError

    def read_completions(self, path: Path, key: str) -> tuple[list[dict], list[str], list[Any]]:
        """A file of completions made elsewhere (``grpax evaluate completions_path=``), one per line beside the
        task's columns (``rows_from`` reads them).

        Args:
          path: an existing JSONL or Parquet file.
          key: the key that named it, for errors, e.g. ``"completions_path='c.jsonl'"``.

        Returns:
          ``(rows, completions, lines)``: the task row each line answers, its ``completion`` text, and the
          file's lines as stored (with the ``response_prefix`` grpax's own results.jsonl records).

        Raises:
          ConfigError: a line is not a JSON object or has no ``completion`` (key and line named).
          ValueError: a line lacks a column the task needs (``rows_from``), or is not UTF-8 / JSON.
        """
        lines, source = read_rows(str(path), "")
        for i, line in enumerate(lines):
            if not isinstance(line, dict) or "completion" not in line:
                what = f"is a JSON {type(line).__name__}, not an object" if not isinstance(line, dict) else ""
                raise ConfigError(
                    f"{key}: line {i + 1} {what or 'has no field completion'}; each line needs completion and the "
                    "task's columns"
                )
        stored = ("completion", "response_prefix")  # the record's own fields, not the task's columns
        rows = self.rows_from([{k: v for k, v in r.items() if k not in stored} for r in lines], source)
        return rows, [str(r["completion"]) for r in lines], lines

    def columns(self, row: dict) -> dict[str, Any]:
        """The keyword arguments a reward function gets for this row (its dataset columns)."""
        raise NotImplementedError

    def builtin_scores(self, rows: list[dict], completions: list[str]) -> dict[str, list[float]]:
        """The task's own reward functions' points [N] and ``"total"``, completions without the prefix."""
        raise NotImplementedError

    def judge(self, row: dict, text: str, scores: Mapping[str, float]) -> dict[str, Any]:
        """``extracted_answer``, ``correct``, ``close`` and ``formatted`` of one completion (prefix included)."""
        raise NotImplementedError

    def score(self, rows: list[dict], completions: list[str]) -> dict[str, list[float]]:
        """Points of each reward function and their weighted ``"total"``, one per completion.

        Args:
          rows: the row each completion answers [N] (repeated G times for a group).
          completions: generated texts [N], without the response prefix.

        Raises:
          RewardFunctionError: a user function misbehaved (``call_reward_function``).
        """
        if self.user_rewards is None:
            return self.builtin_scores(rows, completions)
        prefix = self.preset.response_prefix
        per_row = [self.columns(r) for r in rows]
        names = list(per_row[0]) if per_row else []
        columns = {k: [c[k] for c in per_row] for k in names if k not in ("prompts", "completions")}
        prompts = [r["question"] for r in rows]
        return run_user_rewards(self.user_rewards, prompts, [prefix + c for c in completions], columns)

    def step_correct(self, rows: list[dict], completions: list[str], scores: Mapping[str, Any]) -> list[bool]:
        """Which completions of a training step count as correct (the step's ``accuracy``)."""
        texts = [self.preset.response_prefix + c for c in completions]
        return [
            bool(self.judge(r, t, {k: v[i] for k, v in scores.items()})["correct"])
            for i, (r, t) in enumerate(zip(rows, texts, strict=True))
        ]

    def records(self, rows: list[dict], completions: list[str]) -> list[dict]:
        """Scored evaluation records, one per completion (``grpax.eval.metrics.summarize`` reads them).

        Returns:
          ``{"question", "answer", "completion", "response_prefix", "extracted_answer", "correct", "close",
          "formatted", "rewards"}`` per completion; ``rewards`` maps each reward name (and ``"total"``) to its
          points; ``response_prefix`` is the text the completion continues (``grpax evaluate completions_path=``
          prepends it again when it re-scores the file).
        """
        scores = self.score(rows, completions)
        out = []
        for i, (row, completion) in enumerate(zip(rows, completions, strict=True)):
            points = {name: values[i] for name, values in scores.items()}
            judged = self.judge(row, self.preset.response_prefix + completion, points)
            out.append(
                {
                    "question": row["question"],
                    "answer": row["gold"],
                    "completion": completion,
                    "response_prefix": self.preset.response_prefix,
                    **judged,
                    "rewards": points,
                }
            )
        return out

    def is_correct(self, answer: str | None, gold: str) -> bool:
        """Whether an extracted answer equals the gold one (majority voting's check, maj@k)."""
        raise NotImplementedError
