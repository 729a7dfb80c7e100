"""The engine in a process of its own: the loop the server's engine process runs.

Why: in one process the engine's thread shares the interpreter lock with the server's event loop
and its worker threads. PyTorch lets go of the lock around every op it dispatches, so each
launch, copy and replay can wait for whatever Python the server runs meanwhile (the ended
streams' last chunks, the new requests' parsing) before the next one; the decode stream then
idles while the host is late. vLLM splits its engine core from its API server for the same
reason. Here the engine's process runs only this loop: requests and cancellations come in
through a pipe between steps, each step's outputs go back in one message.

Messages to the core: ("add", rid, prompt ids, SamplingParams), ("cancel", rid),
("reset_stats",) (answered once the engine is idle), ("close",). From it: ("ready", Loaded) or
("failed", error, traceback) once, after loading; ("added", rid, None or the refusal), ("outs",
[(rid, Output, started_at, first_token_at)], stats or None), ("reset", done, stats),
("closed",). engine/process/client.py is the other end.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.interface import EngineFacts
from engine.server.gc_watch import GcWatch

if TYPE_CHECKING:
    from engine.runtime import Engine
    from engine.scheduler import SchedulerStats
    from engine.sequence import Output, Sequence

STATS_EVERY_S = 0.05  # while busy, the scheduler's counters go along at most this often


@dataclass(frozen=True)
class CoreSpec:
    """What the core loads: `engine.load`'s arguments (the options from the server's
    environment, which a spawned process inherits)."""

    model_dir: Path
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    torch_threads: int | None = None
    gc_freeze: bool = True


@dataclass
class StartedCore:
    """An engine process started and loading, whose "ready" nobody has read yet: the server
    starts it before its own imports (torch's among them, which the process pays again), so
    the two overlap, and wraps it in an EngineClient once it needs it."""

    process: BaseProcess
    conn: Connection

    def abandon(self, timeout: float = 5.0) -> None:
        """Stop the process (ours) and reap it: the server decided to keep the engine in its
        own process after all (no CUDA after a driver was seen)."""
        self.conn.close()
        self.process.terminate()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_core(spec: CoreSpec) -> StartedCore:
    """Spawn the engine process, which loads `spec` at once. Spawned, not forked: the server's
    process never touches CUDA. This module imports no torch, so a caller that has not imported
    it yet starts the process before paying for it."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=core_main, args=(child, spec), name="gpurig-engine",
                          daemon=True)  # fmt: skip
    process.start()
    child.close()
    return StartedCore(process, conn)


@dataclass(frozen=True)
class Loaded:
    """The engine process's "ready": the loaded engine's facts, the lines a server logs of it
    (its KV cache, its warm-up if it ran) and its idle counters."""

    facts: EngineFacts
    kv_cache_line: str
    warm_up_line: str | None
    stats: SchedulerStats


def startup_lines(eng: Engine) -> tuple[str, str | None]:
    """The lines a server logs of a loaded engine: its KV cache, and its warm-up if it ran."""
    from engine.batching import kv_cache_line

    report = eng.warm_up_report
    line = kv_cache_line(eng.batching, eng.pool.nbytes(), eng.device.type)
    return line, report.line() if report is not None else None


def loaded(eng: Engine) -> Loaded:
    """What the client needs of a loaded engine, in one message."""
    kv_line, warm_line = startup_lines(eng)
    return Loaded(eng.facts, kv_line, warm_line, eng.stats())


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else an EngineError with its text (the client raises or
    reports what arrives)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc}", "see the server's log")


