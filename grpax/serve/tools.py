"""Tool calls out of a chat completion's text (``grpax serve tool_call_parser=``), in OpenAI's ``tool_calls``.

An agent harness sends ``tools`` (the chat template renders them) and reads the calls back as structured
``tool_calls``, not as text; the model writes them in its family's format, which a parser reads (vLLM's
``--tool-call-parser`` of the same names):

- ``hermes`` (Qwen2.5, Qwen3, Hermes and the templates that copy them): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text before the first one is the content.
- ``llama3_json`` (Llama 3.1 / 3.2's JSON tool calling): the whole answer, after an optional ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``).

Text that is not a well-formed call stays content (a harness sees what the model wrote). While a row streams,
``streamable`` holds back the text that may be the start of a call, so a call is never sent as content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_PARSERS = ("", "hermes", "llama3_json")

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(_HERMES_START) + r"\s*(.*?)\s*" + re.escape(_HERMES_END), re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call(name: Any, arguments: Any) -> dict | None:
    """OpenAI's record of one call (``arguments`` as JSON text), or None for a malformed one."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict | str):
        return None
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            record = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        call = _call(record.get("name"), record.get("arguments", {})) if isinstance(record, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[: text.index(_HERMES_START)]
    return (content if content.strip() else None), calls


def _llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):  # JSON objects separated by ";" (which may also sit inside their strings)
        try:
            record, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
        call = None
        if isinstance(record, dict):
            call = _call(record.get("name"), record.get("parameters", record.get("arguments", {})))
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished answer: the calls ``parser`` finds in ``text`` (each
    ``{"id", "type": "function", "function": {"name", "arguments"}}``) and the content beside them (None where
    there is none); ``(text, [])`` where there is no well-formed call.

    Raises:
      ValueError: an unknown parser.
    """
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3_json(text)
    raise ValueError(f"tool_call_parser={parser!r}: expected one of {TOOL_CALL_PARSERS[1:]}")


def streamable(parser: str, text: str) -> int:
    """How many characters of a running answer's ``text`` can be streamed as content: up to a call's start (and
    not a tail that may begin one)."""
    if parser == "hermes":
        start = text.find(_HERMES_START)
        if start >= 0:
            return start
        hold = max((k for k in range(1, len(_HERMES_START)) if text.endswith(_HERMES_START[:k])), default=0)
        return len(text) - hold
    head = text.lstrip()
    if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
        return 0  # llama3_json: an answer that may be a call is held until it ends
    return len(text)


def arguments_as_objects(message: dict) -> dict:
    """An assistant message's ``tool_calls`` with JSON-text ``arguments`` read into objects, as chat templates
    render them (OpenAI's clients send text); other messages unchanged."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
    ):
        return message  # not OpenAI's shape: the template refuses it (a 400 naming messages)
    out = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # the template gets the text
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}
