"""The OpenAI-compatible HTTP app: chat, completions, models, health and metrics.

`create_app(engine)` takes any object with the engine's surface (tokenizer, stream,
chat_template, eos_ids, bos_id, max_context, model_name, model_dir) and returns a Starlette app;
`gpurig engine serve` runs it under uvicorn. Requests are validated, rendered and tokenized on the
event loop (cheap), then queued for the single generation thread (engine/server/queue.py).

Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for a body
that is not JSON or a request the model cannot serve (context overflow, bad token ids, a
template refusing the messages), 404 for an unknown model or route, 422 for wrong types, 413 for
an oversized body, 500 for a bug. No request can take the server down: every failure is caught
at the request that caused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine.chat.render import (
    ChatTemplateError,
    bundled_template,
    encode_prompt,
    read_template,
    render_chat,
)
from engine.chat.tool_calls import CALL_OPEN, StreamingReplyParser, parse_reply
from engine.errors import ContextLengthError, GenerationError
from engine.server.metrics import Metrics
from engine.server.queue import GenerationQueue, GenerationRequest, GenerationResult, Job
from engine.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    NamedToolChoice,
    Timings,
    ToolCallOut,
    Usage,
)

log = logging.getLogger(__name__)
M = TypeVar("M", ChatCompletionRequest, CompletionRequest)

MAX_BODY_BYTES = 32 * 1024 * 1024
# Chat turns end on these even if generation_config.json forgot them.
CHAT_STOP_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")


class ApiError(Exception):
    """An error to send to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorBody(message=message, type=type_, param=param, code=code)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status)


class ServerState:
    """What every handler needs: the engine's facts, the queue, the metrics."""

    def __init__(self, engine: Any, model_name: str | None, aliases: tuple[str, ...]) -> None:
        self.engine = engine
        self.model_name = model_name or str(getattr(engine, "model_name", "model"))
        self.aliases = {self.model_name, *aliases}
        self.max_context = int(engine.max_context)
        self.tokenizer = engine.tokenizer
        model_dir = getattr(engine, "model_dir", None)
        self.template = (
            getattr(engine, "chat_template", None)
            or (read_template(model_dir) if model_dir is not None else None)
            or bundled_template()  # a checkpoint without a template: gpurig's Gemma 4 one
        )
        config = getattr(engine, "config", None)
        self.vocab_size = int(
            getattr(config, "vocab_size", None) or self.tokenizer.get_vocab_size()
        )
        self.created = int(time.time())
        self.metrics = Metrics(self.model_name)
        self.queue = GenerationQueue(engine, self.metrics)
        self.bos_token = self._token_text(getattr(engine, "bos_id", None), "<bos>")
        self.eos_ids = [int(i) for i in (getattr(engine, "eos_ids", None) or [])]
        chat_ids = {self.tokenizer.token_to_id(t) for t in CHAT_STOP_TOKENS}
        self.chat_stop_ids = sorted({*self.eos_ids, *(i for i in chat_ids if i is not None)})
        self.defaults = _sampling_defaults(getattr(engine, "model_dir", None))

    def _token_text(self, token_id: int | None, fallback: str) -> str:
        if token_id is None:
            return fallback
        return self.tokenizer.id_to_token(int(token_id)) or fallback

    def check_model(self, requested: str | None) -> None:
        if requested and requested not in self.aliases:
            raise ApiError(
                404,
                f"The model '{requested}' does not exist. This server serves '{self.model_name}' "
                "(see GET /v1/models).",
                param="model",
                code="model_not_found",
            )


def _sampling_defaults(model_dir: Any) -> dict[str, Any]:
    """Sampling defaults from generation_config.json, as vLLM does: a checkpoint that samples
    by default (do_sample) gets its temperature/top_p/top_k; otherwise greedy."""
    if model_dir is None:
        return {"temperature": 0.0}
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"temperature": 0.0}
    if not config.get("do_sample"):
        return {"temperature": 0.0}
    top_k, top_p = config.get("top_k"), config.get("top_p")
    return {  # transformers reads top_k 0 and top_p 1.0 as "off"; so do we
        "temperature": float(config.get("temperature", 1.0)),
        "top_p": float(top_p) if isinstance(top_p, int | float) and 0 < top_p < 1 else None,
        "top_k": int(top_k) if isinstance(top_k, int) and top_k > 0 else None,
    }


# ---- request parsing ---------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


