"""The HTTP side of ``grpax serve``: an OpenAI-compatible ASGI app (FastAPI on uvicorn) over ``EngineWorker``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent
events with ``stream: true``), ``GET /health``, and with ``allow_update_params`` ``POST /v1/update_params``
(``{"load_parameters_path": ..., "version": N}``: a checkpoint of the same model, loaded and swapped in between
engine steps). Field names follow OpenAI and, for token ids, vLLM's server (``grpax.serve.protocol``).

A request is checked before it reaches the engine: an unknown model is a 404, a prompt over
``max_prompt_length`` tokens, ``max_tokens`` over ``max_completion_length``, ``n`` over the engine's slots, a bad
sampling value or malformed JSON a 400 with one line naming the field; the engine never queues work it cannot
hold. A client that disconnects cancels its request (its rows leave the batch, their pages are freed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from grpax.serve import protocol, tools
from grpax.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from grpax.serve.worker import EngineWorker, Job, Progress

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


class Choice:
    """One row's text and tokens as they arrive: detokenised, cut at the first stop string (the stop string
    itself dropped, as OpenAI does; its tokens kept up to the one that completed it)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    def add(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], reason: str | None
    ) -> None:
        if self.finish_reason is not None:
            return  # stopped by a stop string: later tokens are not part of the answer
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += versions
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._cut(cut)
            self.finish_reason = "stop"
        else:
            self.finish_reason = reason

    def _cut(self, cut: int) -> None:
        """Keeps the shortest token prefix whose text holds a stop string, and the text before it."""
        for k in range(1, len(self.token_ids) + 1):
            text = self.tokenizer.decode(self.token_ids[:k], skip_special_tokens=True)
            if any(s in text for s in self.stops):
                break
        del self.token_ids[k:], self.logprobs[k:], self.versions[k:]
        self.text = self.text[:cut]

    def stable_text(self) -> str:
        """The text that can be sent while the row runs: without a tail that may start a stop string or that
        ends inside a character (a partial UTF-8 sequence decodes to U+FFFD)."""
        if self.finish_reason is not None:
            return self.text
        text = self.text.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in self.stops), default=0)
        return text[: len(text) - hold] if hold else text


class Server:
    """The app's state: the worker, the tokenizer and the served model's name and limits."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer,
        model_id: str,
        *,
        api_key: str = "",
        load_params: Callable[[str], Any] | None = None,
        tool_call_parser: str = "",
    ):
        self.worker, self.tokenizer, self.model_id = worker, tokenizer, model_id
        self.api_key, self.load_params = api_key, load_params
        self.tool_call_parser = tool_call_parser
        self._swap = asyncio.Lock()

    # -- checks --------------------------------------------------------------------------------------------

    def check(self, body, prompts: list[list[int]], max_tokens: int | None, default_max: int) -> int:
        """Raises RequestError for a request the engine cannot hold; returns its max_tokens."""
        w = self.worker
        if body.model != self.model_id:
            raise RequestError(
                f"model={body.model!r} does not exist: this server serves {self.model_id!r}", "model", 404
            )
        body.check_supported()
        for i, p in enumerate(prompts):
            if not p:
                raise RequestError(f"prompt {i} is empty", "prompt")
            if len(p) > w.max_prompt_length:
                raise RequestError(
                    f"prompt has {len(p)} tokens, over this server's max_prompt_length={w.max_prompt_length}: "
                    "shorten it or restart grpax serve with a larger max_prefill_predict_length",
                    "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                )
        max_tokens = max_tokens or default_max
        if max_tokens > w.max_completion_length:
            raise RequestError(
                f"max_tokens={max_tokens} is over this server's max_completion_length={w.max_completion_length}",
                "max_tokens",
            )
        if body.n > w.num_slots:
            raise RequestError(f"n={body.n} is over this server's max_num_seqs={w.num_slots}", "n")
        V = w.cfg.vocab_size
        if any(not 0 <= t < V for p in prompts for t in p):
            raise RequestError(f"prompt token ids must be in 0..{V - 1}", "prompt")
        return max_tokens

    # -- rendering ------------------------------------------------------------------------------------------

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = []
        for i, m in enumerate(body.messages):
            record = {k: v for k, v in m.model_dump(exclude_none=True).items() if k != "content"}
            record["content"] = m.text()
            record = tools.arguments_as_objects(record)
            if m.role not in ("system", "user", "assistant", "tool", "developer"):
                raise RequestError(f"messages[{i}].role={m.role!r} is not a chat role", f"messages[{i}].role")
            messages.append(record)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tokenize=False,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - jinja raises anything a template raises
            raise RequestError(f"messages: the chat template refused them ({e})", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def parser_for(self, body, chat: bool) -> str:
        """The tool-call parser that reads this request's answers ('' = none): the server's, for a chat request
        that sends ``tools`` and allows calls."""
        if chat and self.tool_call_parser and body.tools and body.tool_choice != "none":
            return self.tool_call_parser
        return ""

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            return [self.tokenizer.encode(p, add_special_tokens=False)]
        if not p:
            raise RequestError("prompt is empty", "prompt")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return [
            self.tokenizer.encode(t, add_special_tokens=False) if isinstance(t, str) else list(t) for t in p
        ]

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    async def top(self, prompt, choice: Choice, start: int, k: int | None, temperature: float):
        """(token text, logprob) alternatives of ``choice``'s tokens ``start..`` (None when not asked for)."""
        if not k:
            return None if k is None else [[] for _ in choice.token_ids[start:]]
        scored = await asyncio.to_thread(
            self.worker.top_logprobs, prompt, choice.token_ids, start, k, temperature or 1.0
        )
        return [[(self.tokenizer.decode([i]), v) for i, v in entries] for entries in scored]


