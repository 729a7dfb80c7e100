"""POST /v1/chat/completions: messages (+ tools) through the checkpoint's chat template, the
reply parsed back into content, reasoning_content and tool_calls.

The request is parsed, rendered and tokenised in a worker thread (state.off_loop): a template
over megabytes of messages or a tokenizer over a long prompt never stalls the event loop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.chat.render import ChatTemplateError
from engine.chat.tool_calls import CALL_OPEN, StreamingReplyParser, parse_reply
from engine.server.body import parse_request, read_body
from engine.server.errors import ApiError, excerpt
from engine.server.logprobs import chat_k, chat_logprobs
from engine.server.queue import Event
from engine.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    NamedToolChoice,
    Timings,
    ToolCallOut,
    Usage,
)
from engine.server.sse import SSEResponse, error_payload, first_event_or_error, run_to_end
from engine.server.state import ServerState, generation_request, submit, token_budget


class ChatPrompt(NamedTuple):
    """The prompt's token ids; whether tool calls are parsed out of the reply; and the text the
    prompt was made to end with so the reply starts inside a call (`tool_choice` "required" or
    a named function: the model continues after `<|tool_call>`), which the reply parser is fed
    first."""

    ids: list[int]
    parse_calls: bool
    forced: str


def usage(done: Event) -> dict[str, int]:
    """OpenAI's usage of a finished job."""
    result = done.result
    assert result is not None
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.new_tokens,
        total_tokens=result.prompt_tokens + result.new_tokens,
    ).model_dump()


def _offered_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools the template shows, after tool_choice."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if choice == "none":
        return []
    if choice == "required" and not tools:
        raise ApiError(
            400, "tool_choice 'required' needs a non-empty tools list.", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise ApiError(
                400,
                f"tool_choice names '{excerpt(choice.function.name)}', which is not in tools.",
                param="tool_choice",
            )
    return tools


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> ChatPrompt:
    """Render and tokenise a chat request. Blocking: run it off the event loop."""
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text":
                    raise ApiError(
                        400,
                        f"messages[{i}] has a '{excerpt(part.type)}' part; this server handles text "
                        "only.",
                        param=f"messages.{i}.content",
                    )
    tools = _offered_tools(req)
    # reasoning_content goes to the template as sent: Google's Gemma 4 template shows it again
    # within a tool-calling turn and drops it from earlier turns; gpurig's own ignores it
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = state.chat.render(messages, tools or None, enable_thinking=req.thinking())
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except RecursionError:  # tool-call arguments or a tool result parsed into a deep object
        raise ApiError(
            400,
            "The messages or tools are nested too deeply to render (tool-call arguments and "
            "tool results are parsed as JSON). Send flatter data.",
            param="messages",
        ) from None
    choice = req.tool_choice
    forced = CALL_OPEN if choice == "required" or isinstance(choice, NamedToolChoice) else ""
    # the template wrote <bos> itself: the tokenizer adds no special tokens of its own
    ids = state.encode(text + forced, add_special_tokens=False, param="messages")
    return ChatPrompt(ids, bool(tools), forced)


def _prepare(state: ServerState, body: bytes) -> tuple[ChatCompletionRequest, ChatPrompt]:
    req = parse_request(body, ChatCompletionRequest)
    state.check_model(req.model)
    chat_k(req)  # a bad logprobs request is refused before the template renders
    return req, chat_prompt(state, req)


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_body(request, state.limits.body_bytes)
    req, (prompt_ids, parse_calls, forced) = await state.off_loop(_prepare, state, body)
    asked = req.max_completion_tokens or req.max_tokens
    budget = token_budget(state, len(prompt_ids), asked, "messages")
    k, want_ids = chat_k(req), bool(req.return_token_ids)
    as_ids = bool(req.return_tokens_as_token_ids)
    stops = list(state.chat.stop_ids)  # skip_special_tokens False: the parser needs the markers
    job = await submit(state, generation_request(state, req, prompt_ids, budget.max_new, stops, k, False),
                 "messages")  # fmt: skip
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    capped = {"max_tokens_capped": budget.capped} if budget.capped is not None else {}
    if not req.stream:
        done = await run_to_end(request.receive, job)
        result = done.result
        reply = parse_reply(forced + result.text, parse_calls=parse_calls)
        calls = [ToolCallOut(**c.to_openai()) for c in reply.tool_calls] or None
        finish = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        choice = ChatChoice(
            message=AssistantMessage(
                content=reply.content,
                reasoning_content=reply.reasoning_content,
                tool_calls=calls,
            ),
            finish_reason=finish,
        )
        if k is not None:
            choice.logprobs = chat_logprobs(state.token_text, done.logprobs or [], k, as_ids)
        if want_ids:
            choice.token_ids = done.token_ids
        out = ChatCompletion(
            id=completion_id,
            created=created,
            model=state.model_name,
            choices=[choice],
            usage=Usage(**usage(done)),
            timings=Timings(**done.timings()),
            prompt_token_ids=prompt_ids if want_ids else None,
        )
        return JSONResponse({**out.model_dump(exclude_none=False), **capped},
                            headers=budget.headers())  # fmt: skip

    events = await first_event_or_error(request.receive, job)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None, event: Any = None,
              **extra: Any) -> dict[str, Any]:  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                  "logprobs": None}  # fmt: skip
        if k is not None and event is not None and event.logprobs:
            choice["logprobs"] = chat_logprobs(
                state.token_text, event.logprobs, k, as_ids
            ).model_dump()
        if "role" not in delta:  # as vLLM: token_ids on every chunk but the role's, null unless
            ids = (list(event.token_ids) if event is not None else []) if want_ids else None
            choice["token_ids"] = ids  # return_token_ids
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
            **extra,
        }

    async def payloads() -> AsyncIterator[dict[str, Any]]:
        parser = StreamingReplyParser(parse_calls=parse_calls)
        parser.feed(forced)  # opens the call; it emits nothing until the call is complete
        n_calls = 0
        # as vLLM: the prompt's ids on the first chunk, beside (not inside) its choice
        first = {"prompt_token_ids": prompt_ids if want_ids else None}
        yield chunk({"role": "assistant", "content": ""}, **first)

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
                found = deltas(parser.feed(event.text))
                if not found and (event.token_ids or event.logprobs):
                    found = [{}]  # the tokens' text is held (a call, a marker): still send them
                for i, d in enumerate(found):  # the event's tokens go with its first delta
                    yield chunk(d, event=event if i == 0 else None)
            elif event.kind == "error":
                yield error_payload(event.error)
                return
            else:
                for d in deltas(parser.finish()):
                    yield chunk(d)
                finish = event.result.finish_reason
                if n_calls and finish == "stop":
                    finish = "tool_calls"
                use, timings = usage(event), event.timings()
                yield chunk({}, finish, usage=use, timings=timings, **capped)
                if include_usage:
                    yield {**chunk({}), "choices": [], "usage": use, "timings": timings}
                return

    return SSEResponse(job, payloads(), budget.headers())