async def _parse_body(request: Request, model: type[M]) -> M:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"The request body is over {MAX_BODY_BYTES} bytes.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is over {MAX_BODY_BYTES} bytes.")
    try:
        data = json.loads(bytes(body), parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        parsed = model.model_validate(data)
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        # drop pydantic's union-member tags ("str", "list[int]", ...) from the field path
        path = [str(p) for p in first["loc"] if str(p) not in _TYPE_TAGS and "[" not in str(p)]
        param = ".".join(path) or None
        count = exc.error_count()
        more = f" (and {count - 1} more problem{'s' if count > 2 else ''})" if count > 1 else ""
        raise ApiError(
            422,
            f"Invalid value for '{param}': {first['msg']}{more}",
            param=param,
            code="invalid_type" if first["type"].endswith("_type") else "invalid_value",
        ) from None
    name = parsed.unsupported_field()
    if name is not None:
        raise ApiError(
            400,
            f"'{name}' is not supported by this server; leave it out (or at its default).",
            param=name,
            code="unsupported_parameter",
        )
    if parsed.stream_options is not None and not parsed.stream:  # as OpenAI refuses it
        raise ApiError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    return parsed


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "NamedToolChoice", "literal"}


def _max_new_tokens(state: ServerState, prompt_len: int, asked: int | None, param: str) -> int:
    limit = state.max_context
    if prompt_len >= limit or (asked is not None and prompt_len + asked > limit):
        wanted = prompt_len + (asked or 0)
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{wanted} tokens ({prompt_len} in the prompt, {asked or 0} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param=param,
            code="context_length_exceeded",
        )
    return asked if asked is not None else limit - prompt_len


def _sampling(state: ServerState, req: Any) -> dict[str, Any]:
    d = state.defaults
    temperature = req.temperature if req.temperature is not None else d.get("temperature", 0.0)
    try:
        logit_bias = req.logit_bias_ids(state.vocab_size)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="logit_bias") from None
    return {
        "temperature": float(temperature),
        "top_p": req.top_p if req.top_p is not None else d.get("top_p"),
        "top_k": req.top_k if req.top_k is not None else d.get("top_k"),
        "seed": req.seed,
        "logit_bias": logit_bias,
    }


# ---- running a job -----------------------------------------------------------------------------


