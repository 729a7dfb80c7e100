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
  event loop), not a new request's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTimes:
    """Totals since the engine started (counters: a reader takes differences)."""

    busy_ms: float = 0.0  # GPU time inside decode steps
    idle_ms: float = 0.0  # GPU time of the decode stream between consecutive steps
    timed_steps: int = 0  # steps measured
    starved_steps: int = 0  # steps launched after their predecessor had ended
    plain_idle_ms: float = 0.0  # of idle_ms, before steps that admitted, read and ended nothing

    @property
    def idle_share(self) -> float:
        """Idle time over the decode stream's time (0 when nothing was measured)."""
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total > 0 else 0.0


@dataclass
class StepMarks:
    """One launched step's events: `start` before its replay, `end` after its token copy."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    previous_end: torch.cuda.Event | None  # the step launched just before (consecutive)
    starved: bool
    plain: bool = False  # its plan admitted, read and ended nothing


class StepClock:
    """Accumulates StepTimes from each collected step's marks (CUDA only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times = StepTimes()

    @staticmethod
    def begin(previous_end: torch.cuda.Event | None) -> tuple[torch.cuda.Event, bool]:
        """Before a step's launch: its start event, and whether the step before had ended."""
        starved = previous_end is not None and previous_end.query()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start, starved

    @staticmethod
    def mark_end() -> torch.cuda.Event:
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
            self._times = StepTimes(t.busy_ms + busy, t.idle_ms + idle, t.timed_steps + 1,
                                    t.starved_steps + int(marks.starved),
                                    t.plain_idle_ms + (idle if marks.plain else 0.0))  # fmt: skip

    def times(self) -> StepTimes:
        with self._lock:
            return self._times
