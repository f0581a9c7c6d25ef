"""Environments: what answers a model between the turns of a multi-turn rollout (tool results, game states).

The seam has the common shape of the RL environment libraries for language models (SkyRL-gym's text
environments, TRL's ``environment_factory``, Tinker's ``Env``): one instance per trajectory, ``reset(row)``
gives the first messages, and ``step(assistant_text)`` is called after each model turn with that turn's text and
returns ``(observation text or None, reward contribution in points, done)``. A trajectory ends when ``step``
says done or returns no observation, or when a budget runs out (``max_turns``, ``max_turn_tokens``, the
trajectory's ``max_completion_length``). The rollout (``grpax.rl.multi_turn``) samples, pauses a row at the end
of a turn (a stop token, or a token that completes one of ``stop_strings``), calls ``step`` on the host and appends the
observation's tokens to the row's KV cache; observation tokens are in the sequence but out of the loss.

A turn's observation text is appended as the environment gives it (``ToolEnvironment`` with the tag format:
``<calculator>3*4</calculator>`` is answered by ``<result>12</result>``). With ``tool_format="chat"`` the
tool result becomes a ``{"role": "tool"}`` message rendered by the tokenizer's chat template
(``chat_observation``), which also declares the tools (``apply_chat_template(tools=...)``), as Llama 3.1's and
Qwen2.5/3's templates do.

A user's own environment: ``environment_path=FILE environment=NAME``, where NAME in FILE is a class (or a
function of no arguments) whose instances have ``reset`` and ``step`` (``load_environment``). Its mistakes are
one line naming the file: a missing name, a missing method, ``step`` raising or returning another shape, or a
call of it (making one, ``reset``, ``step``) running past ``environment_timeout_seconds``. A tool that raises or
runs past ``tool_timeout_seconds`` is not a mistake of the file: the model reads an error observation
(``run_tool``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grpax.errors import ConfigError, suggest
from grpax.tasks.base import TimedOut, call_within
from grpax.tasks.calculator import calculate
from grpax.tasks.user import _import_file

TOOL_FORMATS = ("tags", "chat")


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """The budgets of a multi-turn rollout (the trajectory's is ``SamplerConfig.max_completion_length``)."""

    max_turns: int = 4  # model turns per trajectory at most
    max_turn_tokens: int = 0  # model tokens per turn at most; 0 = up to the trajectory's budget
    max_observation_tokens: int = 64  # an observation is cut to this many tokens
    tool_format: str = "tags"  # "tags": observations appended as text; "chat": a tool message of the template

    def __post_init__(self):
        if self.max_turns < 1 or self.max_turn_tokens < 0 or self.max_observation_tokens < 1:
            raise ConfigError(
                f"max_turns={self.max_turns}, max_turn_tokens={self.max_turn_tokens}, max_observation_tokens="
                f"{self.max_observation_tokens}: expected max_turns >= 1, max_turn_tokens >= 0 (0: no limit) and "
                "max_observation_tokens >= 1"
            )


class EnvironmentFileError(ConfigError):
    """A user environment misbehaved: ``reset`` / ``step`` raised or returned the wrong shape (file named)."""


class Environment:
    """The base of environments (subclassing it is optional: any object with ``reset`` and ``step`` works).

    Attributes:
      stop_strings: a turn also ends at the token that completes one of these (e.g. a tool call's closing
        tag), and ``step`` gets the text up to its end; what that token wrote after it (the ``<`` of SmolLM2's
        ``><``) stays in the sequence, and an observation that starts with it is fed without it. The model's
        stop tokens (EOS, end of turn) always end a turn.
      tools: JSON schemas of the tools (``{"type": "function", "function": {...}}``) that the chat template
        declares with ``tool_format="chat"``; empty for none.
    """

    stop_strings: tuple[str, ...] = ()
    tools: tuple[dict, ...] = ()

    def reset(self, row: dict) -> list[dict] | None:
        """The first messages of the trajectory of ``row`` (chat messages), or None for the task's own prompt.

        ``row`` is the task's row (every dataset column under ``columns``) plus ``messages``: the task's own
        prompt messages (system and user turns), to return as they are or changed.
        """
        return None

    def step(self, assistant_text: str) -> tuple[str | None, float, bool]:
        """The environment's answer to one model turn: (observation text or None, reward points, done)."""
        return None, 0.0, True


def run_tool(fn: Callable[..., Any], args: Any, timeout_s: float, name: str = "tool") -> str:
    """``fn(args)`` (``fn(**args)`` for a mapping) as text; an exception or a timeout is a one-line
    ``error: ...`` observation, never a crash.

    Args:
      fn: the tool.
      args: its argument (a string for the tag format, a mapping of arguments for the chat format).
      timeout_s: seconds the call may take (in a daemon thread: a hung tool cannot be stopped, but the rollout
        no longer waits); 0: no limit.
      name: the tool's name in the error observation.
    """
    try:
        value = call_within(
            lambda: fn(**args) if isinstance(args, Mapping) else fn(args), timeout_s, f"grpax-tool-{name}"
        )
    except TimedOut:
        return f"error: {name} did not return within {timeout_s:g} s"
    except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's observation
        message = " ".join(str(e).split())
        return f"error: {name} raised {type(e).__name__}" + (f": {message}" if message else "")
    return str(value)


def parse_chat_tool_call(text: str) -> tuple[str, Any] | None:
    """The last tool call of a turn in a chat template's format: a JSON object with ``name`` and
    ``arguments`` (Qwen's ``<tool_call>`` blocks, Hermes) or ``parameters`` (Llama 3.1), or None.

    Example:
      >>> parse_chat_tool_call('<tool_call>\\n{"name": "calculator", "arguments": {"expression": "3*4"}}\\n</tool_call>')
      ('calculator', {'expression': '3*4'})
    """
    decoder = json.JSONDecoder()
    found = None
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            args = value.get("arguments", value.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            found = (value["name"], args)
    return found


class ToolEnvironment(Environment):
    """A model that may call tools: each turn that ends in a tool call gets the tool's result; a turn without
    one ends the trajectory (its text is the final answer, scored by the task's rewards).

    Tag format: ``<name>argument</name>`` at the end of the turn, answered by ``<result>value</result>``.
    Chat format: the template's JSON tool call (``parse_chat_tool_call``), answered by a tool message.

    Args:
      tools: name -> function of one string (tag format) or of keyword arguments (chat format).
      tool_format: "tags" or "chat".
      schemas: the tools' JSON schemas (chat format).
      instructions: text added to the system prompt (how to call the tools), or "".
      timeout_s: seconds one tool call may take (``tool_timeout_seconds``).
      call_reward: points added once per trajectory, at its first tool call that returns without an error
        (``tool_call_reward``; 0 by default: only the answer counts). Once, not per call, so that calling more
        is not paid (the shaping of verl's GSM8K tool recipe, +0.1 for a trajectory with a call).
    """

    def __init__(
        self,
        tools: Mapping[str, Callable[..., Any]],
        tool_format: str = "tags",
        schemas: tuple[dict, ...] = (),
        instructions: str = "",
        timeout_s: float = 1.0,
        call_reward: float = 0.0,
    ):
        self.functions, self.tool_format = dict(tools), tool_format
        self.tools = tuple(schemas) if tool_format == "chat" else ()
        self.stop_strings = tuple(f"</{n}>" for n in tools) if tool_format == "tags" else ()
        self.instructions, self.timeout_s, self.call_reward = instructions, timeout_s, call_reward
        self.calls = self.errors = self.successes = 0

    def reset(self, row: dict) -> list[dict] | None:
        messages = row.get("messages")
        if messages is None or not self.instructions:
            return messages
        if messages and messages[0]["role"] == "system":
            first = {"role": "system", "content": messages[0]["content"] + "\n\n" + self.instructions}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.instructions}, *messages]

    def step(self, assistant_text: str) -> tuple[str | None, float, bool]:
        call = self.parse(assistant_text)
        if call is None:
            return None, 0.0, True
        name, args = call
        self.calls += 1
        if name not in self.functions:
            result = f"error: no tool {name!r}; tools: {', '.join(self.functions)}"
        else:
            result = run_tool(self.functions[name], args, self.timeout_s, name)
        failed = result.startswith("error:")
        self.errors += failed
        self.successes += not failed
        reward = self.call_reward if not failed and self.successes == 1 else 0.0
        observation = result if self.tool_format == "chat" else f"<result>{result}</result>\n"
        return observation, reward, False

    def parse(self, text: str) -> tuple[str, Any] | None:
        """The tool call that ends ``text``, as (tool name, argument), or None."""
        if self.tool_format == "chat":
            return parse_chat_tool_call(text)
        stripped = text.rstrip()
        for name in self.functions:
            close = f"</{name}>"
            if stripped.endswith(close):
                start = stripped.rfind(f"<{name}>")
                if start < 0:
                    return name, ""
                return name, stripped[start + len(name) + 2 : -len(close)].strip()
        return None


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (48 / 2) * 3"}},
            "required": ["expression"],
        },
    },
}
# The exact call and answer, then one worked exchange: models imitate a shown call more readily than they
# follow a described one (the tool prompts of TRL's and verl's examples show one too).
CALCULATOR_TAG_INSTRUCTIONS = (
    "You have a calculator. To use it, write one arithmetic expression between <calculator> and </calculator> "
    "and stop: its result follows between <result> and </result>, and you go on from there. Example:\n"
    "Question: 3 boxes hold 48 eggs each, shared equally by 2 people. How many eggs does each get?\n"
    "Answer: 3 boxes hold <calculator>3 * 48</calculator><result>144</result>\n"
    "144 eggs, so each gets <calculator>144 / 2</calculator><result>72</result>\n72 eggs."
)


