"""POST /v1/completions: a prompt as text or as token ids (exact token counts for sweeps).

Parsing and tokenising run in a worker thread; a token-id list longer than the context is
refused straight after JSON parsing, before validating two million integers one by one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server.body import parse_request, read_body
from engine.server.chat import usage
from engine.server.errors import ApiError, context_error
from engine.server.logprobs import completion_k, completion_logprobs
from engine.server.schemas import Completion, CompletionChoice, CompletionRequest, Timings, Usage
from engine.server.sse import SSEResponse, error_payload, first_event_or_error, run_to_end
from engine.server.state import ServerState, generation_request, submit, token_budget


def _precheck(state: ServerState, data: dict[str, Any]) -> None:
    """Refuse a token list that cannot fit the context before any per-item work."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) >= state.max_context:
        asked = data.get("max_tokens")
        asked = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
        raise context_error(state.max_context, len(prompt), asked, "prompt")


def completion_prompt(state: ServerState, req: CompletionRequest) -> list[int]:
    """The prompt's token ids. Blocking: run it off the event loop."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(
                400, "Send one prompt per request (batches are not supported).", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = state.encode(prompt, add_special_tokens=True, param="prompt")
    else:
        ids = [int(i) for i in prompt]
    return ids  # checked once, by the engine (state.submit)


def _prepare(state: ServerState, body: bytes) -> tuple[CompletionRequest, list[int], str]:
    req = parse_request(body, CompletionRequest, lambda data: _precheck(state, data))
    state.check_model(req.model)
    completion_k(req)  # a bad logprobs count is refused before the prompt is tokenised
    ids = completion_prompt(state, req)
    echo = state.tokenizer.decode(ids, skip_special_tokens=True) if req.echo else ""
    return req, ids, echo


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_body(request, state.limits.body_bytes)
    req, prompt_ids, echo = await state.off_loop(_prepare, state, body)
    budget = token_budget(state, len(prompt_ids), req.max_tokens, "prompt")
    k, want_ids = completion_k(req), bool(req.return_token_ids)
    as_ids = bool(req.return_tokens_as_token_ids)
    request_ = generation_request(state, req, prompt_ids, budget.max_new, state.eos_ids, k, True)
    job = await submit(state, request_, "prompt")
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    capped = {"max_tokens_capped": budget.capped} if budget.capped is not None else {}
    if not req.stream:
        done = await run_to_end(request.receive, job)
        result = done.result
        choice = CompletionChoice(text=echo + result.text, finish_reason=result.finish_reason)
        if k is not None:
            choice.logprobs = completion_logprobs(state.token_text, done.logprobs or [], k, 0,
                                                  as_ids)  # fmt: skip
        if want_ids:
            choice.token_ids, choice.prompt_token_ids = done.token_ids, prompt_ids
        out = Completion(
            id=completion_id,
            created=created,
            model=state.model_name,
            choices=[choice],
            usage=Usage(**usage(done)),
            timings=Timings(**done.timings()),
        )
        return JSONResponse({**out.model_dump(), **capped}, headers=budget.headers())

    events = await first_event_or_error(request.receive, job)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    sent_text = 0  # the text streamed so far: where the next chunk's text_offset starts
    first = True  # prompt_token_ids go on the first chunk

    def chunk(text: str, finish: str | None = None, event: Any = None,
              **extra: Any) -> dict[str, Any]:  # fmt: skip
        nonlocal sent_text, first
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish,
                                  "logprobs": None}  # fmt: skip
        if k is not None and event is not None and event.logprobs:
            choice["logprobs"] = completion_logprobs(
                state.token_text, event.logprobs, k, sent_text, as_ids
            ).model_dump()
        # as vLLM: both keys on every chunk, null unless return_token_ids
        choice["prompt_token_ids"] = prompt_ids if want_ids and first else None
        choice["token_ids"] = (
            (list(event.token_ids) if event is not None else []) if want_ids else None
        )
        first = False
        sent_text += len(text)
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
            **extra,
        }

    async def payloads() -> AsyncIterator[dict[str, Any]]:
        if echo:
            yield chunk(echo)
        async for event in events:
            if event.kind == "delta":
                yield chunk(event.text, event=event)
            elif event.kind == "error":
                yield error_payload(event.error)
                return
            else:
                use, timings = usage(event), event.timings()
                yield chunk("", event.result.finish_reason, usage=use, timings=timings, **capped)
                if include_usage:
                    yield {**chunk(""), "choices": [], "usage": use, "timings": timings}
                return

    return SSEResponse(job, payloads(), budget.headers())
