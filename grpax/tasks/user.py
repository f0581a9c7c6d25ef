"""What a user brings without code in grpax: a Python file of reward functions and a prompt template file.

``load_reward_functions`` follows MaxText's ``reward_functions_path`` / ``reward_functions`` keys: the file is
imported as a module and the named functions are taken from it, in order. ``load_prompt_template`` reads a
template file: YAML / JSON with ``system_prompt``, ``user_template`` and ``response_prefix`` (the fields of a
``PromptPreset``), or any other text file as the user turn alone. ``{question}`` (or ``{prompt}``) marks
where the row's prompt column goes.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from grpax.data.prompts import PromptPreset
from grpax.errors import ConfigError, suggest
from grpax.tasks.base import RewardFn, UserRewards, check_keywords

_PRESET_FIELDS = ("system_prompt", "user_template", "response_prefix")


def _import_file(path: Path) -> Any:
    """Imports a Python file as a module named after it (once per path)."""
    name = f"grpax_user_rewards_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"reward_functions_path={str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's file: one line naming it
        what = (
            f"called sys.exit({' '.join(str(e).split())}): a reward file must only define its functions"
            if isinstance(e, SystemExit)
            else f"raised {type(e).__name__}: {' '.join(str(e).split())}"
        )
        raise ConfigError(f"reward_functions_path={str(path)!r}: importing it {what}") from None
    sys.modules[name] = module
    return module


def load_reward_functions(
    path: str,
    names: Sequence[str],
    weights: Sequence[float] = (),
    extra_kwargs: dict | None = None,
    timeout_s: float = 0.0,
) -> UserRewards:
    """The functions ``names`` of the Python file ``path``, with their weights.

    Args:
      path: a ``.py`` file (``reward_functions_path``).
      names: function names in it (``reward_functions``), in order; at least one.
      weights: one weight per name (``reward_weights``); empty = 1.0 each.
      extra_kwargs: passed to every call (the trainer passes ``{"tmvp_config": <the run's config>}``).
      timeout_s: seconds each call may take (``reward_timeout_seconds``); 0: no limit.

    Returns:
      UserRewards.

    Raises:
      ConfigError: the file does not exist (or is a folder) or fails to import, a name is missing from it or
        not a function or cannot take ``prompts``, ``completions`` and ``extra_kwargs`` by keyword, no names, or a weight count that differs from the name count (key, value and fix named).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a folder, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(
            f"reward_functions_path={path!r} {what} (relative to {Path.cwd()}): pass the .py file of the functions"
        )
    if not names:
        raise ConfigError(
            f"reward_functions_path={path!r} needs reward_functions=[fn_a,fn_b]: the functions to use from it"
        )
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"reward_weights={list(weights)} has {len(weights)} values for {len(names)} reward_functions "
            f"{list(names)}: give one weight per function, or none (1.0 each)"
        )
    module = _import_file(file)
    defined = [k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")]
    fns: dict[str, RewardFn] = {}
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None and not callable(fn):
            raise ConfigError(
                f"reward_functions: {name!r} in {path} is not a function (type {type(fn).__name__}); its "
                f"functions are {defined}"
            )
        if fn is None:
            raise ConfigError(
                f"reward_functions: {path} has no function {name!r}; it defines {defined}.{suggest(name, defined)}"
            )
        check_keywords(name, fn, str(path), ["prompts", "completions", *(extra_kwargs or {})], partial=True)
        fns[name] = fn
    return UserRewards(
        fns=fns,
        weights=dict(zip(names, [float(w) for w in weights] or [1.0] * len(names), strict=True)),
        source=str(path),
        extra_kwargs=extra_kwargs or {},
        timeout_s=timeout_s,
    )


def load_prompt_template(path: str) -> PromptPreset:
    """A prompt preset from a file (``prompt_template_path``).

    Args:
      path: ``.yml`` / ``.yaml`` / ``.json`` with any of ``system_prompt``, ``user_template``,
        ``response_prefix``; any other file is the user turn's template (no system prompt, no prefix).

    Raises:
      ConfigError: the file does not exist, is not valid YAML / JSON (a ``.yml`` / ``.yaml`` / ``.json``) or not
        a mapping, holds unknown fields, or its user template lacks ``{question}`` / ``{prompt}``.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a folder, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(f"prompt_template_path={path!r} {what} (relative to {Path.cwd()})")
    text = file.read_text(encoding="utf-8")
    if file.suffix in (".yml", ".yaml", ".json"):
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(
                f"prompt_template_path={path!r} is not valid YAML/JSON{where} ({problem}): fix the file, or use a "
                "plain text file (the user turn alone)"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"prompt_template_path={path!r} holds a {type(data).__name__}: expected a mapping with any of "
                f"{list(_PRESET_FIELDS)}"
            )
        unknown = sorted(set(data) - set(_PRESET_FIELDS))
        if unknown:
            raise ConfigError(
                f"prompt_template_path={path!r}: unknown fields {unknown}; expected {list(_PRESET_FIELDS)}"
            )
        preset = PromptPreset(
            system_prompt=str(data.get("system_prompt", "")),
            user_template=str(data.get("user_template", "{question}")),
            response_prefix=str(data.get("response_prefix", "")),
        )
    else:
        preset = PromptPreset(system_prompt="", user_template=text.strip("\n"))
    template = preset.user_template.replace("{prompt}", "{question}")
    if "{question}" not in template:
        raise ConfigError(
            f"prompt_template_path={path!r}: the user template has no {{question}} (or {{prompt}}) slot for the "
            "row's prompt column"
        )
    return PromptPreset(preset.system_prompt, template, preset.response_prefix)