async def _watch_disconnect(receive: Callable[[], Awaitable[dict]], job: Job) -> None:
    """Cancel the job as soon as the client goes away (also while it still waits in line)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _engine_error_to_api(exc: BaseException | None) -> ApiError:
    if isinstance(exc, ContextLengthError):
        return ApiError(
            400,
            f"This model's maximum context length is {exc.limit} tokens; the prompt has "
            f"{exc.requested}.",
            param="messages",
            code="context_length_exceeded",
        )
    if isinstance(exc, GenerationError):
        return ApiError(400, str(exc))
    return ApiError(500, f"Generation failed: {type(exc).__name__}: {exc}", type_="server_error")


async def _run_to_end(request: Request, state: ServerState, job: Job) -> GenerationResult:
    watcher = asyncio.create_task(_watch_disconnect(request.receive, job))
    try:
        async for event in job.events():
            if event.kind == "error":
                raise _engine_error_to_api(event.error)
            if event.kind == "done":
                return event.result
        raise ApiError(500, "generation ended without a result", type_="server_error")
    finally:
        watcher.cancel()
        job.cancel()  # no-op when finished; stops the engine if we are unwinding early


class SSEResponse(Response):
    """Server-sent events from an async iterator of `data:` payloads, ending with [DONE].
    Watches for the client leaving and cancels the job then, not only at the next write."""

    media_type = "text/event-stream"

    def __init__(self, job: Job, payloads: AsyncIterator[dict[str, Any]]) -> None:
        # no Response.__init__: it would declare a Content-Length for an empty body
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.job = job
        self.payloads = payloads

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        watcher = asyncio.create_task(_watch_disconnect(receive, self.job))
        try:
            async for payload in self.payloads:
                if self.job.cancelled:
                    break
                data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
                await send({"type": "http.response.body", "body": data.encode(), "more_body": True})
            if not self.job.cancelled:
                await send(
                    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                )
        except OSError:  # the client went away between two writes
            self.job.cancel()
        finally:
            watcher.cancel()
            self.job.cancel()
            with contextlib.suppress(Exception):
                await self.payloads.aclose()


async def _first_event_or_error(job: Job, request: Request) -> AsyncIterator[Any]:
    """Start the job's events and fail as HTTP (not mid-stream) if the very first is an error,
    so a stream request that cannot run still gets a proper status code."""
    events = job.events()
    watcher = asyncio.create_task(_watch_disconnect(request.receive, job))
    try:
        first = await anext(events)
    finally:
        watcher.cancel()
    if first.kind == "error":
        raise _engine_error_to_api(first.error)

    async def chained() -> AsyncIterator[Any]:
        yield first
        async for event in events:
            yield event

    return chained()


def _error_payload(exc: BaseException) -> dict[str, Any]:
    return _engine_error_to_api(exc).body.model_dump()


# ---- handlers ----------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(result: GenerationResult) -> dict[str, int]:
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    ).model_dump()


class ChatPrompt(NamedTuple):
    """The prompt's token ids; whether tool calls are parsed out of the reply; and the text the
    prompt was made to end with so the reply starts inside a call (`tool_choice` "required" or
    a named function: the model continues after `<|tool_call>`), which the reply parser is fed
    first."""

    ids: list[int]
    parse_calls: bool
    forced: str


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> ChatPrompt:
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text":
                    raise ApiError(
                        400,
                        f"messages[{i}] has a '{part.type}' part; this server handles text only.",
                        param=f"messages.{i}.content",
                    )
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if choice == "none":
        tools = []
    elif choice == "required" and not tools:
        raise ApiError(
            400, "tool_choice 'required' needs a non-empty tools list.", param="tool_choice"
        )
    elif isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise ApiError(
                400,
                f"tool_choice names '{choice.function.name}', which is not in tools.",
                param="tool_choice",
            )
    # reasoning_content goes to the template as sent: Google's Gemma 4 template shows it again
    # within a tool-calling turn and drops it from earlier turns; gpurig's own ignores it
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = render_chat(
            state.template,
            messages,
            tools or None,
            add_generation_prompt=True,
            enable_thinking=req.thinking(),
            bos_token=state.bos_token,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    forced = CALL_OPEN if choice == "required" or isinstance(choice, NamedToolChoice) else ""
    return ChatPrompt(encode_prompt(state.tokenizer, text + forced), bool(tools), forced)


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await _parse_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    prompt_ids, parse_calls, forced = _chat_prompt(state, req)
    asked = req.max_completion_tokens or req.max_tokens
    max_new = _max_new_tokens(state, len(prompt_ids), asked, "messages")
    job = state.queue.submit(
        GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            stop_ids=[] if req.ignore_eos else state.chat_stop_ids,
            stop_strings=req.stop_strings(),
            skip_special_tokens=False,  # the parser needs the markers
            **_sampling(state, req),
        )
    )
    completion_id, created = _id("chatcmpl"), int(time.time())
    if not req.stream:
        result = await _run_to_end(request, state, job)
        reply = parse_reply(forced + result.text, parse_calls=parse_calls)
        calls = [ToolCallOut(**c.to_openai()) for c in reply.tool_calls] or None
        finish = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        body = ChatCompletion(
            id=completion_id,
            created=created,
            model=state.model_name,
            choices=[
                ChatChoice(
                    message=AssistantMessage(
                        content=reply.content,
                        reasoning_content=reply.reasoning_content,
                        tool_calls=calls,
                    ),
                    finish_reason=finish,
                )
            ],
            usage=Usage(**_usage(result)),
            timings=Timings(**result.timings()),
        )
        return JSONResponse(body.model_dump(exclude_none=False))

    events = await _first_event_or_error(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            **extra,
        }

    async def payloads() -> AsyncIterator[dict[str, Any]]:
        parser = StreamingReplyParser(parse_calls=parse_calls)
        parser.feed(forced)  # opens the call; it emits nothing until the call is complete
        n_calls = 0
        yield chunk({"role": "assistant", "content": ""})

        def deltas(stream_events: list[Any]) -> list[dict[str, Any]]:
            nonlocal n_calls
            out = []
            for e in stream_events:
                if e.kind == "content":
                    out.append({"content": e.text})
                elif e.kind == "reasoning":
                    out.append({"reasoning_content": e.text})
                else:
                    out.append({"tool_calls": [{"index": n_calls, **e.call.to_openai()}]})
                    n_calls += 1
            return out

        async for event in events:
            if event.kind == "delta":
                for d in deltas(parser.feed(event.text)):
                    yield chunk(d)
            elif event.kind == "error":
                yield _error_payload(event.error)
                return
            else:
                result: GenerationResult = event.result
                for d in deltas(parser.finish()):
                    yield chunk(d)
                finish = result.finish_reason
                if n_calls and finish == "stop":
                    finish = "tool_calls"
                usage, timings = _usage(result), result.timings()
                yield chunk({}, finish, usage=usage, timings=timings)
                if include_usage:
                    yield {**chunk({}), "choices": [], "usage": usage, "timings": timings}
                return

    return SSEResponse(job, payloads())


def _completion_prompt(state: ServerState, req: CompletionRequest) -> list[int]:
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(
                400, "Send one prompt per request (batches are not supported).", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(state.tokenizer.encode(prompt, add_special_tokens=True).ids)
    else:
        ids = [int(i) for i in prompt]
        bad = next((i for i in ids if not 0 <= i < state.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"Token id {bad} is outside the vocabulary (0..{state.vocab_size - 1}).",
                param="prompt",
            )
    if not ids:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    return ids


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await _parse_body(request, CompletionRequest)
    state.check_model(req.model)
    prompt_ids = _completion_prompt(state, req)
    max_new = _max_new_tokens(state, len(prompt_ids), req.max_tokens, "prompt")
    job = state.queue.submit(
        GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            stop_ids=[] if req.ignore_eos else state.eos_ids,
            stop_strings=req.stop_strings(),
            skip_special_tokens=True,
            **_sampling(state, req),
        )
    )
    completion_id, created = _id("cmpl"), int(time.time())
    echo = state.tokenizer.decode(prompt_ids, skip_special_tokens=True) if req.echo else ""
    if not req.stream:
        result = await _run_to_end(request, state, job)
        body = Completion(
            id=completion_id,
            created=created,
            model=state.model_name,
            choices=[CompletionChoice(text=echo + result.text, finish_reason=result.finish_reason)],
            usage=Usage(**_usage(result)),
            timings=Timings(**result.timings()),
        )
        return JSONResponse(body.model_dump())

    events = await _first_event_or_error(job, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            **extra,
        }

    async def payloads() -> AsyncIterator[dict[str, Any]]:
        if echo:
            yield chunk(echo)
        async for event in events:
            if event.kind == "delta":
                yield chunk(event.text)
            elif event.kind == "error":
                yield _error_payload(event.error)
                return
            else:
                result: GenerationResult = event.result
                usage, timings = _usage(result), result.timings()
                yield chunk("", result.finish_reason, usage=usage, timings=timings)
                if include_usage:
                    yield {**chunk(""), "choices": [], "usage": usage, "timings": timings}
                return

    return SSEResponse(job, payloads())


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_context)


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse(ModelList(data=[_card(state)]).model_dump())


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id} (the openai client's models.retrieve): the card, or a 404."""
    state: ServerState = request.app.state.server
    state.check_model(request.path_params["model_id"] or "?")
    return JSONResponse(_card(state).model_dump())


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    snap = state.metrics.snapshot()
    return JSONResponse(
        {
            "status": "ok",
            "model": state.model_name,
            "max_context": state.max_context,
            "busy": snap["busy"],
            "queue_waiting": snap["queue_waiting"],
        }
    )


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if request.query_params.get("format") == "json":
        return JSONResponse(state.metrics.snapshot())
    return PlainTextResponse(
        state.metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


# ---- app ---------------------------------------------------------------------------------------

ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
KNOWN_PATHS = {r.path for r in ROUTES}


async def _api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = (
        "No such endpoint. This server has POST /v1/chat/completions, POST /v1/completions, "
        "GET /v1/models[/ID], GET /health and GET /metrics."
        if exc.status_code == 404
        else str(exc.detail)
    )
    return ApiError(exc.status_code, message, code=code).response()


async def _server_error(_request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in a request", exc_info=exc)
    return ApiError(500, f"Internal error: {type(exc).__name__}", type_="server_error").response()


class _CountRequests:
    """ASGI middleware counting requests by endpoint and status for /metrics."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_PATHS else "other"
        if path.startswith("/v1/models/"):  # one label for every id (bounded label values)
            endpoint = "/v1/models/{id}"
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.record_request(endpoint, status["code"])


def create_app(
    engine: Any, model_name: str | None = None, aliases: tuple[str, ...] = ()
) -> Starlette:
    """The server for `engine`, answering to `model_name` (default: the checkpoint's directory
    name) and any of `aliases` in the request's `model` field."""
    state = ServerState(engine, model_name, aliases)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        state.queue.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.queue.stop)

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    app.state.server = state
    app.add_middleware(_CountRequests, metrics=state.metrics)
    return app
