"""Tasks: what is trained and evaluated (rows, prompt, rewards, correctness); one module per task.

``TaskConfig`` holds the keys that choose and shape a task (shared by ``grpax train_rl`` and ``grpax evaluate``),
``validate_task_keys`` checks them where they enter, and ``build_task`` makes the ``Task`` (``grpax.tasks.base``)
they describe: ``gsm8k`` (the default), ``math`` (math-verify) or ``custom`` (the user's data and rewards).
"""

from __future__ import annotations

import dataclasses
from math import isfinite  # not "import math": the submodule grpax.tasks.math would shadow it
from typing import Any

from grpax.config import field
from grpax.errors import ConfigError
from grpax.tasks.base import RewardFunctionError, Task, UserRewards
from grpax.tasks.custom import CustomTask
from grpax.tasks.environment import BUILTIN_ENVIRONMENTS, TOOL_FORMATS, MultiTurnConfig, load_environment
from grpax.tasks.gsm8k import GSM8KTask
from grpax.tasks.gsm8k_rewards import get_reward_config
from grpax.tasks.math import MathTask, check_math_verify
from grpax.tasks.prompts import GSM8K_PRESETS, PROMPT_PRESETS, get_prompt_preset
from grpax.tasks.reward_keys import RewardValueKeys, check_reward_value_keys, reward_overrides
from grpax.tasks.user import load_prompt_template, load_reward_functions

TASKS = ("gsm8k", "math", "custom")
# Names of the score entries grpax adds next to the reward functions' (the weighted total, DAPO's penalty).
RESERVED_REWARD_NAMES = ("total", "overlong")
# The columns each task reads by default (prompt_field, answer_field).
DEFAULT_FIELDS = {
    "gsm8k": ("question", "answer"),
    "math": ("problem", "answer"),
    "custom": ("prompt", "answer"),
}


@dataclasses.dataclass(frozen=True)
class EnvironmentConfig:
    """The keys of multi-turn rollouts (``grpax.tasks.environment``), shared by train_rl, evaluate and generate."""

    environment: str = field(
        "",
        "multi-turn rollouts with an environment between the turns: calculator (built-in tool, e.g. with "
        "task=gsm8k), or a class in environment_path; '' = single-turn",
    )
    environment_path: str = field(
        "",
        "Python file of your environment class (environment=NAME): reset(row) -> messages | None, "
        "step(text) -> (observation | None, reward, done), optional stop_strings and tools",
    )
    tool_format: str = field(
        "tags",
        "tool calls of the built-in tools: tags (<calculator>3*4</calculator> -> <result>12</result>) | chat "
        "(the chat template's own tool format, apply_chat_template(tools=...))",
    )
    max_turns: int = field(4, "model turns per trajectory at most (with environment)")
    max_turn_tokens: int = field(
        0, "model tokens per turn at most (with environment); 0 = up to the trajectory's budget"
    )
    max_observation_tokens: int = field(64, "tokens of one observation at most (longer ones are cut)")
    tool_timeout_seconds: float = field(
        2.0, "seconds one tool call may take; past it the model reads an error observation"
    )
    environment_timeout_seconds: float = field(
        60.0,
        "seconds one call of your environment (making it, reset, step) may take before the run stops with one "
        "line naming it (0: no limit)",
    )
    tool_call_reward: float = field(
        0.0,
        "points added once to a trajectory whose built-in tool call returned without an error (a shaping "
        "reward for tool use, in the task's reward points; 0 = only the task's rewards count)",
    )


@dataclasses.dataclass(frozen=True)
class TaskConfig(RewardValueKeys, EnvironmentConfig):
    """The keys of the task: which one, its columns, its prompt and the user's reward functions."""

    task: str = field(
        "gsm8k", "gsm8k | math (math-verify; pip install 'grpax[math]') | custom (your data and rewards)"
    )
    prompt_field: str = field(
        "", "dataset column holding the prompt ('' = the task's: question | problem | prompt)"
    )
    answer_field: str = field(
        "",
        "dataset column holding the reference answer ('' = the task's: answer; task=custom: 'none' for no column)",
    )
    prompt_preset: str = field(
        "maxtext",
        "prompt wording: maxtext | smollm2_demo | smollm2_calculator (GSM8K; the last with environment=calculator) "
        "| math | plain (model presets pick one)",
    )
    reward_preset: str = field(
        "maxtext",
        "task=gsm8k's reward values: maxtext | tunix | simple | smollm2_demo (model presets pick one) | none "
        "(every completion 0: pure on-policy distillation, with distillation_coef > 0)",
    )
    prompt_template_path: str = field(
        "",
        "prompt from a file instead of prompt_preset: YAML/JSON with system_prompt, user_template "
        "({question} slot), response_prefix; or a text file holding the user turn",
    )
    system_prompt: str = field(
        "",
        "the prompt's system turn, replacing the preset's or template's (MaxText's rl.system_prompt); '' = theirs",
    )
    hf_subset: str = field(
        "",
        "a Hub dataset's config (MaxText key), e.g. main or socratic for openai/gsm8k; '' = its only one (gsm8k: main)",
    )
    reward_functions_path: str = field(
        "", "Python file of reward functions (MaxText key); they replace the task's built-in rewards"
    )
    reward_functions: tuple[str, ...] = field(
        (),
        "names of the functions in reward_functions_path, e.g. [fn_a,fn_b]; each is called as "
        "fn(prompts=, completions=, tmvp_config=<run config>, **dataset columns) -> list of float (None/NaN abstains)",
    )
    reward_weights: tuple[float, ...] = field(
        (), "weight of each of reward_functions in the total (default 1.0 each)"
    )
    accuracy_reward: str = field(
        "",
        "task=custom: the reward function whose points > 0 count a completion as correct (default: the first)",
    )
    reward_timeout_seconds: float = field(
        0.0, "seconds one call of a reward function may take before the run stops with one line (0: no limit)"
    )


