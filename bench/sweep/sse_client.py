"""A lean HTTP/1.1 client for one streaming POST: asyncio streams, chunked decoding, SSE lines.

Why not httpx here: the driver's own CPU per streamed chunk must stay far below the server's
time per token (lab/sweep_cost.py measures it). httpx's async stack (anyio, httpcore, h11)
spent about 1 ms of CPU per chunk on the 2-core CI host; one read wake-up plus a few bytes
operations per chunk costs a fraction of that. Plain http:// only (the sweep talks to servers on
its own network); the driver falls back to httpx for https.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(Exception):
    """A non-200 answer: its status and body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class StreamClosed(Exception):
    """The server closed the connection before the stream's end."""


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _body_chunks(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """The body as it arrives (chunked transfer decoded)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def stream_events(url: str, payload: dict) -> AsyncIterator[tuple[bytes, float]]:
    """POST `payload` as JSON to `url` and yield each SSE `data:` value with the perf_counter time
    at which its bytes arrived; ends at `[DONE]`. Raises HttpError, StreamClosed, OSError."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    body = json.dumps(payload).encode()
    request = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        writer.write(request)
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200:
            raw = b"".join([c async for c in _body_chunks(reader, headers)])
            raise HttpError(status, raw)
        pending = b""
        async for chunk in _body_chunks(reader, headers):
            now = time.perf_counter()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield data, now
        raise StreamClosed("the stream ended without [DONE]")
    except asyncio.IncompleteReadError as exc:
        raise StreamClosed(f"the server closed the connection mid-stream ({exc})") from None
    finally:
        writer.close()
