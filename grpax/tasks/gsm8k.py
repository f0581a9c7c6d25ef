"""GSM8K (Cobbe et al. 2021) as a task: grade-school word problems with a numeric final answer.

GSM8K ("Training Verifiers to Solve Math Word Problems") stores each row as a ``question`` and an ``answer``
holding the worked solution, whose last line is ``#### <number>`` (``extract_gold`` reads it). Rows are read with
``grpax.data.datasets.read_rows`` and checked here (a prompt that is text, a gold answer that is a finite number;
the file, row and column named otherwise): ``question``, ``answer`` = the worked solution, ``gold`` = its final
number, and every column of the row (for user reward functions, TRL's convention). The prompts (``PROMPTS``) ask
for the working between ``<reasoning>`` tags and the number between ``<answer>`` tags; the rewards are the
MaxText / Tunix point values of ``grpax.tasks.gsm8k_rewards`` picked by ``reward_preset``, and a completion is
correct when the last ``<answer>`` block equals the gold number (``is_correct``). This is grpax's default task and
what train_rl did before tasks existed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpax.data.datasets import read_rows, require_columns, require_values, with_all_columns
from grpax.data.prompts import PromptPreset
from grpax.tasks.answers import ANSWER_END, ANSWER_START, extract_answer, is_close, is_correct
from grpax.tasks.base import Task, UserRewards, read_dataset
from grpax.tasks.gsm8k_rewards import (
    REASONING_END,
    REASONING_START,
    RewardConfig,
    is_format_exact,
    score_completions,
)

_MAXTEXT_SYSTEM = (
    "You will be given a math word problem. Work it out step by step and write all of your working "
    f"between {REASONING_START} and {REASONING_END}. After that, give only the final number between "
    f"{ANSWER_START} and {ANSWER_END}."
)

# A 135M model rarely invents the tag layout from an instruction alone; one short worked example in the
# user turn plus a pre-filled opening tag gives it a pattern to copy.
_SMOLLM2_SYSTEM = "You are a careful assistant who solves grade-school math problems."
_SMOLLM2_TEMPLATE = (
    f"Solve the problem. Write your steps inside {REASONING_START} {REASONING_END} and the final number "
    f"inside {ANSWER_START} {ANSWER_END}.\n\n"
    "Example problem: A shop sells pens at $2 each. Sam buys 4 pens. How much does he pay?\n"
    f"{REASONING_START}\n4 pens cost 4 * 2 = 8 dollars.\n{REASONING_END}\n"
    f"{ANSWER_START}\n8\n{ANSWER_END}\n\n"
    "Problem: {question}"
)

# environment=calculator for a small model: it copies the worked example and overlooks a system prompt's tool
# instructions, so here the example itself calls the calculator, with the environment's exact answers.
_SMOLLM2_CALCULATOR_TEMPLATE = (
    f"Solve the problem. Write your steps inside {REASONING_START} {REASONING_END} and the final number "
    f"inside {ANSWER_START} {ANSWER_END}. Do each calculation with the calculator: write it between "
    "<calculator> and </calculator>, and its result follows between <result> and </result>.\n\n"
    "Example problem: A shop sells pens at $2 each. Sam buys 4 pens and pays with a $10 bill. How much change "
    "does he get?\n"
    f"{REASONING_START}\n4 pens cost <calculator>4 * 2</calculator><result>8</result>\n8 dollars. His change is "
    f"<calculator>10 - 8</calculator><result>2</result>\n2 dollars.\n{REASONING_END}\n"
    f"{ANSWER_START}\n2\n{ANSWER_END}\n\n"
    "Problem: {question}"
)

# GSM8K's prompt presets (prompt_preset=...): each asks for a number between <answer> tags.
PROMPTS: dict[str, PromptPreset] = {
    "maxtext": PromptPreset(system_prompt=_MAXTEXT_SYSTEM, user_template="{question}", response_prefix=""),
    "smollm2_demo": PromptPreset(
        system_prompt=_SMOLLM2_SYSTEM, user_template=_SMOLLM2_TEMPLATE, response_prefix=f"{REASONING_START}\n"
    ),
    "smollm2_calculator": PromptPreset(
        system_prompt=_SMOLLM2_SYSTEM,
        user_template=_SMOLLM2_CALCULATOR_TEMPLATE,
        response_prefix=f"{REASONING_START}\n",
    ),
}


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
        DatasetUnavailableError: (a ValueError) if a Hub name cannot be loaded here (raised at once offline), or
            a Parquet file needs pyarrow.
        ValueError: if a row lacks a field or its answer has no final number (file, row and field named).

    Example:
        >>> rows = load_dataset_rows("../shared/data/gsm8k", "test")  # doctest: +SKIP
        >>> rows[0]["gold"]  # doctest: +SKIP
        '18'
    """
    raw, source = read_dataset(path_or_name, split)
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


