"""`Generation`: one request's tokens as an iterator, what `Engine.stream` returns.

It pulls: when the consumer wants a token none has arrived for, it steps the engine (every open
request advances in that step, this one's tokens are handed to it through its sink), so the
CLI, the benchmarks and tests need no thread; the OpenAI server's loop thread steps the same
engine for its own requests. It also knows how it ended and how long each phase took, so every
consumer reads the same numbers from the same place:

    gen = eng.stream(ids, SamplingParams(max_tokens=64))
    for tok in gen: ...
    gen.finish_reason      # "stop" (a stop id) | "length" (max tokens / context) | None
    gen.completion_tokens, gen.prompt_tokens, gen.timings.decode_tokens_per_s
    gen.logprobs           # with logprobs=k: gen.logprobs[i] is tokens[i]'s
                           # engine.logprobs.TokenLogprobs; None when not asked for

`finish_reason` is None while it runs, and stays None when it was closed before its end (the
consumer broke off: a stop string, a client that left). Closing cancels the request: it leaves
the batch at the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.logprobs import TokenLogprobs
    from engine.sequence import Output, Sequence


class Stepper(Protocol):
    def step(self) -> bool: ...


@dataclass(frozen=True)
class Timings:
    """Where one generation's time went, in seconds.

    time_to_first_token: from the request's arrival to its first new token (or to the end when
    none came); prompt_seconds: from its admission (when its prompt starts being read) to the
    first token; decode_seconds: from the first token to the end; decode_tokens: the tokens
    decode steps made in that time (those after the first, plus the stop id that ended it:
    computed like any other, only not returned)."""

    time_to_first_token: float
    prompt_seconds: float
    decode_seconds: float
    decode_tokens: int

    @property
    def decode_tokens_per_s(self) -> float | None:
        """None when no decode step ran (fewer than two tokens made)."""
        if self.decode_tokens <= 0 or self.decode_seconds <= 0:
            return None
        return self.decode_tokens / self.decode_seconds

    @classmethod
    def of(cls, seq: Sequence, completion_tokens: int) -> Timings:
        """A sequence's timings so far (final once it ended)."""
        now = seq.ended_at if seq.ended_at is not None else time.perf_counter()
        started = seq.started_at if seq.started_at is not None else now
        first = seq.first_token_at if seq.first_token_at is not None else now
        made = max(completion_tokens - 1, 0) + (1 if seq.finish_reason == "stop" else 0)
        return cls(
            time_to_first_token=first - seq.arrived,
            prompt_seconds=first - min(started, first),
            decode_seconds=now - first if seq.first_token_at is not None else 0.0,
            decode_tokens=made if seq.first_token_at is not None else 0,
        )


class Generation:
    """New token ids as they are made, with the finish reason, counts and timings."""

    def __init__(self, engine: Stepper, seq: Sequence) -> None:
        """seq: the engine's sequence for this request, whose sink this becomes."""
        self._engine = engine
        self._seq = seq
        self._inbox: deque[Output] = deque()
        self._ready: deque[int] = deque()
        seq.sink = lambda _seq, out: self._inbox.append(out)  # on the stepping thread
        self.prompt_tokens = len(seq.prompt)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if seq.params.logprobs is not None else None
        self._ended = False

    @property
    def completion_tokens(self) -> int:
        """New tokens yielded so far (the stop id that ended it is not one)."""
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self._ended

    @property
    def finish_reason(self) -> str | None:
        """Once it ran to its end "stop" or "length"; None while running or when closed early."""
        return self._seq.finish_reason if self._ended and not self._seq.cancelled else None

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> int:
        while not self._ready:
            if self._ended:
                raise StopIteration
            if self._inbox:
                self._take(self._inbox.popleft())
                continue
            try:
                self._engine.step()
            except BaseException:
                self.close()
                raise
        token = self._ready.popleft()
        self.tokens.append(token)
        return token

    def _take(self, out: Output) -> None:
        self._ready.extend(out.tokens)
        if self.logprobs is not None and out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.error is not None:
            self._ended = True
            self._ready.clear()
            raise out.error
        if out.finished:
            self._ended = True
            self._seq.ended_at = self._seq.ended_at or time.perf_counter()

    def close(self) -> None:
        """Stop generating now (safe to call any number of times). A generation closed before
        its end keeps finish_reason None."""
        if not self._seq.finished:
            self._seq.cancel()
        if not self._ended:
            self._ended = True
            self._seq.ended_at = time.perf_counter()
        self._ready.clear()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def timings(self) -> Timings:
        """The timings so far (final once `done`)."""
        return Timings.of(self._seq, self.completion_tokens)
