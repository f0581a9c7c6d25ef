"""Competition mathematics (MATH, Hendrycks et al. 2021; AIME-style sets) as a task, judged by math-verify.

A completion's final answer is the last ``\\boxed{...}`` it writes, or the text of its last ``<answer>`` block;
it is correct when math-verify (Hugging Face's ``math_verify.parse`` + ``verify``: sympy equivalence, so
``\\frac{1}{2}``, ``1/2``, ``0.5`` and ``\\dfrac12`` agree) judges it equal to the gold answer. Gold answers
are read from ``answer_field`` (default ``answer``; a full solution works too: math-verify takes its last
``\\boxed{}``). The built-in rewards are ``answer_correct`` (1 point when correct) and ``answer_format``
(0.1 point when a final answer was given at all). Needs the ``math`` extra: ``pip install 'grpax[math]'``.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Mapping
from typing import Any

from grpax.data.datasets import require_columns, require_text, require_values, with_all_columns
from grpax.data.prompts import PromptPreset
from grpax.errors import ConfigError
from grpax.tasks.answers import extract_answer
from grpax.tasks.base import Task, UserRewards, read_dataset, weighted_total

log = logging.getLogger(__name__)

MATH_EXTRA = "task=math needs the math-verify library: pip install 'grpax[math]'"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
ANSWER_CORRECT = 1.0  # points of answer_correct
ANSWER_FORMAT = 0.1  # points of answer_format

# Competition problems whose answers are expressions, judged by math-verify on the last \boxed{}.
_MATH_SYSTEM = (
    "You will be given a math problem. Reason step by step, then write the final answer in LaTeX inside "
    "\\boxed{}, e.g. \\boxed{\\frac{1}{2}}."
)
PROMPTS: dict[str, PromptPreset] = {"math": PromptPreset(system_prompt=_MATH_SYSTEM)}


def check_math_verify() -> None:
    """Raises ConfigError naming the extra when math-verify is not installed."""
    if importlib.util.find_spec("math_verify") is None:
        raise ConfigError(MATH_EXTRA)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None.

    Example:
        >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and \\boxed{3}")
        '3'
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def final_answer(text: str) -> str | None:
    """The completion's final answer: the last ``\\boxed{}``, else the last ``<answer>`` block, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tagged = extract_answer(text)
    return tagged.strip() if tagged is not None else None


def _as_latex(text: str) -> str:
    """Math mode for math-verify's LaTeX extraction, unless the text already has delimiters or a box."""
    return text if ("$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text) else f"${text}$"


def verify(answer: str | None, gold: str) -> bool:
    """Whether math-verify judges ``answer`` equal to ``gold`` (both parsed as LaTeX or plain expressions).

    Args:
        answer: the extracted final answer (``final_answer``), or None.
        gold: the gold answer text.

    Returns:
        True when equivalent; False for no answer, an unparseable one, or a math-verify timeout.

    Example:
        >>> verify(r"\\frac{1}{2}", "0.5"), verify("3", r"\\frac{1}{3}")  # doctest: +SKIP
        (True, False)
    """
    if answer is None:
        return False
    import math_verify  # noqa: PLC0415 - the math extra; checked by check_math_verify where keys enter

    try:
        parsed_gold = math_verify.parse(_as_latex(gold))
        parsed = math_verify.parse(_as_latex(answer))
        return bool(parsed_gold and parsed and math_verify.verify(parsed_gold, parsed))
    except Exception as e:  # noqa: BLE001 - a parse failure or timeout means "not shown equal"
        log.debug("math-verify could not compare %r with %r: %s", answer, gold, e)
        return False


class MathTask(Task):
    """Competition math: rows with a problem (``prompt_field``) and an answer (``answer_field``) column."""

    name = "math"

    def __init__(
        self,
        preset: PromptPreset,
        user_rewards: UserRewards | None = None,
        prompt_field: str = "problem",
        answer_field: str = "answer",
    ):
        super().__init__(preset, user_rewards)
        self.prompt_field = prompt_field
        self.answer_field = answer_field

    def load_rows(self, dataset: str, split: str) -> list[dict]:
        return self.rows_from(*read_dataset(dataset, split, self.hf_subset))

    def rows_from(self, raw: list[dict], source: str) -> list[dict]:
        keys = {"prompt_field": self.prompt_field, "answer_field": self.answer_field}
        rows = []
        for i, r in enumerate(with_all_columns(raw)):
            require_columns(r, source, i, keys)
            require_values(r, source, i, keys)
            question = require_text(r, source, i, "prompt_field", self.prompt_field)
            answer = r[self.answer_field]
            if isinstance(answer, (bool, dict, list)):
                raise ValueError(
                    f"{source}: row {i + 1} column {self.answer_field!r} (answer_field={self.answer_field!r}) holds "
                    f"{type(answer).__name__} {str(answer)[:60]!r}, not an answer (text or a number): fix the row or drop it"
                )
            gold = str(answer)
            rows.append({"question": question, "gold": last_boxed(gold) or gold, "columns": r})
        return rows

    def columns(self, row: dict) -> dict[str, Any]:
        return dict(row["columns"])

    def builtin_scores(self, rows: list[dict], completions: list[str]) -> dict[str, list[float]]:
        prefix = self.preset.response_prefix
        answers = [final_answer(prefix + c) for c in completions]
        scores = {
            "answer_correct": [
                ANSWER_CORRECT if verify(a, r["gold"]) else 0.0 for a, r in zip(answers, rows, strict=True)
            ],
            "answer_format": [ANSWER_FORMAT if a is not None else 0.0 for a in answers],
        }
        return {**scores, "total": weighted_total(scores, dict.fromkeys(scores, 1.0))}

    def judge(self, row: dict, text: str, scores: Mapping[str, float]) -> dict[str, Any]:
        answer = final_answer(text)
        correct = verify(answer, row["gold"])
        return {
            "extracted_answer": answer,
            "correct": correct,
            "close": correct,
            "formatted": answer is not None,
        }

    def step_correct(self, rows: list[dict], completions: list[str], scores: Mapping[str, Any]) -> list[bool]:
        if self.user_rewards is None:
            return [v >= ANSWER_CORRECT for v in scores["answer_correct"]]
        return super().step_correct(rows, completions, scores)

    def is_correct(self, answer: str | None, gold: str) -> bool:
        return verify(answer, gold)