def _json_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    elif status == 404:
        kind = "not_found_error"
    return JSONResponse(protocol.error_body(message, param, kind), status_code=status)


# the tags pydantic adds to an error's location for a union's branch (``prompt.list[int].0``) or a validator
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-\w+\[.*\])$")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for pydantic's first error: the field and what is wrong."""
    error = exc.errors()[0]
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    if error.get("type") == "json_invalid":
        return f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    if error.get("type") == "missing" and not loc:
        return "the body must be a JSON object", None
    # a union's branches add their type names to the location; the field is the first part
    field = ".".join(x for x in loc if not _UNION_BRANCH.match(x))
    return (
        f"{field or 'body'}: {error.get('msg')} (got {json.dumps(error.get('input'), default=str)[:60]})",
        field or None,
    )


def build_app(server: Server) -> FastAPI:
    """The FastAPI app over ``server`` (its worker must be started)."""
    app = FastAPI(title="grpax serve", docs_url=None, redoc_url=None)
    _add_error_handlers(app)

    async def authorize(request: Request) -> None:
        if server.api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                raise RequestError("invalid or missing API key (Authorization: Bearer <api_key>)", None, 401)

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": server.worker.version}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return _models(server)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        prompts = server.completion_prompts(body)
        max_tokens = server.check(body, prompts, body.max_tokens, 16)  # OpenAI's default for completions
        return await _respond(server, request, body, prompts, max_tokens, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        prompts = [server.chat_prompt(body)]
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = server.check(body, prompts, asked, server.worker.max_completion_length)
        return await _respond(server, request, body, prompts, max_tokens, chat=True)

    @app.post("/v1/update_params", dependencies=[Depends(authorize)])
    async def update_params(request: Request):
        return await _update_params(server, request)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered as OpenAI's JSON error body: a request's own, a validation's, HTTP's, a crash's."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _json_error(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _json_error(400, *_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _json_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.exception("request failed")
        return _json_error(500, f"internal error: {type(exc).__name__}: {exc}")


def _models(server: Server) -> dict:
    """``GET /v1/models``: the one model served, its context length and policy version."""
    w = server.worker
    return {
        "object": "list",
        "data": [
            {
                "id": server.model_id,
                "object": "model",
                "created": protocol.now(),
                "owned_by": "grpax",
                "max_model_len": w.max_prompt_length + w.max_completion_length,
                "policy_version": w.version,
            }
        ],
    }


async def _update_params(server: Server, request: Request) -> dict:
    """``POST /v1/update_params``: the weights of ``load_parameters_path`` swapped in as ``version`` (default:
    the next), queued work kept."""
    if server.load_params is None:
        raise RequestError(
            "weight updates are off: start grpax serve with allow_update_params=true", None, 403
        )
    try:
        body = await request.json()
    except ValueError as e:
        raise RequestError(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("load_parameters_path"), str):
        raise RequestError("load_parameters_path: expected the checkpoint's path", "load_parameters_path")
    version = body.get("version", server.worker.version + 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise RequestError(f"version={version!r}: expected an integer", "version")
    async with server._swap:
        try:
            params = await asyncio.to_thread(server.load_params, body["load_parameters_path"])
        except (OSError, ValueError) as e:
            raise RequestError(f"load_parameters_path: {e}", "load_parameters_path") from None
        await asyncio.to_thread(server.worker.update_params, params, version)
    return {"policy_version": version}


async def _respond(server: Server, request: Request, body, prompts, max_tokens: int, *, chat: bool):
    """Submits the job and answers with JSON, or with server-sent events when ``body.stream``."""
    loop = asyncio.get_running_loop()
    seed = body.seed if body.seed is not None else secrets.randbits(32)
    job = Job(prompts, body.n, max_tokens, body.sampling(), seed, loop, asyncio.Queue())
    choices = [Choice(server.tokenizer, body.stop or []) for _ in range(job.num_rows)]
    server.worker.submit(job)
    rid = protocol.request_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        return StreamingResponse(
            _stream(server, job, choices, body, rid, chat), media_type="text/event-stream"
        )
    while True:
        try:
            progress = await asyncio.wait_for(job.updates.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                server.worker.cancel(job)
                return JSONResponse(protocol.error_body("client disconnected"), status_code=499)
            continue
        if progress.error and progress.error != "cancelled":
            return _json_error(500, progress.error)
        if _apply(progress, choices) or progress.done:
            if not progress.done:
                server.worker.cancel(job)  # every row met a stop string
            break
    return JSONResponse(await _final(server, job, choices, body, rid, chat))


def _streamed_text(parser: str, c: Choice) -> tuple[str, list[dict]]:
    """A choice's content that may be sent now and, once it finished, its tool calls: without a parser the
    stable text; with one, the text before a call while it runs, then the parsed content and calls."""
    if not parser:
        return c.stable_text(), []
    if c.finish_reason is None:
        text = c.stable_text()
        return text[: tools.streamable(parser, text)], []
    content, calls = tools.parse_tool_calls(parser, c.text)
    return content or "", calls


def _apply(progress: Progress, choices: list[Choice]) -> bool:
    """Adds a step's tokens to the choices; True when every choice has finished."""
    for row in progress.rows:
        choices[row.row].add(row.token_ids, row.logprobs, row.versions, row.finish_reason)
    return all(c.finish_reason is not None for c in choices)


def _version(choices: list[Choice], fallback: int) -> int:
    """The oldest policy version among the choices' tokens (the one a trainer's staleness counts from)."""
    return min((v for c in choices for v in c.versions), default=fallback)


async def _final(server: Server, job: Job, choices: list[Choice], body, rid: str, chat: bool) -> dict:
    k = body.num_top_logprobs
    temperature = job.sampling.temperature
    parser = server.parser_for(body, chat)
    out = []
    for i, c in enumerate(choices):
        prompt = job.prompts[i // job.n]
        logprobs = None
        if k is not None:
            top = await server.top(prompt, c, 0, k, temperature)
            texts = server.token_texts(c.token_ids)
            logprobs = (protocol.chat_logprobs if chat else protocol.completion_logprobs)(
                texts, c.logprobs, top
            )
        record: dict[str, Any] = {
            "index": i,
            "finish_reason": c.finish_reason or "stop",
            "logprobs": logprobs,
        }
        if chat:
            record["message"] = {"role": "assistant", "content": c.text}
            if parser:
                content, calls = tools.parse_tool_calls(parser, c.text)
                record["message"]["content"] = content
                if calls:
                    record["message"]["tool_calls"] = calls
                    record["finish_reason"] = "tool_calls"
        else:
            record["text"] = c.text
        if body.return_token_ids:
            record["token_ids"] = c.token_ids
            record["policy_versions"] = c.versions
            if not chat:
                record["prompt_token_ids"] = prompt
        out.append(record)
    result = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": protocol.now(),
        "model": server.model_id,
        "choices": out,
        "usage": protocol.usage(
            sum(map(len, job.prompts)),
            sum(len(c.token_ids) for c in choices),
        ),
        "policy_version": _version(choices, server.worker.version),
    }
    if chat and body.return_token_ids:
        result["prompt_token_ids"] = job.prompts[0]
    return result


async def _chunk(
    server: Server,
    job: Job,
    body,
    chat: bool,
    i: int,
    c: Choice,
    delta_text: str,
    calls: list[dict],
    sent_text: int,
    sent_tokens: int,
) -> dict[str, Any]:
    """Choice ``i``'s record in a streamed chunk: its new text (chat: a delta, with its tool calls once it
    ended), the new tokens' logprobs and, with ``return_token_ids``, their ids and policy versions."""
    new_ids = c.token_ids[sent_tokens:]
    record: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason}
    if chat:
        record["delta"] = {"content": delta_text}
        if calls:
            record["delta"]["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
            record["finish_reason"] = "tool_calls"
    else:
        record["text"] = delta_text
    record["logprobs"] = None
    k = body.num_top_logprobs
    if k is not None:
        top = await server.top(job.prompts[i // job.n], c, sent_tokens, k, job.sampling.temperature)
        texts, lps = server.token_texts(new_ids), c.logprobs[sent_tokens:]
        if chat:
            record["logprobs"] = protocol.chat_logprobs(texts, lps, top)
        else:
            record["logprobs"] = protocol.completion_logprobs(texts, lps, top, len(c.text[:sent_text]))
    if body.return_token_ids:
        record["token_ids"] = new_ids
        record["policy_versions"] = c.versions[sent_tokens:]
        if not chat and sent_tokens == 0:
            record["prompt_token_ids"] = job.prompts[i // job.n]
    return record


async def _stream(server: Server, job: Job, choices: list[Choice], body, rid: str, chat: bool):
    """Server-sent events: one chunk per choice per engine step that added text, then each choice's finish,
    the usage (``stream_options.include_usage``) and ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    created, parser = protocol.now(), server.parser_for(body, chat)
    sent_text = [0] * len(choices)
    sent_tokens = [0] * len(choices)
    finished = [False] * len(choices)

    def event(payload_choices: list[dict], **extra) -> str:
        record = {"id": rid, "object": kind, "created": created, "model": server.model_id}
        record.update(choices=payload_choices, **extra)
        return f"data: {json.dumps(record)}\n\n"

    done = False
    try:
        if chat:
            first = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(choices))
            ]
            extra = {"prompt_token_ids": job.prompts[0]} if body.return_token_ids else {}
            yield event(first, **extra)
        while not done:
            progress = await job.updates.get()
            if progress.error and progress.error != "cancelled":
                yield f"data: {json.dumps(protocol.error_body(progress.error, None, 'server_error'))}\n\n"
                break
            all_finished = _apply(progress, choices)
            done = progress.done or all_finished
            for i, c in enumerate(choices):
                if finished[i]:
                    continue
                text, calls = _streamed_text(parser, c)
                delta_text = text[sent_text[i] :]
                new_ids = c.token_ids[sent_tokens[i] :]
                if not delta_text and not new_ids and c.finish_reason is None:
                    continue
                record = await _chunk(
                    server, job, body, chat, i, c, delta_text, calls, sent_text[i], sent_tokens[i]
                )
                version = min(c.versions[sent_tokens[i] :], default=server.worker.version)
                sent_text[i], sent_tokens[i] = len(text), len(c.token_ids)
                finished[i] = c.finish_reason is not None
                yield event([record], policy_version=version)
            if all_finished and not progress.done:
                server.worker.cancel(job)  # every row met a stop string
        if body.include_usage:
            prompt_tokens = sum(map(len, job.prompts))
            yield event([], usage=protocol.usage(prompt_tokens, sum(len(c.token_ids) for c in choices)))
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away (the response was cancelled) or an error ended the stream
            server.worker.cancel(job)