def calculator_environment(
    tool_format: str = "tags", timeout_s: float = 1.0, call_reward: float = 0.0
) -> ToolEnvironment:
    """The built-in ``calculator`` environment (``environment=calculator``, e.g. with ``task=gsm8k``);
    ``call_reward``: ``ToolEnvironment``'s (``tool_call_reward``)."""

    def calculator(expression: str = "") -> str:
        return calculate(expression)

    return ToolEnvironment(
        {"calculator": calculator},
        tool_format,
        schemas=(CALCULATOR_SCHEMA,),
        instructions=CALCULATOR_TAG_INSTRUCTIONS if tool_format == "tags" else "",
        timeout_s=timeout_s,
        call_reward=call_reward,
    )


BUILTIN_ENVIRONMENTS = ("calculator",)


def load_environment(
    name: str,
    path: str = "",
    tool_format: str = "tags",
    timeout_s: float = 1.0,
    call_reward: float = 0.0,
    environment_timeout_s: float = 0.0,
) -> Callable[[], Any]:
    """The factory of the environment ``name``: a built-in one, or ``name`` in the Python file ``path``.

    Args:
      name: ``environment``: "calculator", or a class / function of no arguments in ``path``.
      path: ``environment_path``: a ``.py`` file, or "" for a built-in.
      tool_format: ``tool_format`` of the built-in tool environments ("tags" or "chat").
      timeout_s: ``tool_timeout_seconds`` of the built-in tools.
      call_reward: ``tool_call_reward`` of the built-in tools (points once per trajectory with a call that
        returned without an error).
      environment_timeout_s: ``environment_timeout_seconds``: seconds one call of a user environment (making
        it, ``reset``, ``step``) may take before the run stops with one line; 0: no limit.

    Returns:
      A function of no arguments that makes one environment (one per trajectory).

    Raises:
      ConfigError: an unknown built-in, or a file that does not exist, fails to import, lacks ``name``, or whose
        ``name`` is not callable or makes an object without ``reset`` and ``step`` (file named, one line).
    """
    if not path:
        if name not in BUILTIN_ENVIRONMENTS:
            raise ConfigError(
                f"environment={name!r}: expected one of {list(BUILTIN_ENVIRONMENTS)}, or environment_path=<file.py> "
                f"defining it.{suggest(name, BUILTIN_ENVIRONMENTS)}"
            )
        return lambda: calculator_environment(tool_format, timeout_s, call_reward)
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a folder, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(f"environment_path={path!r} {what} (relative to {Path.cwd()}): pass the .py file")
    if not name:
        raise ConfigError(f"environment_path={path!r} needs environment=NAME: the class in it to use")
    try:
        module = _import_file(file)
    except ConfigError as e:
        raise ConfigError(str(e).replace("reward_functions_path=", "environment_path=", 1)) from None
    defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        what = "has no" if factory is None else f"holds a {type(factory).__name__} as"
        raise ConfigError(
            f"environment={name!r}: {path} {what} class or function {name!r}; it defines {defined}."
            f"{suggest(name, defined)}"
        )
    if inspect.isclass(factory):
        missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            raise ConfigError(
                f"environment={name!r} in {path} has no method {' or '.join(missing)}: an environment needs "
                "reset(row) -> messages | None and step(text) -> (observation | None, reward, done)"
            )
    return UserFactory(factory, name, str(path), environment_timeout_s)


