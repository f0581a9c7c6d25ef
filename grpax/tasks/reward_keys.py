"""MaxText's GSM8K reward values as keys (``rl.yml``'s ``reward_*`` / ``penalty_*``): each replaces the
``reward_preset``'s points of the ``RewardConfig`` fields it names (``grpax.tasks.gsm8k_rewards``), as MaxText's
``utils_rl.py`` reads them: ``reward_exact_format_match`` scores the exact layout and, unless
``reward_exact_answer`` is given (MaxText's newer key for it), the exact answer; ``penalty_incorrect_format``
both a missing or repeated tag and an answer that holds no number. Unset (None), the preset's value stays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpax.config import field
from grpax.errors import ConfigError

# key -> the RewardConfig fields it sets
MAXTEXT_REWARD_FIELDS: dict[str, tuple[str, ...]] = {
    "reward_exact_format_match": ("format_exact", "answer_exact"),
    "reward_exact_answer": ("answer_exact",),  # after reward_exact_format_match: it wins for the answer
    "reward_white_space_format_match": ("answer_whitespace",),
    "reward_partial_format_match": ("format_tag_present",),
    "reward_ratio_guess_to_answer_high": ("answer_ratio_high",),
    "reward_ratio_guess_to_answer_low": ("answer_ratio_low",),
    "penalty_incorrect_format": ("format_tag_penalty", "answer_unparseable"),
    "penalty_incorrect_answer": ("answer_wrong",),
}

_HELP = "task=gsm8k's points (MaxText key; none = reward_preset's): "


@dataclasses.dataclass(frozen=True)
class RewardValueKeys:
    """MaxText's reward values (``MAXTEXT_REWARD_FIELDS``); None keeps the ``reward_preset``'s."""

    reward_exact_format_match: float | None = field(
        None, _HELP + "the exact layout, and the exact answer unless reward_exact_answer is given"
    )
    reward_exact_answer: float | None = field(None, _HELP + "the exact answer")
    reward_white_space_format_match: float | None = field(None, _HELP + "an answer off by whitespace only")
    reward_partial_format_match: float | None = field(None, _HELP + "each tag present exactly once")
    reward_ratio_guess_to_answer_high: float | None = field(None, _HELP + "an answer within 10% of the gold")
    reward_ratio_guess_to_answer_low: float | None = field(None, _HELP + "an answer within 20% of the gold")
    penalty_incorrect_format: float | None = field(
        None, _HELP + "each tag missing or repeated, and an answer holding no number"
    )
    penalty_incorrect_answer: float | None = field(None, _HELP + "a wrong number")


def reward_overrides(cfg: Any) -> dict[str, float]:
    """The ``RewardConfig`` fields the set reward keys of ``cfg`` replace."""
    return {
        name: float(getattr(cfg, key))
        for key, names in MAXTEXT_REWARD_FIELDS.items()
        if getattr(cfg, key) is not None
        for name in names
    }


def check_reward_value_keys(cfg: Any) -> None:
    """Raises ConfigError for a set reward value that would not be read: another task than gsm8k, user reward
    functions (they replace the built-in ones), or a value that is not finite."""
    given = [key for key in MAXTEXT_REWARD_FIELDS if getattr(cfg, key) is not None]
    if not given:
        return
    named = ", ".join(f"{key}={getattr(cfg, key)}" for key in given)
    if cfg.task != "gsm8k":
        raise ConfigError(f"{named}: the built-in GSM8K rewards' points, not task={cfg.task}'s: drop them")
    if cfg.reward_functions_path:
        raise ConfigError(
            f"{named}: reward_functions_path={cfg.reward_functions_path} replaces the built-in GSM8K rewards "
            "these points are for: drop one"
        )
    for key in given:
        value = float(getattr(cfg, key))
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{key}={value}: expected a finite number of points")
