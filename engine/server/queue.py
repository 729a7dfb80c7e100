"""One generation at a time, first come first served, off the event loop.

The engine is blocking torch code and not thread-safe, so a single worker thread owns it and
takes jobs from a FIFO queue; the asyncio side only enqueues and listens. Each job streams its
text back to the event loop as it is made (a thread-safe hand-off into an asyncio.Queue), so
streaming clients see tokens as they come and the loop keeps answering /health and /metrics
while a long generation runs.

Cancelling a job (a client that went away) is a flag the worker checks after every token: it then
closes the engine's stream iterator, which stops generation at once, and the engine is free for
the next job. A job cancelled while still waiting is skipped without touching the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.server.metrics import Metrics
from engine.server.textstream import IncrementalDecoder, StopMatcher

log = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    skip_special_tokens: bool = False
    logit_bias: dict[int, float] | None = None


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_ms: float
    decode_ms: float
    decode_tok_per_s: float
    queue_ms: float

    def timings(self) -> dict[str, float]:
        return {
            "prompt_ms": round(self.prompt_ms, 2),
            "decode_ms": round(self.decode_ms, 2),
            "decode_tok_per_s": round(self.decode_tok_per_s, 2),
            "queue_ms": round(self.queue_ms, 2),
        }


@dataclass
class Event:
    kind: str  # "delta" | "done" | "error"
    text: str = ""
    result: GenerationResult | None = None
    error: BaseException | None = None


class Job:
    """One request's generation: its parameters, a cancel flag, and its event stream."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.enqueued_at = time.perf_counter()
        self._cancel = threading.Event()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the worker to stop this job (safe from any thread, any number of times)."""
        self._cancel.set()

    def put(self, event: Event) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            self._cancel.set()

    async def events(self) -> AsyncIterator[Event]:
        """Events until "done" or "error" (inclusive)."""
        while True:
            event = await self._events.get()
            yield event
            if event.kind in ("done", "error"):
                self.finished = True
                return


class GenerationQueue:
    """The FIFO in front of the engine, and the one thread that runs it."""

    def __init__(self, engine: Any, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.current: Job | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpurig-generate", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        if self.current is not None:
            self.current.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)
        self._thread = None

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        self._jobs.put(job)
        self.metrics.set_queue(self.waiting, self.current is not None)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.current = job
            self.metrics.set_queue(self.waiting, True)
            try:
                self._execute(job)
            except BaseException as exc:  # never let one request kill the worker
                log.exception("generation failed")
                job.put(Event("error", error=exc))
            finally:
                self.current = None
                self.metrics.set_queue(self.waiting, False)

    def _execute(self, job: Job) -> None:
        req = job.request
        start = time.perf_counter()
        queue_ms = (start - job.enqueued_at) * 1000
        if job.cancelled:  # the client left while waiting: skip the engine entirely
            self.metrics.record_cancelled()
            job.put(Event("done", result=_result("", req, 0, "cancelled", 0, 0, 0, queue_ms)))
            return
        decoder = IncrementalDecoder(self.engine.tokenizer, req.skip_special_tokens)
        stops = StopMatcher(req.stop_strings)
        pieces: list[str] = []
        n = 0
        first_at: float | None = None
        finish: str | None = None
        stream = self.engine.stream(
            req.prompt_ids,
            req.max_new_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop_ids=req.stop_ids,
            logit_bias=req.logit_bias,
        )
        try:
            for token in stream:
                n += 1
                if first_at is None:
                    first_at = time.perf_counter()
                text = stops.push(decoder.push(int(token)))
                if text:
                    pieces.append(text)
                    job.put(Event("delta", text=text))
                if stops.hit is not None:
                    finish = "stop"
                    break
                if job.cancelled:
                    finish = "cancelled"
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # stops the engine now, whether we finished, broke off or failed
        end = time.perf_counter()
        if finish is None:
            finish = getattr(self.engine, "last_finish_reason", None) or "length"
            tail = stops.push(decoder.flush()) + stops.flush()
            if stops.hit is not None:
                finish = "stop"
            if tail:
                pieces.append(tail)
                job.put(Event("delta", text=tail))
        # tokens made after the first one, plus the end-of-turn token the model chose (computed,
        # though not returned)
        decode_tokens = max(n - 1, 0) + (1 if finish == "stop" and stops.hit is None else 0)
        if first_at is None:
            prompt_ms, decode_ms = (end - start) * 1000, 0.0
        else:
            prompt_ms, decode_ms = (first_at - start) * 1000, (end - first_at) * 1000
        tok_per_s = decode_tokens / (decode_ms / 1000) if decode_ms > 0 else 0.0
        result = _result("".join(pieces), req, n, finish, prompt_ms, decode_ms, tok_per_s, queue_ms)
        if finish == "cancelled":
            self.metrics.record_cancelled()
        self.metrics.record_generation(result)
        job.put(Event("done", result=result))


def _result(
    text: str,
    req: GenerationRequest,
    n: int,
    finish: str,
    prompt_ms: float,
    decode_ms: float,
    tok_per_s: float,
    queue_ms: float,
) -> GenerationResult:
    return GenerationResult(
        text=text,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=n,
        finish_reason=finish,
        prompt_ms=prompt_ms,
        decode_ms=decode_ms,
        decode_tok_per_s=tok_per_s,
        queue_ms=queue_ms,
    )
