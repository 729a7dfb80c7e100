"""`Sequence`: one request inside the engine, from arrival to its last token.

Plain Python, no tensors: the scheduler's policy (engine/scheduler.py) reads and moves these,
the runner (engine/runner.py) keeps whatever device state a sequence needs under its id, and a
consumer receives its output through `sink` (a `Generation` pulling from the engine, or the
OpenAI server's asyncio queue), called on the thread that steps the engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.logprobs import TokenLogprobs

_ids = itertools.count()


@dataclass
class Output:
    """What a sequence hands its consumer after a step: new tokens (with their
    log-probabilities when asked), and once it ended, why ("stop" | "length" | None when
    cancelled) or the error that ended it."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None


Sink = Callable[["Sequence", Output], None]


@dataclass(eq=False)
class Sequence:
    """A request's prompt, what it asked for, and where it stands."""

    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    chunk: int  # the most prompt tokens one pass reads of it (engine.memory.plan_prompt)
    score_budget: int | None  # its prompt's attention score budget (None: ops' default)
    sink: Sink | None = None
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.perf_counter)
    slot: int = -1  # its KV pool slot while running
    need_blocks: int = 0  # blocks it may come to hold (promised at admission)
    read: int = 0  # prompt tokens in the cache (all but the last, which its first step feeds)
    fed: int = 0  # decode steps launched for it
    made: int = 0  # tokens delivered
    cancelled: bool = False  # the consumer left: one flag, read by the scheduler's next step
    finished: bool = False
    finish_reason: str | None = None
    started_at: float | None = None  # admitted: its prompt starts being read
    first_token_at: float | None = None
    ended_at: float | None = None

    @property
    def body(self) -> int:
        """Prompt tokens read by prompt passes: all but the last, which the first step feeds."""
        return len(self.prompt) - 1

    @property
    def prompt_read(self) -> bool:
        return self.read >= self.body

    @property
    def position(self) -> int:
        """The position the next decode step feeds."""
        return self.body + self.fed

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def cancel(self) -> None:
        """Stop it at the next step (safe from any thread, any number of times)."""
        self.cancelled = True
