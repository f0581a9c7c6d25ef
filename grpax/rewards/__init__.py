"""Reward functions: pure Python scoring of generated completions (no JAX, no model code)."""

from grpax.rewards.gsm8k import (
    REWARD_FUNCTIONS,
    REWARD_PRESETS,
    RewardConfig,
    extract_answer,
    extract_last_number,
    get_reward_config,
    is_close,
    is_correct,
    is_format_exact,
    normalize_number,
    score_completions,
)

__all__ = [
    "REWARD_FUNCTIONS",
    "REWARD_PRESETS",
    "RewardConfig",
    "extract_answer",
    "extract_last_number",
    "get_reward_config",
    "is_close",
    "is_correct",
    "is_format_exact",
    "normalize_number",
    "score_completions",
]