def validate_task_keys(cfg: Any) -> None:
    """Raises ConfigError naming the key for task keys that cannot work (before any file is read).

    Raises:
      ConfigError: an unknown task, task=math without math-verify, task=custom without reward functions,
        reward_functions without reward_functions_path (or the reverse), a function named twice or named like an
        entry grpax adds (``RESERVED_REWARD_NAMES``), weights without functions or not finite,
        an accuracy_reward outside task=custom or not among reward_functions, an unknown prompt_preset, or a GSM8K prompt preset for
        another task (a model preset sets one; the GSM8K wording would be a silent surprise).
    """
    if cfg.task not in TASKS:
        raise ConfigError(f"task={cfg.task!r}: expected one of {', '.join(TASKS)}")
    if cfg.task == "math":
        check_math_verify()
    _validate_reward_keys(cfg)
    check_reward_value_keys(cfg)
    if cfg.accuracy_reward and cfg.task != "custom":
        raise ConfigError(
            f"accuracy_reward={cfg.accuracy_reward!r} is for task=custom; task={cfg.task} counts accuracy with its "
            "own answer check: drop accuracy_reward"
        )
    if cfg.accuracy_reward and cfg.accuracy_reward not in cfg.reward_functions:
        raise ConfigError(
            f"accuracy_reward={cfg.accuracy_reward!r}: expected one of reward_functions {list(cfg.reward_functions)}"
        )
    validate_environment_keys(cfg)
    if not cfg.prompt_template_path and cfg.prompt_preset not in PROMPT_PRESETS:
        raise ConfigError(
            f"prompt_preset={cfg.prompt_preset!r}: expected one of {', '.join(PROMPT_PRESETS)}, or "
            "prompt_template_path=<file>"
        )
    if cfg.task != "gsm8k" and not cfg.prompt_template_path and cfg.prompt_preset in GSM8K_PRESETS:
        suggested = "math" if cfg.task == "math" else "plain"
        raise ConfigError(
            f"task={cfg.task} with prompt_preset={cfg.prompt_preset} (a GSM8K prompt; model presets set it): "
            f"pass prompt_preset={suggested} or prompt_template_path=<file>"
        )


def _validate_reward_keys(cfg: Any) -> None:
    """The user reward functions' keys: the file and the names together, one weight each (finite), no name
    twice or reserved, a finite reward timeout."""
    if bool(cfg.reward_functions_path) != bool(cfg.reward_functions):
        raise ConfigError(
            f"reward_functions_path={cfg.reward_functions_path!r}, reward_functions={list(cfg.reward_functions)}: "
            "give both (the file and the names of its functions to use), or neither"
        )
    if cfg.task == "custom" and not cfg.reward_functions:
        raise ConfigError(
            "task=custom needs reward_functions_path=<file.py> reward_functions=[fn_a,...]: it has no built-in rewards"
        )
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward_functions):
        raise ConfigError(
            f"reward_weights={list(cfg.reward_weights)}: {len(cfg.reward_weights)} weights for "
            f"{len(cfg.reward_functions)} reward_functions; give one per function, or none (1.0 each)"
        )
    names = list(cfg.reward_functions)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"reward_functions={names} names {twice[0]!r} twice: name each function once (weight it with "
            "reward_weights)"
        )
    reserved = [n for n in names if n in RESERVED_REWARD_NAMES]
    if reserved:
        raise ConfigError(
            f"reward_functions={names}: {reserved[0]!r} is the name of grpax's own reward entry (the weighted "
            "total, or DAPO's overlong penalty): rename that function in the file"
        )
    bad_weights = [w for w in cfg.reward_weights if not isfinite(w)]
    if bad_weights:
        raise ConfigError(
            f"reward_weights={list(cfg.reward_weights)}: {bad_weights[0]} is not a finite number; give each of "
            "reward_functions a finite weight (negative ones subtract)"
        )
    timeout = getattr(cfg, "reward_timeout_seconds", 0.0)
    if not (isfinite(timeout) and timeout >= 0):
        raise ConfigError(
            f"reward_timeout_seconds={timeout}: expected a finite number of seconds >= 0 (0: no limit)"
        )


