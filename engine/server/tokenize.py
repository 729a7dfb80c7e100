"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes.

Why: a benchmark given only a server's URL needs the server's own tokenizer to make prompts of
an exact token count (text that encodes to N tokens, or valid non-special token ids). vLLM
answers these two routes; so does this server, with the same bodies, so one client serves both:

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true, ...} (chat, rendered
                      by the model's template as /v1/chat/completions renders it)
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}

Both run off the event loop (tokenising is work that grows with the body) and refuse what they
cannot answer with OpenAI's error shape, as every other route does.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.chat.render import ChatTemplateError
from engine.server.body import parse_request, read_body
from engine.server.errors import ApiError
from engine.server.schemas import ChatMessage, RequestModel
from engine.server.state import ServerState


class TokenizeRequest(RequestModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one model: `prompt` (text)
    or `messages` (a chat, rendered by the template), exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = Field(
        None, description="default: true for a prompt, false for messages (as vLLM)"
    )
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool | None = False

    def unsupported_field(self) -> str | None:
        return None

    @property
    def stream_options(self) -> None:  # body.validate checks it on every request model
        return None


class TokenizeResponse(RequestModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1_048_576)

    def unsupported_field(self) -> str | None:
        return None

    @property
    def stream_options(self) -> None:
        return None


class DetokenizeResponse(RequestModel):
    prompt: str


def _tokenize(state: ServerState, body: bytes) -> TokenizeResponse:
    req = parse_request(body, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "Send exactly one of 'prompt' (text) or 'messages' (a chat).")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = state.encode(req.prompt, add_special_tokens=special, param="prompt")
    else:
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        try:
            text = state.chat.render(
                messages,
                None,
                enable_thinking=False,
                add_generation_prompt=req.add_generation_prompt,
            )
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        ids = state.encode(text, add_special_tokens=bool(req.add_special_tokens), param="messages")
    strs = [state.tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_context, tokens=ids, token_strs=strs
    )


def _detokenize(state: ServerState, body: bytes) -> DetokenizeResponse:
    req = parse_request(body, DetokenizeRequest)
    state.check_model(req.model)
    bad = next((i for i in req.tokens if not 0 <= i < state.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400,
            f"Token id {bad} is out of vocabulary: this model's ids are 0 to "
            f"{state.vocab_size - 1}.",
            param="tokens",
        )
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, skip_special_tokens=False))


async def _answer(request: Request, fn: Any) -> Response:
    state: ServerState = request.app.state.server
    body = await read_body(request, state.limits.body_bytes)
    result = await state.off_loop(fn, state, body)
    return JSONResponse(result.model_dump())


async def tokenize(request: Request) -> Response:
    """POST /tokenize: the token ids of a text or a rendered chat (vLLM's shape)."""
    return await _answer(request, _tokenize)


async def detokenize(request: Request) -> Response:
    """POST /detokenize: the text of token ids (vLLM's shape)."""
    return await _answer(request, _detokenize)


def add_openapi_paths(spec: dict[str, Any]) -> dict[str, Any]:
    """Describe both routes in the server's OpenAPI document (in place; returns it)."""
    from pydantic.json_schema import models_json_schema

    ref = "#/components/schemas/{model}"
    _, defs = models_json_schema(
        [
            (TokenizeRequest, "validation"),
            (TokenizeResponse, "serialization"),
            (DetokenizeRequest, "validation"),
            (DetokenizeResponse, "serialization"),
        ],
        ref_template=ref,
    )
    spec["components"]["schemas"].update(defs["$defs"])

    def op(summary: str, request: type, reply: type) -> dict[str, Any]:
        def schema(model: type) -> dict[str, Any]:
            return {"application/json": {"schema": {"$ref": ref.format(model=model.__name__)}}}

        name = request.__name__
        return {
            "post": {
                "summary": summary,
                "operationId": name[0].lower() + name[1 : -len("Request")],
                "requestBody": {"required": True, "content": schema(request)},
                "responses": {
                    "200": {"description": "vLLM's response shape", "content": schema(reply)},
                    "400": {"description": "a request the tokenizer cannot answer"},
                },
            }
        }

    spec["paths"]["/tokenize"] = op(
        "token ids of a text or a chat (vLLM's shape)", TokenizeRequest, TokenizeResponse
    )
    spec["paths"]["/detokenize"] = op(
        "the text of token ids (vLLM's shape)", DetokenizeRequest, DetokenizeResponse
    )
    return spec
