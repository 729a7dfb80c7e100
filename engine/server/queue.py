"""Requests into the engine and their text back to the event loop.

One waiting line, the scheduler's (engine/scheduler.py): `submit` hands a request straight to
the engine (engine/interface.py's `ServedEngine`), which steps itself while it has work: on a
thread of its own in this process (engine/process/local.py), or in a process of its own
(engine/process/client.py, the default on a GPU), whose pipe's reader then stands in for that
thread. The engine hands each request's new tokens to its sink on that thread, which puts them
on the request's asyncio queue; the handler's side turns them into text there
(engine/detokenize.py: the incremental detokeniser and the stop strings), so no thread relays
anything and the loop keeps answering /health and /metrics while generations run. Cancelling a
request (a client that left, a stop string) is one flag on its sequence, read by the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.detokenize import TextAssembler
from engine.generation import Timings
from engine.sampling import SamplingParams
from engine.sequence import Output
from engine.server.metrics import Metrics
from engine.textgen import GenerationResult

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engine.interface import RequestHandle, ServedEngine


@dataclass
class GenerationRequest:
    """A request as the engine takes it (`params`), with what the text side does to its
    tokens: stop strings, special tokens skipped, token ids sent along."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_strings: list[str] = field(default_factory=list)
    skip_special_tokens: bool = False
    token_ids: bool = False  # the events carry the new token ids (`return_token_ids`)

    @property
    def tracks_tokens(self) -> bool:
        """The events carry token ids and log-probabilities, not only text."""
        return self.params.logprobs is not None or self.token_ids


@dataclass
class Event:
    kind: str  # "delta" | "done" | "error"
    text: str = ""
    result: GenerationResult | None = None
    queue_ms: float = 0.0  # with "done": how long the request waited for a place in the batch
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
    """One request in the engine: its sequence (the cancel flag) and its events."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer, metrics: Metrics,
                 loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:  # fmt: skip
        self.request = request
        self.metrics = metrics
        self.loop = loop
        self.seq: RequestHandle | None = None
        self.finished = False
        self._outputs: asyncio.Queue[Output] = asyncio.Queue()
        self._text = TextAssembler(tokenizer, request.stop_strings, request.skip_special_tokens)
        self._wake = wake
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop this request at the engine's next step (safe any number of times)."""
        self._cancelled = True
        if self.seq is not None:
            self.seq.cancel()
            self._wake()

    def sink(self, _seq: RequestHandle, out: Output) -> None:
        """The engine's hand-off (on its thread): onto the event loop, as it is."""
        try:
            self.loop.call_soon_threadsafe(self._outputs.put_nowait, out)
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            self.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """Events until "done" or "error" (inclusive)."""
        track, tokens = self.request.tracks_tokens, []
        logprobs: list[Any] | None = [] if self.request.params.logprobs is not None else None
        while True:
            out = await self._outputs.get()
            if out.error is not None:
                self.finished = True
                yield Event("error", error=out.error)
                return
            text = self._text.push_all(out.tokens) if not self._text.stopped else ""
            tokens += out.tokens
            if logprobs is not None and out.logprobs:
                logprobs += out.logprobs
            if self._text.stopped and not out.finished and self.seq is not None:
                self.seq.cancel()  # a stop string: the engine need not make more
                self._wake()
            end = out.finished or self._text.stopped
            if end:
                text += self._text.flush()
            if track and (text or out.tokens):
                yield Event("delta", text=text, token_ids=list(out.tokens),
                            logprobs=list(out.logprobs or []) if logprobs is not None else None)  # fmt: skip
            elif text:
                yield Event("delta", text=text)
            if end:
                self.finished = True
                yield self._done(out, tokens, logprobs)
                return

    def _done(self, out: Output, tokens: list[int], logprobs: list[Any] | None) -> Event:
        seq = self.seq
        assert seq is not None
        if self._text.stopped:
            reason = "stop"
        elif self._cancelled or out.finish_reason is None:
            reason = "cancelled"
        else:
            reason = out.finish_reason
        seq.ended_at = seq.ended_at or time.perf_counter()
        result = GenerationResult.of_run(
            self._text.text, reason, len(seq.prompt), len(tokens), Timings.of(seq, len(tokens))
        )
        started = seq.started_at if seq.started_at is not None else seq.ended_at
        queue_ms = (started - seq.arrived) * 1000
        if reason == "cancelled":
            self.metrics.record_cancelled()
        self.metrics.record_generation(result, queue_ms)
        done = Event("done", result=result, queue_ms=queue_ms)
        if self.request.tracks_tokens:
            done.token_ids, done.logprobs = tokens, logprobs
        return done


class GenerationQueue:
    """Requests into the engine (its one waiting line), which steps itself while it has work."""

    def __init__(self, engine: ServedEngine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics

    def start(self) -> None:
        self.engine.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine: open requests end with its shutdown error."""
        self.engine.stop(timeout)

    async def submit(self, request: GenerationRequest) -> Job:
        """Queue a request in the engine (its arguments checked there, raising before the
        request is queued; an engine process answers between two of its steps)."""
        loop = asyncio.get_running_loop()
        job = Job(request, self.engine.tokenizer, self.metrics, loop, self.engine.wake)
        job.seq = await self.engine.add_request_async(request.prompt_ids, request.params, job.sink)
        return job
