"""The OpenAI-compatible HTTP app: chat, completions, models, health, metrics and the OpenAPI
document.

`create_app(engine, options=ServerOptions(...))` takes a `ServedEngine` (engine/interface.py:
the engine in this process, or the client of one in its own) and returns a Starlette app;
`python -m engine.server` (engine/server/main.py, also `gpurig engine serve`) runs it under
uvicorn. A request's body is read on
the event loop, then parsed, rendered and tokenised in a worker thread (bounded before any of it:
engine/server/limits.py), then queued for the generation workers (queue.py), which the engine's
scheduler batches (engine/scheduler.py).

Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for a body
that is not JSON or a request the model cannot serve (context overflow, bad token ids, a lone
surrogate, a template refusing the messages), 401 for a missing or wrong API key, 404 for an
unknown model or route, 422 for wrong types, 413 for an oversized body, 500 (with `Connection:
close`) for a bug. No request can take the server down: every failure is caught at the request
that caused it.

Layout: errors.py (the error shape), body.py (reading/validating bodies), state.py (what
handlers share), chat.py and completions.py (the two generation endpoints), sse.py (waiting on
a job, streaming), guard.py (API key, counting, last-resort 500s), openapi.py, cache_reset.py
(POST /reset_prefix_cache, as vLLM names it: what a benchmark calls between runs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine.server.cache_reset import reset_prefix_cache
from engine.server.chat import chat_completions
from engine.server.completions import completions
from engine.server.errors import ApiError
from engine.server.first_requests import answer_first_requests
from engine.server.guard import RequestGuard
from engine.server.limits import ServerOptions
from engine.server.openapi import openapi_spec
from engine.server.schemas import ModelCard, ModelList
from engine.server.state import ServerState
from engine.server.tokenize import add_openapi_paths, detokenize, tokenize

if TYPE_CHECKING:
    from engine.interface import ServedEngine


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
    ended = state.engine.ended  # an engine process that died (engine/process/client.py)
    if ended is not None:
        raise ApiError(503, f"The engine is not running: {ended}.", type_="server_error",
                       code="engine_dead")  # fmt: skip
    snap = state.metrics.snapshot()
    return JSONResponse(
        {
            "status": "ok",
            "model": state.model_name,
            "max_context": state.max_context,
            "busy": snap["busy"],
            "queue_waiting": snap["queue_waiting"],
            "running": snap["num_requests_running"],
            "waiting": snap["num_requests_waiting"],
        }
    )


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if request.query_params.get("format") == "json":
        return JSONResponse(state.metrics.snapshot())
    return PlainTextResponse(
        state.metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
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
        "GET /v1/models[/ID], GET /health, GET /metrics, GET /openapi.json and POST "
        "/reset_prefix_cache."
        if exc.status_code == 404
        else str(exc.detail)
    )
    return ApiError(exc.status_code, message, code=code).response()


def _version() -> str:
    try:
        return metadata.version("gpurig")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def create_app(
    engine: ServedEngine,
    model_name: str | None = None,
    aliases: tuple[str, ...] = (),
    options: ServerOptions | None = None,
    first_requests: bool = False,
    say: Callable[[str], None] | None = None,
) -> Starlette:
    """The server for `engine`, answering to `model_name` (default: the checkpoint's directory
    name) and any of `aliases` in the request's `model` field, under `options` (API key,
    max_tokens cap, body limit). first_requests: at startup, before a server binds its port,
    the app answers a completion and a chat completion to itself (first_requests.py); `say`
    gets the line that reports it."""
    state = ServerState(engine, model_name, aliases, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.queue.start()
        state.metrics.gc.install()
        try:
            if first_requests:
                line = await answer_first_requests(app, state)
                if say is not None:
                    say(line)
            yield
        finally:
            state.metrics.gc.uninstall()
            await asyncio.to_thread(state.queue.stop)

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
    )
    app.state.server = state
    spec = openapi_spec(state.model_name, _version(), bool(state.options.api_key))
    app.state.openapi = add_openapi_paths(spec)
    app.add_middleware(
        RequestGuard,
        metrics=state.metrics,
        known_paths=KNOWN_PATHS,
        api_key=state.options.api_key,
    )
    return app
