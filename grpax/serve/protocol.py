"""The OpenAI wire format of ``grpax serve``: request bodies (validated once, here) and response records.

Requests follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` bodies, with the fields vLLM's server
adds for token-in/token-out harnesses (SkyRL, NeMo Gym, verl's agent loops): a completion prompt may be token
ids (``prompt: [int, ...]`` or a list of them), ``return_token_ids`` adds ``prompt_token_ids`` and each
choice's ``token_ids``, ``top_k`` sits beside ``top_p``. grpax adds ``policy_version`` to every response (the
params version that sampled its oldest token, ``Engine.update_params``) and, with ``return_token_ids``, each
choice's per-token ``policy_versions``. Unknown fields are ignored, as OpenAI-compatible servers do; fields
grpax cannot honour (penalties, logit_bias, echo, suffix) are refused with a 400 naming them rather than silently
ignored. ``tools`` reach the chat template (which renders them where it can); with the server's
``tool_call_parser`` the model's calls come back as ``tool_calls`` (``grpax.serve.tools``); ``tool_choice`` may be
``auto`` or ``none`` (forcing a call needs constrained decoding, which grpax serve does not have).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOP_LOGPROBS = 20  # vLLM's default limit


class RequestError(ValueError):
    """A request the server refuses: a 400 (or ``status``) with one line naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's sampling rule (``Engine.submit``'s per-request sampling fields; any rules share a batch).

    ``temperature`` 0 is argmax (greedy); top_k 0 and top_p 1.0 are off.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampler_fields(self) -> dict:
        """These settings as ``Engine.submit``'s (``SamplerConfig``'s) fields (greedy ignores the others, so they
        are fixed)."""
        if self.greedy:
            return {"greedy": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
        return {"greedy": False, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


class _Body(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 = off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def sampling(self) -> Sampling:
        top_k = self.top_k if self.top_k and self.top_k > 0 else 0
        temperature = 1.0 if self.temperature is None else self.temperature
        return Sampling(temperature, 1.0 if self.top_p is None else self.top_p, top_k)

    def check_supported(self) -> None:
        """Raises RequestError for a field grpax serve does not implement, set to a non-default value."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(
                    f"{name}={getattr(self, name)}: grpax serve samples without penalties", name
                )
        if self.logit_bias:
            raise RequestError("logit_bias: grpax serve does not support it", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (choices ``i * n + j``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise RequestError("echo=true: grpax serve does not echo prompts", "echo")
        if self.suffix:
            raise RequestError("suffix: grpax serve does not insert suffixes", "suffix")

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text (a list of parts: their ``text`` parts joined)."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise RequestError("messages: only text content parts are supported", "messages")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Body):
    """``POST /v1/chat/completions``: the messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extra fields
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "continue_final_message=true needs add_generation_prompt=false", "continue_final_message"
            )
        if self.tool_choice not in (None, "auto", "none"):
            raise RequestError(
                f"tool_choice={self.tool_choice!r}: grpax serve lets the model choose ('auto') or not call ('none'); "
                "forcing a call needs constrained decoding, which it does not have",
                "tool_choice",
            )

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error record."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(texts: list[str], logprobs: list[float], top: list[list[tuple[str, float]]] | None) -> dict:
    """A chat choice's ``logprobs``: one entry per token (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""

    def entry(text: str, value: float) -> dict:
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = []
    for i, (text, value) in enumerate(zip(texts, logprobs, strict=True)):
        record = entry(text, value)
        record["top_logprobs"] = [entry(t, v) for t, v in top[i]] if top is not None else []
        content.append(record)
    return {"content": content}


def completion_logprobs(
    texts: list[str], logprobs: list[float], top: list[list[tuple[str, float]]] | None, offset: int = 0
) -> dict:
    """A completion choice's legacy ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``); ``offset`` is the text length before these tokens."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": [dict(entries) for entries in top] if top is not None else None,
        "text_offset": offsets,
    }


FinishReason = Literal["stop", "length", "tool_calls"]