class UserFactory:
    """Makes a user's environment and checks every answer it gives (one line naming the file on a mistake).

    Args:
      factory: the class (or function of no arguments) in the user's file.
      name: ``environment``; source: ``environment_path``.
      timeout_s: seconds one call of the factory, ``reset`` or ``step`` may take
        (``environment_timeout_seconds``); 0: no limit.
    """

    def __init__(self, factory: Callable[[], Any], name: str, source: str, timeout_s: float = 0.0):
        self.factory, self.name, self.source, self.timeout_s = factory, name, source, timeout_s

    def call(self, fn: Callable[..., Any], args: tuple, what: str) -> Any:
        """``fn(*args)`` within ``timeout_s``; its exception or a timeout is one line naming ``what`` (the call)."""
        try:
            return call_within(lambda: fn(*args), self.timeout_s, "grpax-environment")
        except TimedOut:
            raise EnvironmentFileError(
                f"environment={self.name!r} ({self.source}) did not return from {what} within "
                f"environment_timeout_seconds={self.timeout_s:g} (a hang?): fix it, or raise "
                "environment_timeout_seconds (0: no limit)"
            ) from None
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
            raise self.error(f"in {what}", e) from None

    def __call__(self) -> Any:
        env = self.call(self.factory, (), f"{self.name}() (making one environment)")
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise EnvironmentFileError(
                f"environment={self.name!r} ({self.source}) made a {type(env).__name__} without "
                f"{' or '.join(missing)}(): an environment needs reset(row) and step(text)"
            )
        return CheckedEnvironment(env, self)

    def error(self, what: str, e: BaseException) -> EnvironmentFileError:
        message = " ".join(str(e).split())
        return EnvironmentFileError(
            f"environment={self.name!r} ({self.source}) raised {type(e).__name__} {what}"
            + (f": {message}" if message else "")
        )


