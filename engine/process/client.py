"""The server's end of the engine process (engine/process/core.py): engine/interface.py's
`ServedEngine`, which the server's queue and handlers use as they use an in-process engine.

It starts the process (`start_core`), or takes one the server started early, waits for it to
load, and keeps the facts it reported. Requests go in with `add_request_async`, which returns
once the engine accepted them (or raises its refusal: a prompt over the context, a bad
parameter), so the handlers answer 400 as they do in process. One thread here reads the pipe
and hands each step's outputs to the requests' sinks, as the engine's own thread does in
process. If the engine process dies, every open request ends with an error that says so, and
new ones are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError, GpurigError
from engine.interface import EngineFacts, Sink
from engine.process.core import CoreSpec, Loaded, StartedCore, start_core
from engine.runtime import load_tokenizer
from engine.sequence import Output

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engine.sampling import SamplingParams
    from engine.scheduler import SchedulerStats

READY_POLL_S = 0.5
REPLY_TIMEOUT_S = 30.0


class RemoteSequence:
    """A request in the engine process as the server reads it: its prompt, parameters and times
    (perf_counter is the system's monotonic clock, so the engine's times compare with ours)."""

    def __init__(self, client: EngineClient, rid: int, prompt: list[int],
                 params: SamplingParams, sink: Sink | None) -> None:  # fmt: skip
        self._client = client
        self.id = rid
        self.prompt = prompt
        self.params = params
        self.sink = sink
        self.arrived = time.perf_counter()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self.finished = False

    def cancel(self) -> None:
        """Stop it at the engine's next step (safe any number of times)."""
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self._client.post(("cancel", self.id))


