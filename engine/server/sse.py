"""Waiting on a job: to its end (a JSON reply) or as server-sent events (a stream).

Both watch the client: one that goes away cancels its job at once, also while the job still
waits in line, so the engine never works for nobody. A stream whose first event is already an
error fails as a plain HTTP error (a proper status), not as a 200 with an error inside; one that
fails later (or hits a bug while writing) sends an error event and ends cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.server.errors import ApiError, engine_error_to_api, server_error
from engine.server.queue import Event, Job

log = logging.getLogger(__name__)
DRAIN_S = 10.0  # the longest a stream that ended early waits for its job's last event


async def watch_disconnect(receive: Callable[[], Awaitable[dict]], job: Job) -> None:
    """Cancel the job as soon as the client goes away (also while it still waits in line)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def run_to_end(receive: Callable[[], Awaitable[dict]], job: Job) -> Event:
    """The job's "done" event (its result and queue time), or its error as an ApiError."""
    watcher = asyncio.create_task(watch_disconnect(receive, job))
    try:
        async for event in job.events():
            if event.kind == "error":
                raise engine_error_to_api(event.error)
            if event.kind == "done":
                return event
        raise ApiError(500, "generation ended without a result", type_="server_error")
    finally:
        watcher.cancel()
        job.cancel()  # no-op when finished; stops the engine if we are unwinding early


async def first_event_or_error(
    receive: Callable[[], Awaitable[dict]], job: Job
) -> AsyncIterator[Any]:
    """Start the job's events and fail as HTTP (not mid-stream) if the very first is an error,
    so a stream request that cannot run still gets a proper status code."""
    events = job.events()
    watcher = asyncio.create_task(watch_disconnect(receive, job))
    try:
        first = await anext(events)
    finally:
        watcher.cancel()
    if first.kind == "error":
        raise engine_error_to_api(first.error)

    async def chained() -> AsyncIterator[Any]:
        yield first
        async for event in events:
            yield event

    return chained()


def error_payload(exc: BaseException | None) -> dict[str, Any]:
    """An error in OpenAI's shape, as a stream event."""
    return engine_error_to_api(exc).body.model_dump()


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class SSEResponse:
    """Server-sent events from an async iterator of `data:` payloads, ending with [DONE].
    Watches for the client leaving and cancels the job then, not only at the next write."""

    def __init__(
        self,
        job: Job,
        payloads: AsyncIterator[dict[str, Any]],
        headers: dict[str, str] | None = None,
    ) -> None:
        # no Content-Length: the body is open-ended
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]
        self.job = job
        self.payloads = payloads

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        watcher = asyncio.create_task(watch_disconnect(receive, self.job))
        try:
            try:
                async for payload in self.payloads:
                    if self.job.cancelled:
                        break
                    await send({"type": "http.response.body", "body": _event(payload),
                                "more_body": True})  # fmt: skip
            except OSError:  # the client went away between two writes
                self.job.cancel()
            except Exception as exc:  # a bug while streaming: say so, end the stream cleanly
                log.exception("error while streaming a reply", exc_info=exc)
                payload = server_error(exc).body.model_dump()
                await send({"type": "http.response.body", "body": _event(payload),
                            "more_body": True})  # fmt: skip
            if not self.job.cancelled:
                await send(
                    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                )
        except OSError:
            self.job.cancel()
        finally:
            watcher.cancel()
            self.job.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain(), DRAIN_S)
            with contextlib.suppress(Exception):
                await self.payloads.aclose()

    async def _drain(self) -> None:
        """Read the job's events to its end without sending them: the engine ends a cancelled
        job at its next step, and that last event is what counts the generation in the metrics
        (cancelled, tokens made). A stream that stopped at a buffered token would skip it."""
        async for _ in self.payloads:
            pass
