"""A user's own task: any JSONL / Parquet / Hub dataset, the user's prompt and the user's reward functions.

Rows come from ``dataset_name`` with the prompt in ``prompt_field`` (default ``prompt``) and, optionally, a
reference answer in ``answer_field`` (default ``answer``; ``answer_field=none`` for no such column; a null
cell is a row without one). Every column of the row reaches the reward functions as a keyword argument (TRL's
convention); there are no built-in rewards, so ``reward_functions_path`` is required. Evaluation counts a completion as correct when the reward function
``accuracy_reward`` (default: the first of ``reward_functions``) gives it more than 0 points; its extracted
answer is the last ``<answer>`` block (``formatted``: there is one), which majority voting (maj@k) compares
with the answer column after stripping whitespace (a row without an answer counts as not correct there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from grpax.data.datasets import is_missing, require_columns, require_text, require_values, with_all_columns
from grpax.data.prompts import PromptPreset
from grpax.tasks.answers import extract_answer
from grpax.tasks.base import Task, UserRewards, read_dataset


class CustomTask(Task):
    """The user's task (``task=custom``): columns, prompt and rewards all from the user."""

    name = "custom"

    def __init__(
        self,
        preset: PromptPreset,
        user_rewards: UserRewards,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        accuracy_reward: str = "",
    ):
        super().__init__(preset, user_rewards)
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.accuracy_reward = accuracy_reward or next(iter(user_rewards.fns))

    def load_rows(self, dataset: str, split: str) -> list[dict]:
        return self.rows_from(*read_dataset(dataset, split, self.hf_subset))

    def rows_from(self, raw: list[dict], source: str) -> list[dict]:
        keys = {"prompt_field": self.prompt_field}
        if self.answer_field:
            keys["answer_field"] = self.answer_field
        rows = []
        for i, r in enumerate(with_all_columns(raw)):
            require_columns(r, source, i, keys)
            require_values(r, source, i, {"prompt_field": self.prompt_field})
            has_gold = self.answer_field and not is_missing(r[self.answer_field])
            gold = str(r[self.answer_field]) if has_gold else ""  # null: no reference answer for this row
            question = require_text(r, source, i, "prompt_field", self.prompt_field)
            rows.append({"question": question, "gold": gold, "columns": r})
        return rows

    def columns(self, row: dict) -> dict[str, Any]:
        return dict(row["columns"])

    def judge(self, row: dict, text: str, scores: Mapping[str, float]) -> dict[str, Any]:
        points = scores.get(self.accuracy_reward, math.nan)
        answer = extract_answer(text)
        return {
            "extracted_answer": answer,
            "correct": bool(points > 0),  # NaN (abstained) is not correct
            "close": bool(points > 0),
            "formatted": answer is not None,
        }

    def is_correct(self, answer: str | None, gold: str) -> bool:
        # A row without a reference answer ("") has no majority answer that can be right.
        return answer is not None and gold.strip() != "" and answer.strip() == gold.strip()
