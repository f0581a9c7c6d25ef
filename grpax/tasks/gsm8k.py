"""GSM8K (Cobbe et al. 2021) as a task: grade-school word problems with a numeric final answer.

Rows are read with ``grpax.data.gsm8k.read_rows`` and checked here (a prompt that is text, a gold answer that is a
finite number; the file, row and column named otherwise): ``question``, ``answer`` = the worked solution, ``gold`` =
its final number, and every column of the row (for user reward functions, TRL's convention). The rewards are the MaxText / Tunix point values of ``grpax.tasks.gsm8k_rewards`` picked by
``reward_preset``, and a completion is correct when the last ``<answer>`` block equals the gold number
(``is_correct``). This is grpax's default task and what train_rl did before tasks existed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from grpax.data.gsm8k import extract_gold, read_rows, require_columns, require_values, with_all_columns
from grpax.data.prompts import PromptPreset
from grpax.tasks.answers import extract_answer, is_close, is_correct
from grpax.tasks.base import Task, UserRewards
from grpax.tasks.gsm8k_rewards import RewardConfig, is_format_exact, score_completions


class GSM8KTask(Task):
    """GSM8K: ``<answer>`` tags holding a number; user reward functions get every dataset column by its own name
    and, beside them, MaxText's ``question``, ``answer`` (the gold number, as MaxText passes it) and ``solution``
    (the worked solution) as keywords."""

    name = "gsm8k"

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
        raw, source = read_rows(dataset, split)
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
        # when the preset requires it), as train_rl has always logged it.
        if self.user_rewards is None and "answer_correct" in scores:
            return [v >= self.reward_config.answer_exact for v in scores["answer_correct"]]
        return super().step_correct(rows, completions, scores)

    def is_correct(self, answer: str | None, gold: str) -> bool:
        return is_correct(answer, gold)
