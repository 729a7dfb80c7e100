"""The server's first requests, answered in-process before the port opens.

Why: the engine's warm-up compiles every kernel and reads every kind of prompt, yet the very
first HTTP request of a server still waited about 30 ms longer than later ones of its length
(lab/journal.md, v14: 1.7-2.4x its warm time to first token), with no compile left to blame:
the HTTP path's own first use (the middleware stack built, the request parsed and validated,
the tokenizer and detokenizer's first calls, the stream's first chunk, the generation thread's
first wake). Here the app serves a streamed completion and a chat completion to itself as
plain ASGI calls from inside its lifespan, which uvicorn finishes before it binds the port, so
no client meets those costs. The counters are reset after, so /metrics and the engine's stats
start from zero as if nothing had run.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from engine.server.state import ServerState

WARM_UP_TOKENS = 2  # tokens each request asks for: enough for a decode step and a stream chunk
IDLE_POLLS = 1000  # 5 ms apart: how long the engine may take to go idle after them


async def answer_first_requests(app: ASGIApp, state: ServerState) -> str:
    """Drive the app through its generation endpoints once; the line that says how it went.
    A refusal (a max_tokens limit or a context too small for the prompt, say) is reported
    there, not raised: the server still starts, only its first client pays the first use."""
    t0 = time.perf_counter()
    tokens = min(WARM_UP_TOKENS, state.limits.max_tokens or WARM_UP_TOKENS)
    headers = [(b"content-type", b"application/json")]
    if state.options.api_key:
        headers.append((b"authorization", f"Bearer {state.options.api_key}".encode()))
    prompt = [int(i) for i in state.encode("Hello", True, "prompt")] or [0]
    bodies = [("/v1/completions", {"model": state.model_name, "prompt": prompt,
                                   "max_tokens": tokens, "stream": True})]  # fmt: skip
    bodies.append(("/v1/chat/completions", {
        "model": state.model_name, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Hello"}]}))  # fmt: skip
    refused = []
    for path, body in bodies:
        try:
            status = await _post(app, path, json.dumps(body).encode(), headers)
        except Exception as exc:  # an error the app re-raised: the server still starts
            refused.append(f"{path} raised {type(exc).__name__}: {exc}")
            continue
        if status != 200:
            refused.append(f"{path} answered {status}")
    engine = state.engine
    for _ in range(IDLE_POLLS):  # the engine's thread may still be finishing the last step
        if not engine.has_work:
            break
        await asyncio.sleep(0.005)
    if not engine.reset_stats():
        refused.append("the engine stayed busy, so its step counters include them")
    state.metrics.reset()
    ms = (time.perf_counter() - t0) * 1000
    if refused:
        return f"in-process first requests in {ms:.0f} ms, not all answered: {'; '.join(refused)}"
    return f"answered its first requests in-process in {ms:.0f} ms"


async def _post(app: ASGIApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """One POST through the ASGI app (no socket); its status, once the whole body was sent."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }  # fmt: skip
    sent = False
    status = 0
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # a streaming response listens for a disconnect while it streams
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    await app(scope, receive, send)
    return status
