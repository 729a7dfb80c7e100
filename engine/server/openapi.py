"""GET /openapi.json: the server's OpenAPI 3.1 description, generated from the pydantic models
the handlers validate with (engine/server/schemas.py), so schema-driven clients and fuzzers see
exactly what the server accepts. OpenAPI 3.1 takes JSON Schema 2020-12 as is, which is what
pydantic writes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from engine.server.cache_reset import PrefixCacheReset
from engine.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)

REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "a request the model cannot serve (context, token ids, unsupported field, bad JSON)",
    "401": "a missing or wrong API key (when the server has one)",
    "404": "an unknown model",
    "409": "requests are running: retry once they have ended",
    "413": "a body over the server's limit",
    "422": "a field of the wrong type or out of range (`param` names it)",
    "500": "a server bug (the reply says Connection: close)",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    return {c: _json(_ref(ErrorResponse), _ERRORS[c]) for c in codes}


def _generation(summary: str, request: type[BaseModel], reply: type[BaseModel]) -> dict[str, Any]:
    ok = _json(_ref(reply), "the reply; with `stream: true`, server-sent events ending [DONE]")
    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    ok["headers"] = {
        "X-Gpurig-Max-Tokens-Capped": {
            "description": "the server's max_tokens limit, when it cut this request down to it",
            "schema": {"type": "integer"},
        }
    }
    return {
        "post": {
            "summary": summary,
            "operationId": request.__name__[0].lower() + request.__name__[1:],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": ok, **_errors("400", "401", "404", "413", "422", "500")},
        }
    }


def _get(summary: str, op_id: str, ok: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": op_id, "responses": {"200": ok}, **extra}}


def openapi_spec(model_name: str, version: str, api_key: bool) -> dict[str, Any]:
    """The OpenAPI document; `api_key` adds bearer auth to the /v1 operations."""
    _, defs = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (ChatCompletion, "serialization"),
            (Completion, "serialization"),
            (ModelList, "serialization"),
            (ModelCard, "serialization"),
            (ErrorResponse, "serialization"),
            (PrefixCacheReset, "serialization"),
        ],
        ref_template=REF,
    )
    models_op = _get("the served model", "listModels", _json(_ref(ModelList), "one model card"))
    model_op = _get(
        "one model's card (404 for any other name)",
        "retrieveModel",
        _json(_ref(ModelCard), "the card"),
        parameters=[
            {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
    )
    model_op["get"]["responses"].update(_errors("401", "404"))
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation(
            "chat (tools, thinking, streaming)", ChatCompletionRequest, ChatCompletion
        ),
        "/v1/completions": _generation(
            "text completion from text or token ids", CompletionRequest, Completion
        ),
        "/v1/models": models_op,
        "/v1/models/{model_id}": model_op,
        "/health": _get(
            "liveness, busy flag and queue depth (no API key needed)",
            "health",
            _json({"type": "object"}, "status, model, max_context, busy, queue_waiting"),
        ),
        "/metrics": _get(
            "Prometheus text, or JSON with ?format=json (no API key needed)",
            "metrics",
            {
                "description": "counters and gauges",
                "content": {
                    "text/plain": {"schema": {"type": "string"}},
                    "application/json": {"schema": {"type": "object"}},
                },
            },
            parameters=[
                {
                    "name": "format",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string", "enum": ["json"]},
                },  # fmt: skip
            ],
        ),
        "/reset_prefix_cache": {
            "post": {
                "summary": "vLLM's cache reset between benchmark runs (the engine keeps no "
                "cross-request cache: says so)",
                "operationId": "resetPrefixCache",
                "responses": {
                    "200": _json(_ref(PrefixCacheReset), "what was reset, and why no more"),
                    **_errors("409"),
                },
            }
        },
        "/openapi.json": _get("this document", "openapi", _json({"type": "object"}, "OpenAPI 3.1")),
    }
    components: dict[str, Any] = {"schemas": defs["$defs"]}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "gpurig engine server",
            "version": version,
            "description": f"OpenAI-compatible API serving '{model_name}' with gpurig's "
            "in-process engine. Errors: {'error': {message, type, param, code}}.",
        },
        "paths": paths,
        "components": components,
    }
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return spec