def validate_environment_keys(cfg: Any) -> None:
    """Raises ConfigError naming the key for environment keys that cannot work (before any file is read)."""
    environment, path = getattr(cfg, "environment", ""), getattr(cfg, "environment_path", "")
    if path and not environment:
        raise ConfigError(f"environment_path={path!r} needs environment=NAME: the class in it to use")
    if environment and not path and environment not in BUILTIN_ENVIRONMENTS:
        raise ConfigError(
            f"environment={environment!r}: expected one of {list(BUILTIN_ENVIRONMENTS)}, or "
            "environment_path=<file.py> defining it"
        )
    if cfg.tool_format not in TOOL_FORMATS:
        raise ConfigError(f"tool_format={cfg.tool_format!r}: expected one of {', '.join(TOOL_FORMATS)}")
    if not (isfinite(cfg.tool_timeout_seconds) and cfg.tool_timeout_seconds >= 0):
        raise ConfigError(
            f"tool_timeout_seconds={cfg.tool_timeout_seconds}: expected a finite number of seconds >= 0 (0: no limit)"
        )
    if not (isfinite(cfg.environment_timeout_seconds) and cfg.environment_timeout_seconds >= 0):
        raise ConfigError(
            f"environment_timeout_seconds={cfg.environment_timeout_seconds}: expected a finite number of seconds "
            ">= 0 (0: no limit)"
        )
    if not isfinite(cfg.tool_call_reward):
        raise ConfigError(f"tool_call_reward={cfg.tool_call_reward}: expected a finite number of points")
    if cfg.tool_call_reward and (path or not environment):
        raise ConfigError(
            f"tool_call_reward={cfg.tool_call_reward} applies to the built-in tool environments "
            f"(environment={', '.join(BUILTIN_ENVIRONMENTS)}): your environment's step returns its own reward, "
            "or set tool_call_reward=0"
        )
    multi_turn_config(cfg)  # the budgets


def multi_turn_config(cfg: Any) -> MultiTurnConfig:
    """The ``MultiTurnConfig`` (``grpax.tasks.environment``) of the keys.

    Raises:
      ConfigError: max_turns < 1, max_turn_tokens < 0 or max_observation_tokens < 1.
    """
    return MultiTurnConfig(cfg.max_turns, cfg.max_turn_tokens, cfg.max_observation_tokens, cfg.tool_format)


def environment_factory(cfg: Any) -> Any:
    """The factory of ``environment`` (one environment per trajectory), or None without one.

    Raises:
      ConfigError: the environment file cannot be read or lacks the class (file named, one line).
    """
    if not cfg.environment:
        return None
    return load_environment(
        cfg.environment,
        cfg.environment_path,
        cfg.tool_format,
        cfg.tool_timeout_seconds,
        cfg.tool_call_reward,
        cfg.environment_timeout_seconds,
    )


def build_task(cfg: Any, tmvp_config: Any = None) -> Task:
    """The task the keys describe (``validate_task_keys`` has passed); loads the user's reward file.

    Args:
      cfg: a config with the ``TaskConfig`` keys, ``prompt_preset`` and ``reward_preset``.
      tmvp_config: what user reward functions get as ``tmvp_config`` (default: ``cfg``).

    Raises:
      ConfigError: the reward file or template file cannot be read or lacks a named function.
    """
    preset = (
        load_prompt_template(cfg.prompt_template_path)
        if cfg.prompt_template_path
        else get_prompt_preset(cfg.prompt_preset)
    )
    if getattr(cfg, "system_prompt", ""):
        preset = dataclasses.replace(preset, system_prompt=cfg.system_prompt)
    user = None
    if cfg.reward_functions_path:
        user = load_reward_functions(
            cfg.reward_functions_path,
            cfg.reward_functions,
            cfg.reward_weights,
            {"tmvp_config": cfg if tmvp_config is None else tmvp_config},
            getattr(cfg, "reward_timeout_seconds", 0.0),
        )
    prompt_default, answer_default = DEFAULT_FIELDS[cfg.task]
    prompt_field = cfg.prompt_field or prompt_default
    answer_field = cfg.answer_field or answer_default
    if cfg.task == "gsm8k":
        rewards = get_reward_config(cfg.reward_preset, **reward_overrides(cfg))
        task = GSM8KTask(preset, rewards, user, prompt_field, answer_field)
    elif cfg.task == "math":
        task = MathTask(preset, user, prompt_field, answer_field)
    else:
        answer = "" if answer_field == "none" else answer_field
        task = CustomTask(preset, user, prompt_field, answer, cfg.accuracy_reward)
    task.hf_subset = getattr(cfg, "hf_subset", "")
    return task


__all__ = [
    "DEFAULT_FIELDS",
    "EnvironmentConfig",
    "TASKS",
    "RewardFunctionError",
    "Task",
    "TaskConfig",
    "UserRewards",
    "build_task",
    "environment_factory",
    "multi_turn_config",
    "validate_task_keys",
]
