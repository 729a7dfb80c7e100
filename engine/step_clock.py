"""The decode stream's own clock: GPU time inside the decode steps, and between them.

Why: the runner launches step n+1 while step n runs (engine/runner.py), so the host has one
step's time (1.4-2.8 ms on E2B) to deliver tokens, schedule and launch the next. When the host
takes longer (the engine thread itself, or a server's event loop holding the interpreter while
it streams every row's token), the GPU waits, and neither a kernel profile nor a step benchmark
shows it. Two timing events per step measure it on the GPU:
- busy: from the event recorded before the step's replay to the one after its token copy;
- idle: from the previous step's end to this step's start, counted only between consecutive
  steps (the engine had decode work throughout). It includes waiting for a prompt pass on the
  side stream (engine/prompt_stream.py) that this step's rows need;
- starved: steps whose predecessor had already ended when the host launched them, i.e. the
  host, not a pass, was the limit;
- plain_idle: the idle before plain steps, whose plan admitted, read and ended nothing: the host
  work there is the step loop's own (and whatever holds the interpreter beside it, a server's
  event loop), not a new request's;
- late_host_ms: for the late steps, where the host's time went between the moment the step
  before the previous one had finished (its tokens collected) and this launch, by phase
  (HOST_PHASES): delivering those tokens; in the engine process (engine/process/core.py),
  sending them to the server and receiving what came in (new requests added, cancellations);
  back in the caller's loop (the engine lock, the interpreter held elsewhere); scheduling;
  preparing the launch (blocks, admissions, passes). An engine stepped in the server's own
  process notes no send or receive: those phases are 0 there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch on first use: /metrics' module imports this one for HOST_PHASES
    import torch


# the host's phases before a launch, each from the note before it (`StepClock.note`)
HOST_PHASES = ("deliver", "send", "receive", "loop", "schedule", "prepare")
_NOTES = ("collected", "delivered", "sent", "received", "stepping", "scheduled")
_OPTIONAL = frozenset({"sent", "received"})  # noted by the engine process's loop alone


@dataclass(frozen=True)
class StepTimes:
    """Totals since the engine started (counters: a reader takes differences)."""

    busy_ms: float = 0.0  # GPU time inside decode steps
    idle_ms: float = 0.0  # GPU time of the decode stream between consecutive steps
    timed_steps: int = 0  # steps measured
    starved_steps: int = 0  # steps launched after their predecessor had ended
    plain_idle_ms: float = 0.0  # of idle_ms, before steps that admitted, read and ended nothing
    late_host_ms: tuple[float, ...] = (0.0,) * len(HOST_PHASES)  # summed over late steps
    late_timed: int = 0  # late steps whose phases were all noted

    @property
    def idle_share(self) -> float:
        """Idle time over the decode stream's time (0 when nothing was measured)."""
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total > 0 else 0.0

    def since(self, before: StepTimes) -> StepTimes:
        """The totals between `before` (an earlier reading) and these."""
        return StepTimes(
            busy_ms=self.busy_ms - before.busy_ms,
            idle_ms=self.idle_ms - before.idle_ms,
            timed_steps=self.timed_steps - before.timed_steps,
            starved_steps=self.starved_steps - before.starved_steps,
            plain_idle_ms=self.plain_idle_ms - before.plain_idle_ms,
            late_host_ms=tuple(
                a - b for a, b in zip(self.late_host_ms, before.late_host_ms, strict=True)
            ),  # fmt: skip
            late_timed=self.late_timed - before.late_timed,
        )


@dataclass
class StepMarks:
    """One launched step's events: `start` before its replay, `end` after its token copy."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    previous_end: torch.cuda.Event | None  # the step launched just before (consecutive)
    starved: bool
    plain: bool = False  # its plan admitted, read and ended nothing


def late_phases(notes: dict[str, float], last_begin: float, now: float) -> list[float] | None:
    """Milliseconds of each HOST_PHASES before a launch at `now` from the notes' times, or None
    where a phase was not noted since the last launch at `last_begin` (the first steps, or a
    caller that steps the engine its own way). An optional note not made since that launch
    takes the time of the note before it (its phase: 0)."""
    marks: list[float] = []
    for m in _NOTES:
        t = notes.get(m, -1.0)
        if m in _OPTIONAL and t < last_begin:
            t = marks[-1]
        marks.append(t)
    marks.append(now)
    if marks[0] < last_begin or any(b < a for a, b in pairwise(marks)):
        return None
    return [(b - a) * 1000 for a, b in pairwise(marks)]


class StepClock:
    """Accumulates StepTimes from each collected step's marks (CUDA only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times = StepTimes()
        self._notes: dict[str, float] = {}
        self._last_begin = 0.0

    def note(self, mark: str) -> None:
        """The host reached `mark` (one of _NOTES: Engine.step's phases) now."""
        self._notes[mark] = time.perf_counter()

    def begin(self, previous_end: torch.cuda.Event | None) -> tuple[torch.cuda.Event, bool]:
        """Before a step's launch: its start event, and whether the step before had ended
        (then the host's phases since the last collect count as a late step's)."""
        import torch

        now = time.perf_counter()
        starved = previous_end is not None and previous_end.query()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        if starved:
            self._add_late(now)
        self._last_begin = now
        return start, starved

    def _add_late(self, now: float) -> None:
        phases = late_phases(self._notes, self._last_begin, now)
        if phases is None:
            return
        with self._lock:
            t = self._times
            self._times = replace(t, late_timed=t.late_timed + 1, late_host_ms=tuple(
                x + y for x, y in zip(t.late_host_ms, phases, strict=True)))  # fmt: skip

    @staticmethod
    def mark_end() -> torch.cuda.Event:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return end

    def add(self, marks: StepMarks) -> None:
        """Count a step whose end event has completed (its start and the previous end have)."""
        busy = marks.start.elapsed_time(marks.end)
        idle = 0.0
        if marks.previous_end is not None:
            idle = max(0.0, marks.previous_end.elapsed_time(marks.start))
        with self._lock:
            t = self._times
            self._times = replace(t, busy_ms=t.busy_ms + busy, idle_ms=t.idle_ms + idle,
                                  timed_steps=t.timed_steps + 1,
                                  starved_steps=t.starved_steps + int(marks.starved),
                                  plain_idle_ms=t.plain_idle_ms + (idle if marks.plain else 0.0))  # fmt: skip

    def times(self) -> StepTimes:
        with self._lock:
            return self._times