class EngineClient:
    """The engine in its own process, as a `ServedEngine` (engine/interface.py): it steps
    itself, so `start` and `wake` have nothing to do."""

    def __init__(self, spec: CoreSpec, ready_timeout: float | None = None,
                 started: StartedCore | None = None) -> None:  # fmt: skip
        """Start the engine process (or take `started`, one `start_core(spec)` began) and wait
        until it has loaded (and warmed up): raises its load error (a GpurigError for a bad
        checkpoint) if it could not."""
        started = started or start_core(spec)
        self.process, self._conn = started.process, started.conn
        self._send_lock = threading.Lock()
        self._open: dict[int, RemoteSequence] = {}
        self._acks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._ids = itertools.count(1)
        self._reset: tuple[threading.Event, list[Any]] | None = None
        self._ended: EngineError | None = None
        self._closed = False
        ready = self._wait_ready(ready_timeout)
        self._facts: EngineFacts = ready.facts
        self.kv_cache_line: str = ready.kv_cache_line
        self.warm_up_line: str | None = ready.warm_up_line
        self._stats: SchedulerStats = ready.stats
        self._tokenizer = load_tokenizer(ready.facts.model_dir)
        self._reader = threading.Thread(target=self._receive, name="gpurig-engine-pipe",
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def _wait_ready(self, timeout: float | None) -> Loaded:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(READY_POLL_S):
            if not self.process.is_alive():
                raise EngineError(
                    f"the engine process exited while loading{_how(self.process.exitcode)}",
                    "see the lines above for why; check the checkpoint and the GPU",
                )
            if deadline is not None and time.monotonic() > deadline:
                self._stop_process(1.0)
                raise EngineError(f"the engine did not load within {timeout:.0f} s",
                                  "see the lines above; raise the timeout or check the GPU")  # fmt: skip
        msg = self._conn.recv()
        if msg[0] == "failed":
            self._stop_process(10.0)
            _, exc, trace = msg
            if isinstance(exc, GpurigError):  # a bad checkpoint, no memory: says what to do
                raise exc
            raise EngineError(f"the engine failed to load: {type(exc).__name__}: {exc}\n{trace}",
                              "the traceback says where; --engine-process off loads it in the "
                              "server's process instead")  # fmt: skip
        return msg[1]

    # ---- what the server calls (engine/interface.py's ServedEngine) -------------------------
    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer, loaded in this process (the server tokenises here)."""
        return self._tokenizer

    @property
    def ended(self) -> EngineError | None:
        """Why the engine process is gone (None while it runs); /health answers 503 then."""
        return self._ended

    @property
    def has_work(self) -> bool:
        return bool(self._open)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters as the engine last sent them (each 50 ms while busy, and
        when it goes idle)."""
        return self._stats

    def send(self, msg: tuple[Any, ...]) -> None:
        if self._ended is not None:
            raise self._ended
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):
            raise self._gone() from None

    async def add_request_async(self, token_ids: list[int], params: SamplingParams,
                                sink: Sink | None = None) -> RemoteSequence:  # fmt: skip
        """Queue a request in the engine: its sequence once accepted, or the engine's refusal
        raised (as the in-process `add_request` raises it)."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[Any] = loop.create_future()
        rid = next(self._ids)
        seq = RemoteSequence(self, rid, [int(t) for t in token_ids], params, sink)
        self._acks[rid] = (loop, accepted)
        self._open[rid] = seq
        try:
            self.send(("add", rid, seq.prompt, params))
            refusal = await accepted
        except BaseException:
            self._acks.pop(rid, None)
            self._open.pop(rid, None)
            if self._ended is None and not accepted.done():  # the caller left meanwhile
                self.post(("cancel", rid))
            raise
        if refusal is not None:
            self._open.pop(rid, None)
            raise refusal
        return seq

    def reset_stats(self) -> bool:
        """Zero the engine's counters if it is idle (after the first requests): whether it did."""
        done = threading.Event()
        self._reset = (done, [])
        self.send(("reset_stats",))
        if not done.wait(REPLY_TIMEOUT_S):
            return False
        reply = self._reset[1]
        return bool(reply and reply[0])

    # the driver (ServedEngine): the process steps itself
    def start(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def stop(self, timeout: float = 10.0) -> None:
        self.close(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the engine process to finish and wait for it (open requests end with an error)."""
        if self._closed:
            return
        self._closed = True
        self.post(("close",))
        self._stop_process(timeout)
        self._reader.join(timeout)
        self._fail_open(EngineError("the server is shutting down", "send the request again"))

    # ---- the pipe's reader -----------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "outs":
                self._deliver(msg[1])
                if msg[2] is not None:
                    self._stats = msg[2]
            elif kind == "added":
                loop, accepted = self._acks.pop(msg[1], (None, None))
                if loop is not None and accepted is not None:
                    loop.call_soon_threadsafe(_settle, accepted, msg[2])
            elif kind == "reset":
                self._stats = msg[2]
                if self._reset is not None:
                    self._reset[1].append(msg[1])
                    self._reset[0].set()
            elif kind == "closed":
                break
        self._fail_open(self._gone())

    def _deliver(self, outs: list[tuple[int, Output, float | None, float | None]]) -> None:
        for rid, out, started_at, first_token_at in outs:
            seq = self._open.get(rid)
            if seq is None:
                continue
            seq.started_at, seq.first_token_at = started_at, first_token_at
            if out.finished or out.error is not None:
                seq.finished, seq.finish_reason = True, out.finish_reason
                self._open.pop(rid, None)
            if seq.sink is not None:
                seq.sink(seq, out)

    def _gone(self) -> EngineError:
        if self._ended is None:
            self.process.join(2.0)  # its pipe closes a moment before it is reaped
            self._ended = EngineError(
                f"the engine process has ended{_how(self.process.exitcode)}",
                "restart the server; its log says why",
            )
        return self._ended

    def _fail_open(self, error: EngineError) -> None:
        if self._ended is None:
            self._ended = error
        # (the event loop's thread may drop an entry meanwhile: a caller that left)
        for rid in list(self._acks):
            loop, accepted = self._acks.pop(rid, (None, None))
            if loop is not None and accepted is not None:
                loop.call_soon_threadsafe(_settle, accepted, error)
        for rid in list(self._open):
            seq = self._open.pop(rid, None)
            if seq is not None:
                seq.finished = True
                if seq.sink is not None:
                    seq.sink(seq, Output([], finished=True, error=error))
        if self._reset is not None:
            self._reset[0].set()

    def post(self, msg: tuple[Any, ...]) -> None:
        """Send, ignoring an engine that is gone (a cancel or a close then has nothing to do)."""
        if self._ended is not None:
            return
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):
            pass

    def _stop_process(self, timeout: float) -> None:
        """Wait for the engine process (ours) to exit; stop it if it will not."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _how(code: int | None) -> str:
    """How a process ended, for the error's message."""
    if code is None or code == 0:
        return ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ", as the system's out-of-memory killer does" if name == "SIGKILL" else ""
        return f" (killed by {name}{hint})"
    return f" (exit code {code})"


def _settle(accepted: asyncio.Future[Any], refusal: BaseException | None) -> None:
    """The add's answer on the loop that waits for it: None (accepted), the engine's refusal,
    or the error of an engine process that ended (add_request_async raises either)."""
    if not accepted.done():
        accepted.set_result(refusal)