class CheckedEnvironment:
    """A user environment whose ``reset`` and ``step`` answers are checked (``UserFactory``)."""

    def __init__(self, env: Any, factory: UserFactory):
        self.env, self.factory = env, factory
        self.stop_strings = tuple(getattr(env, "stop_strings", ()) or ())
        self.tools = tuple(getattr(env, "tools", ()) or ())

    def reset(self, row: dict) -> list[dict] | None:
        messages = self.factory.call(self.env.reset, (row,), "reset(row)")
        ok = messages is None or (
            isinstance(messages, list)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        )
        if not ok:
            raise EnvironmentFileError(
                f"environment={self.factory.name!r} ({self.factory.source}) reset(row) returned "
                f"{_short(messages)}: expected a list of {{'role', 'content'}} messages, or None for the task's prompt"
            )
        return messages

    def step(self, assistant_text: str) -> tuple[str | None, float, bool]:
        out = self.factory.call(self.env.step, (assistant_text,), "step(text)")
        shape_ok = isinstance(out, (tuple, list)) and len(out) == 3
        if shape_ok:
            observation, reward, done = out
            shape_ok = (
                (observation is None or isinstance(observation, str))
                and isinstance(reward, (int, float))
                and not isinstance(reward, bool)
                and math.isfinite(reward)
            )
        if not shape_ok:
            raise EnvironmentFileError(
                f"environment={self.factory.name!r} ({self.factory.source}) step(text) returned {_short(out)}: "
                "expected (observation str | None, reward: finite number, done: bool)"
            )
        return observation, float(reward), bool(done)


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


