"""The engine as the OpenAI server (engine/server) sees it: `ServedEngine`, and the facts it reads.

Why a Protocol: the server serves an engine in its own process (engine/runtime.py's `Engine`,
stepped by a thread: engine/process/local.py) or in a process of its own (engine/process/
client.py's `EngineClient`, which stands in for it across a pipe). Both implement this one
surface, typed, so the server needs no probing of what it was given, and a member added on one
side and not the other fails tests/test_engine_interface.py, not a request.

The facts are one frozen dataclass (`EngineFacts`): the in-process engine builds it at load,
the engine process sends it to its client once, as it is (it pickles). Light on purpose: no
torch, no web framework; the types below are only named for the type checker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engine.errors import EngineError
    from engine.sampling import SamplingParams
    from engine.scheduler import SchedulerStats
    from engine.sequence import Output


@dataclass(frozen=True)
class EngineFacts:
    """What a loaded engine is, as plain values: the checkpoint, the context it was loaded
    with, the vocabulary and special ids its requests are checked against, its chat template
    (None: the checkpoint has none, gpurig's bundled one is used) and its device's name."""

    model_dir: Path
    model_name: str
    max_context: int
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None
    device: str


class RequestHandle(Protocol):
    """One queued request as the server reads it (engine/sequence.py's `Sequence` in process,
    engine/process/client.py's `RemoteSequence` across the pipe): its prompt, its times on the
    system's monotonic clock (perf_counter) and why it ended; `cancel` stops it at the engine's
    next step. The server sets `ended_at` if the engine has not when it reports the request."""

    prompt: list[int]
    arrived: float
    started_at: float | None
    first_token_at: float | None
    ended_at: float | None
    finish_reason: str | None

    def cancel(self) -> None: ...


# the engine hands a request's outputs here, on the thread that steps it (or reads its pipe)
Sink = Callable[[RequestHandle, "Output"], None]


@runtime_checkable
class ServedEngine(Protocol):
    """What engine/server uses of an engine, and nothing else.

    `start`/`wake`/`stop` drive it: the in-process engine starts a thread that steps it while
    it has work, the engine process steps itself (start and wake do nothing there). `stop`
    ends every open request with an error and closes the engine. `ended` says why an engine
    is gone (an engine process that died), None while it serves: /health answers 503 then."""

    @property
    def facts(self) -> EngineFacts: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def ended(self) -> EngineError | None: ...

    def stats(self) -> SchedulerStats: ...

    def reset_stats(self) -> bool: ...

    async def add_request_async(
        self, token_ids: list[int], params: SamplingParams, sink: Sink | None = None
    ) -> RequestHandle: ...

    def start(self) -> None: ...

    def wake(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...