def load_completions_file(path: str | Path) -> list[dict]:
    """Reads completions made elsewhere (e.g. vLLM) from a JSONL file.

    Each line needs ``question``, ``answer`` (a bare number or a full GSM8K solution ending in ``#### N``)
    and ``completion``. Keep a question's samples on consecutive lines for ``grpax.eval.metrics.summarize``.

    Args:
        path: the JSONL file.

    Returns:
        Rows ``{"question": str, "answer": str (gold number), "completion": str}``.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if a line is not a JSON object, lacks a field, or its answer has no number (file and line
            named), or the file holds no completions.

    Example:
        >>> rows = load_completions_file("runs/vllm_samples.jsonl")  # doctest: +SKIP
        >>> rows[0]["answer"]  # doctest: +SKIP
        '72'
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"completions file {path} does not exist")
    rows = []
    with path.open(encoding="utf-8-sig") as f:  # a byte-order mark is not part of the first line
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} is not valid JSON ({e.msg})") from e
            if not isinstance(r, dict):
                raise ValueError(
                    f"{path}: line {line_no} is a JSON {type(r).__name__}, not an object with question, "
                    "answer, completion"
                )
            missing = [k for k in ("question", "answer", "completion") if k not in r]
            if missing:
                raise ValueError(
                    f"{path}: line {line_no} lacks field(s) {missing}; each line needs question, answer, completion"
                )
            gold = extract_gold(str(r["answer"]))
            if gold is None:
                raise ValueError(
                    f"{path}: line {line_no} field 'answer' is neither a number nor a solution ending in '#### N'"
                )
            rows.append({"question": str(r["question"]), "answer": gold, "completion": str(r["completion"])})
    if not rows:
        raise ValueError(f"{path} holds no completions: each line needs question, answer, completion")
    return rows


class GSM8KTask(Task):
    """GSM8K: ``<answer>`` tags holding a number; user reward functions get every dataset column by its own name
    and, beside them, MaxText's ``question``, ``answer`` (the gold number, as MaxText passes it) and ``solution``
    (the worked solution) as keywords."""

    name = "gsm8k"
    completions_file = "a .jsonl file of question, answer"

    def __init__(
        self,
        preset: PromptPreset,
        reward_config: RewardConfig,
        user_rewards: UserRewards | None = None,
        prompt_field: str = "question",
        answer_field: str = "answer",
    ):
        super().__init__(preset, user_rewards)
        self.reward_config = reward_config
        self.prompt_field = prompt_field
        self.answer_field = answer_field

    def load_rows(self, dataset: str, split: str) -> list[dict]:
        """Rows ``{"question", "answer", "gold", "columns"}`` of ``split`` of ``dataset``.

        Raises:
          ValueError: a row lacks the prompt or answer column, or holds a null, a non-text prompt, or an answer
            without a final finite number (file, row, column and value named).
        """
        raw, source = read_dataset(dataset, split, self.hf_subset)
        return [self._row(r, source, i) for i, r in enumerate(with_all_columns(raw))]

    def _row(self, r: dict, source: str, i: int) -> dict:
        keys = {"prompt_field": self.prompt_field, "answer_field": self.answer_field}
        require_columns(r, source, i, keys)
        require_values(r, source, i, keys)
        question, answer = r[self.prompt_field], r[self.answer_field]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"{source}: row {i + 1} column {self.prompt_field!r} (prompt_field) holds {str(question)[:60]!r}, "
                "not the question's text: fix the row or drop it"
            )
        gold = None if isinstance(answer, (bool, dict, list)) else extract_gold(str(answer))
        if gold is None:
            raise ValueError(
                f"{source}: row {i + 1} field {self.answer_field!r} has no '#### <number>' line and is not a number: "
                f"{str(answer)[-80:]!r}; the {self.answer_field!r} column must hold the gold answer"
            )
        try:
            finite = math.isfinite(float(gold))
        except ValueError:  # a non-numeric final answer (a fraction, a word) is judged as text
            finite = True
        if not gold or not finite:
            raise ValueError(
                f"{source}: row {i + 1} column {self.answer_field!r} (answer_field) ends in {gold!r}, not a finite "
                "number: the gold answer must be one (fix the row or drop it)"
            )
        return {"question": question, "answer": str(answer), "gold": gold, "columns": r}

    def read_completions(self, path: Path, key: str) -> tuple[list[dict], list[str], list[Any]]:
        """GSM8K's completions file: JSONL lines of ``question``, ``answer`` (a number or a solution ending in
        ``#### N``) and ``completion`` (``load_completions_file``; its errors name the file and line)."""
        lines = load_completions_file(path)
        rows = [{"question": r["question"], "answer": r["answer"], "gold": r["answer"]} for r in lines]
        stored, _ = read_rows(str(path), "")  # as written, with any response_prefix
        return rows, [str(r["completion"]) for r in lines], stored

    def columns(self, row: dict) -> dict[str, Any]:
        # The dataset's own columns (a user's target column by its name), then MaxText's three names.
        own = row.get("columns", {})
        return {**own, "question": row["question"], "answer": row["gold"], "solution": row["answer"]}

    def builtin_scores(self, rows: list[dict], completions: list[str]) -> dict[str, list[float]]:
        return score_completions(
            [r["question"] for r in rows],
            completions,
            [r["gold"] for r in rows],
            self.reward_config,
            response_prefix=self.preset.response_prefix,
        )

    def judge(self, row: dict, text: str, scores: Mapping[str, float]) -> dict[str, Any]:
        extracted = extract_answer(text)
        return {
            "extracted_answer": extracted,
            "correct": is_correct(extracted, row["gold"]),
            "close": is_close(extracted, row["gold"]),
            "formatted": is_format_exact(text),
        }

    def step_correct(self, rows: list[dict], completions: list[str], scores: Mapping[str, Any]) -> list[bool]:
        # With the built-in rewards a step's accuracy is the answer reward's top tier (it needs the layout
        # when the preset requires it), as train_rl has always logged it; with no points for it (reward_preset=none)
        # every completion reaches that tier, so the answer check judges instead.
        if self.user_rewards is None and "answer_correct" in scores and self.reward_config.answer_exact > 0:
            return [v >= self.reward_config.answer_exact for v in scores["answer_correct"]]
        return super().step_correct(rows, completions, scores)

    def is_correct(self, answer: str | None, gold: str) -> bool:
        return is_correct(answer, gold)