_TOOLS_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> tool lists checked


def check_tools_rendered(
    tokenizer: Any, messages: list[dict], rendered: str, tools: list[dict], user_environment: bool
) -> None:
    """Refuses a chat template that never reads ``tools`` (SmolLM2's): ``rendered`` (``messages`` with the
    generation prompt, rendered with ``tools``) equals the rendering without them, so the model would never
    see the tools it is trained to call. Checked once per tokenizer and tool list.

    Raises:
      ConfigError: one line naming the tools, the template and the fix (``tool_format=tags`` for the built-in
        tools; the environment's own messages for a user environment).
    """
    key = json.dumps(tools, sort_keys=True, default=str)
    try:
        seen = _TOOLS_CHECKED.setdefault(tokenizer, set())
    except TypeError:  # not weak-referenceable: checked every time
        seen = set()
    if key in seen:
        return
    if tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered:
        names = [t.get("function", {}).get("name", "?") if isinstance(t, dict) else "?" for t in tools]
        source = getattr(tokenizer, "name_or_path", "")
        fix = (
            "describe them in the messages your environment's reset(row) returns, or drop its tools"
            if user_environment
            else "use tool_format=tags (the tool's instructions and a worked call go into the system prompt)"
        )
        raise ConfigError(
            f"tool_format=chat: the chat template{f' of {source}' if source else ''} ignores its tools argument "
            f"(a prompt renders the same with and without the tools {names}), so the model would never see "
            f"them: {fix}"
        )
    seen.add(key)


def chat_observation(tokenizer: Any, observation: str, stop_text: str, tools: tuple[dict, ...]) -> str:
    """The text that follows a model turn ended by ``stop_text`` (its end-of-turn token) in the chat template,
    up to the next assistant turn's generation prompt, with ``observation`` as a tool message.

    Rendered as the difference of two renderings of a stand-in conversation, with and without the tool message,
    so that any template (Llama 3.1's ``ipython`` role, Qwen's ``<tool_response>``) writes its own layout.

    Raises:
      ValueError: the template does not render the tool message after the assistant turn (no tool support).
    """
    call = {"type": "function", "function": {"name": "tool", "arguments": {}}}
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    kw = {"tools": list(tools) or None, "tokenize": False}
    before = tokenizer.apply_chat_template(base, **kw)
    after = tokenizer.apply_chat_template(
        [*base, {"role": "tool", "content": observation}], add_generation_prompt=True, **kw
    )
    if not after.startswith(before) or stop_text not in before:
        raise ValueError(
            "the chat template does not render a tool message after the assistant's turn: use tool_format=tags"
        )
    tail = before[before.rfind(stop_text) + len(stop_text) :]  # e.g. the newline after <|im_end|>
    return tail + after[len(before) :]
