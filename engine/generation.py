"""`Generation`: one running generation, what `Engine.stream` returns.

An iterator of new token ids that also knows how it ended and how long each phase took, so
every consumer (engine/textgen.py for the CLI, engine/server/queue.py for the OpenAI server,
benchmarks) reads the same numbers from the same place instead of timing the loop itself:

    gen = eng.stream(ids, 64)
    for tok in gen: ...
    gen.finish_reason      # "stop" (a stop id) | "length" (max tokens / context) | None
    gen.completion_tokens, gen.prompt_tokens, gen.timings.decode_tokens_per_s
    gen.logprobs           # with stream(..., logprobs=k): gen.logprobs[i] is tokens[i]'s
                           # engine.logprobs.TokenLogprobs; None when not asked for

`finish_reason` is None while it runs, and stays None when it was closed before its end (the
consumer broke off: a stop string, a client that left). Closing stops the engine at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.logprobs import TokenLogprobs


class _State(Protocol):
    """How the decode loop reports its end (engine.generate.GenerationState)."""

    finish_reason: str | None


@dataclass(frozen=True)
class Timings:
    """Where one generation's time went, in seconds.

    time_to_first_token: from the `stream()` call to the first new token (or to the end when
    none came); prompt_seconds: from the first request for a token (when the prompt is read)
    to the first token; decode_seconds: from the first token to the end; decode_tokens: the
    tokens decode steps made in that time (those after the first, plus the stop id that ended
    it: computed like any other, only not returned)."""

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


class Generation:
    """New token ids as they are made, with the finish reason, counts and timings."""

    def __init__(
        self,
        steps: Iterator[int],
        state: _State,
        prompt_tokens: int,
        sync: Callable[[], None] | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """steps: the decode loop's ids; state: where it writes its finish reason; sync: waits
        for the device's queued work (so the end time covers it); logprobs: the list the loop
        appends each token's log-probabilities to before it yields the token (None: not asked)."""
        self._steps = steps
        self.logprobs = logprobs
        self._state = state
        self._sync = sync
        self.prompt_tokens = prompt_tokens
        self.tokens: list[int] = []
        self._created = time.perf_counter()
        self._started: float | None = None
        self._first: float | None = None
        self._ended: float | None = None

    @property
    def completion_tokens(self) -> int:
        """New tokens yielded so far (the stop id that ended it is not one)."""
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self._ended is not None

    @property
    def finish_reason(self) -> str | None:
        """Once it ran to its end "stop" or "length"; None while running or when closed early."""
        return self._state.finish_reason if self.done else None

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> int:
        if self._ended is not None:
            raise StopIteration
        if self._started is None:
            self._started = time.perf_counter()
        try:
            token = next(self._steps)
        except StopIteration:
            self._finish()
            raise
        except BaseException:
            self._finish(failed=True)
            raise
        if self._first is None:
            self._first = time.perf_counter()
        self.tokens.append(token)
        return token

    def close(self) -> None:
        """Stop generating now (safe to call any number of times). A generation closed before
        its end keeps finish_reason None."""
        if self._ended is None:
            self._finish()

    def _finish(self, failed: bool = False) -> None:
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()
        if self._sync is not None and not failed:
            self._sync()
        self._ended = time.perf_counter()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def timings(self) -> Timings:
        """The timings so far (final once `done`)."""
        now = self._ended if self._ended is not None else time.perf_counter()
        started = self._started if self._started is not None else now
        first = self._first if self._first is not None else now
        made = max(self.completion_tokens - 1, 0) + (1 if self.finish_reason == "stop" else 0)
        return Timings(
            time_to_first_token=first - self._created,
            prompt_seconds=first - started,
            decode_seconds=now - first if self._first is not None else 0.0,
            decode_tokens=made if self._first is not None else 0,
        )
