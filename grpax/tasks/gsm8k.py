"""GSM8K (Cobbe et al. 2021) as a task: grade-school word problems with a numeric final answer.

Rows come from ``grpax.data.gsm8k.load_dataset_rows`` (``question``, ``answer`` = the worked solution, ``gold`` =
its final number), the rewards are the MaxText / Tunix point values of ``grpax.rewards.gsm8k`` picked by
``reward_preset``, and a completion is correct when the last ``<answer>`` block equals the gold number
(``is_correct``). This is grpax's default task and what train_rl did before tasks existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpax.data.gsm8k import load_dataset_rows
from grpax.data.prompts import PromptPreset
from grpax.rewards.gsm8k import (
    RewardConfig,
    extract_answer,
    is_close,
    is_correct,
    is_format_exact,
    score_completions,
)
from grpax.tasks.base import Task, UserRewards


class GSM8KTask(Task):
    """GSM8K: ``<answer>`` tags holding a number; user reward functions get ``question``, ``answer`` (the gold
    number, as MaxText passes it) and ``solution`` (the worked solution) as keywords."""

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
        return load_dataset_rows(dataset, split, self.prompt_field, self.answer_field)

    def columns(self, row: dict) -> dict[str, Any]:
        return {"question": row["question"], "answer": row["gold"], "solution": row["answer"]}

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
