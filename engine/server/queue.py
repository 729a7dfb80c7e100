"""Generations off the event loop, first come first served.

The engine is blocking torch code, so worker threads drive it and take jobs from a FIFO queue;
the asyncio side only enqueues and listens. With a batching engine (`engine.load(max_num_seqs=N)`,
what `gpurig engine serve` loads) there are N workers, each a client of the engine's scheduler
(engine/scheduler.py), which puts every open generation in the same decode steps; a job beyond N
waits here in arrival order. A single-sequence engine (not thread-safe) gets one worker: one
generation at a time. Each job streams its text back to the event loop as it is made (a
thread-safe hand-off into an asyncio.Queue), so streaming clients see tokens as they come and the
loop keeps answering /health and /metrics while generations run.

Cancelling a job (a client that went away) is a flag the worker checks after every token: it then
closes the engine's stream, which frees its place in the batch at the next step. A job cancelled
while still waiting is skipped without touching the engine.
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

from engine.detokenize import TextStream
from engine.server.metrics import Metrics
from engine.textgen import GenerationResult

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
    logprobs: int | None = None  # k: each token's log-probability and the top k
    token_ids: bool = False  # the events carry the new token ids (`return_token_ids`)

    @property
    def tracks_tokens(self) -> bool:
        """The events carry token ids and log-probabilities, not only text."""
        return self.logprobs is not None or self.token_ids


@dataclass
class Event:
    kind: str  # "delta" | "done" | "error"
    text: str = ""
    result: GenerationResult | None = None
    queue_ms: float = 0.0  # with "done": how long the job waited for the engine
    error: BaseException | None = None
    # for a request that tracks tokens: a delta's new token ids and their log-probabilities
    # (engine.logprobs.TokenLogprobs), or with "done" all of them
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None

    def timings(self) -> dict[str, float]:
        """The reply's `timings` (a "done" event's): where the request's time went."""
        return timings(self.result, self.queue_ms) if self.result is not None else {}


def timings(result: GenerationResult, queue_ms: float) -> dict[str, float]:
    """prompt_ms: reading the prompt up to the first new token; decode_ms: the first new token
    to the last; decode_tok_per_s: tokens decode steps made per second; queue_ms: waiting."""
    return {
        "prompt_ms": round(result.prefill_seconds * 1000, 2),
        "decode_ms": round(result.decode_seconds * 1000, 2),
        "decode_tok_per_s": round(result.decode_tokens_per_s or 0.0, 2),
        "queue_ms": round(queue_ms, 2),
    }


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


def worker_count(engine: Any) -> int:
    """One worker per sequence the engine batches; one for an engine without a scheduler."""
    scheduler = getattr(engine, "scheduler", None)
    return int(scheduler.max_num_seqs) if scheduler is not None else 1


class GenerationQueue:
    """The FIFO in front of the engine, and the worker threads that run it."""

    def __init__(self, engine: Any, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.workers = worker_count(engine)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.active: set[Job] = set()

    def start(self) -> None:
        if self._threads:
            return
        for i in range(self.workers):
            thread = threading.Thread(target=self._run, name=f"gpurig-generate-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        if not self._threads:
            return
        with self._lock:
            for job in self.active:
                job.cancel()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def running(self) -> int:
        return len(self.active)

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        self._jobs.put(job)
        self._report()
        return job

    def _report(self) -> None:
        self.metrics.set_queue(self.waiting, bool(self.active), len(self.active))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self.active.add(job)
            self._report()
            try:
                self._execute(job)
            except BaseException as exc:  # never let one request kill the worker
                log.exception("generation failed")
                job.put(Event("error", error=exc))
            finally:
                with self._lock:
                    self.active.discard(job)
                self._report()

    def _execute(self, job: Job) -> None:
        req = job.request
        queue_ms = (time.perf_counter() - job.enqueued_at) * 1000
        if job.cancelled:  # the client left while waiting: skip the engine entirely
            self.metrics.record_cancelled()
            job.put(Event("done", result=_skipped(req), queue_ms=queue_ms))
            return
        generation = self.engine.stream(
            req.prompt_ids,
            req.max_new_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop_ids=req.stop_ids,
            logit_bias=req.logit_bias,
            **({"logprobs": req.logprobs} if req.logprobs is not None else {}),
        )
        stream = TextStream(
            generation, self.engine.tokenizer, req.stop_strings, req.skip_special_tokens
        )
        cancelled = False
        track, sent = req.tracks_tokens, 0
        try:
            for text in stream:
                if track:  # every token reaches the client, also one whose text is still held
                    n = len(generation.tokens)
                    if text or n > sent:
                        job.put(Event("delta", text=text, token_ids=generation.tokens[sent:n],
                                      logprobs=_logprobs(generation, sent, n)))  # fmt: skip
                        sent = n
                elif text:
                    job.put(Event("delta", text=text))
                if job.cancelled:
                    cancelled = True
                    break
        finally:
            stream.close()  # stops the engine now, whether we finished, broke off or failed
        result = GenerationResult.of(stream, "cancelled" if cancelled else None)
        if cancelled:
            self.metrics.record_cancelled()
        self.metrics.record_generation(result, queue_ms)
        done = Event("done", result=result, queue_ms=queue_ms)
        if track:
            n = len(generation.tokens)
            done.token_ids, done.logprobs = list(generation.tokens), _logprobs(generation, 0, n)
        job.put(done)


def _logprobs(generation: Any, start: int, end: int) -> list[Any] | None:
    """The log-probabilities of tokens[start:end] (None when the request did not ask)."""
    entries = getattr(generation, "logprobs", None)
    return None if entries is None else list(entries[start:end])


def _skipped(req: GenerationRequest) -> GenerationResult:
    """The result of a job cancelled before it reached the engine."""
    return GenerationResult(
        text="",
        finish_reason="cancelled",
        prompt_tokens=len(req.prompt_ids),
        new_tokens=0,
        time_to_first_token_seconds=0.0,
        prefill_seconds=0.0,
        prefill_tokens_per_s=0.0,
        decode_seconds=0.0,
        decode_tokens=0,
        decode_tokens_per_s=None,
    )