def core_main(conn: Connection, spec: CoreSpec) -> None:
    """The engine process's whole life: load, say so, then serve the pipe until told to close
    or the server's end of it goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it sends "close"
    try:
        import torch

        import engine

        if spec.torch_threads is not None:
            torch.set_num_threads(spec.torch_threads)
        eng = engine.load(spec.model_dir, **spec.load_kwargs)
    except BaseException as exc:  # a bad checkpoint, no memory: the server reports it and exits
        conn.send(("failed", portable(exc), traceback.format_exc(limit=4)))
        conn.close()
        return
    if spec.gc_freeze:  # the loaded engine's objects stay out of every later collection
        gc.collect()
        gc.freeze()
    try:
        conn.send(("ready", loaded(eng)))
        Core(conn, eng).run()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the server's end went away: nobody is left to serve
    finally:
        eng.close()
        conn.close()


class Core:
    """The loop: messages between steps, a step, its outputs in one message."""

    def __init__(self, conn: Connection, eng: Engine) -> None:
        self.conn = conn
        self.eng = eng
        self.seqs: dict[int, Sequence] = {}  # rid -> the engine's Sequence, while open
        self.outs: list[tuple[int, Output, float | None, float | None]] = []
        self.stats_sent = 0.0
        self.idle_sent = True  # "ready" carried the idle engine's counters
        self.closing = False
        self.reset_wanted = False
        self.gc = GcWatch()  # this process's collections: they stop the stepping thread

    def stats(self) -> SchedulerStats:
        """The engine's counters with this process's garbage-collector pauses."""
        t = self.gc.totals()
        return replace(self.eng.stats(), process_gc_collections=t.collections,
                       process_gc_s=t.seconds, process_gc_max_pause_s=t.max_pause_s)  # fmt: skip

    def run(self) -> None:
        conn, eng = self.conn, self.eng
        self.gc.install()
        while not self.closing:
            busy = eng.has_work
            # idle: block on the pipe (no interpreter held); busy: only what already came
            if conn.poll(0 if busy else 1.0):
                while conn.poll(0):
                    self.handle(conn.recv())
            eng.note("received")  # the host's phases before a late step (engine/step_clock.py)
            if self.closing:
                break
            if eng.has_work:
                eng.step()  # a failing step ends its requests with the error (their outputs)
            self.flush(idle=not eng.has_work)
            eng.note("sent")
            if self.reset_wanted and not eng.has_work:
                self.reset_wanted = False
                done = eng.reset_stats()
                if done:
                    self.gc.reset()
                self.conn.send(("reset", done, self.stats()))
        self.conn.send(("closed",))

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt_ids, params = msg
            try:
                seq = self.eng.add_request(prompt_ids, params, self._sink(rid))
            except Exception as exc:  # the request's own refusal: the client's 400
                self.conn.send(("added", rid, portable(exc)))
                return
            self.seqs[rid] = seq
            self.conn.send(("added", rid, None))
        elif kind == "cancel":
            seq = self.seqs.get(msg[1])
            if seq is not None:
                seq.cancel()
        elif kind == "reset_stats":  # once the engine is idle (its last step may be running)
            self.reset_wanted = True
        elif kind == "close":
            self.closing = True

    def _sink(self, rid: int) -> Callable[[Sequence, Output], None]:
        """The request's outputs into this step's message (on this, the stepping thread)."""

        def sink(seq: Sequence, out: Output) -> None:
            if out.error is not None:
                out.error = portable(out.error)
            self.outs.append((rid, out, seq.started_at, seq.first_token_at))
            if out.finished or out.error is not None:
                self.seqs.pop(rid, None)

        return sink

    def flush(self, idle: bool) -> None:
        """The step's outputs in one message, with the counters when they are due: every
        STATS_EVERY_S while busy, and once as the engine goes idle (so a reader after a run
        sees its last step)."""
        now = time.perf_counter()
        if not idle:
            self.idle_sent = False
        due = not self.idle_sent if idle else now - self.stats_sent >= STATS_EVERY_S
        if not self.outs and not due:
            return
        stats = None
        if due:
            stats, self.stats_sent, self.idle_sent = self.stats(), now, idle
        self.conn.send(("outs", self.outs, stats))
        self.outs = []
