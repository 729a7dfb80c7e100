"""The server process's garbage-collector pauses, counted for /metrics; and the heap frozen
once the server is up.

Why: one interpreter runs the event loop (a streamed chunk per row per step) and the engine
thread, which has one decode step's time (1.4-2.8 ms on E2B) to launch the next. A cyclic
collection stops both for as long as it walks the heap, and the heap after loading holds the
model's and tokenizer's Python objects, which a full collection walks every time. At 8-16
streams the decode stream's clock (engine/step_clock.py) shows the GPU waiting for the host on
2-5% of the steps (lab/journal.md v23); these counters say how much of that the collector is.

`freeze` moves everything alive at startup into the permanent generation (gc.freeze, as vLLM's
engine does after loading), so later collections walk only what the requests allocate.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GcTotals:
    collections: int = 0
    seconds: float = 0.0  # summed pauses
    max_pause_s: float = 0.0
    full_collections: int = 0  # generation 2


class GcWatch:
    """Times every collection through gc.callbacks while installed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = GcTotals()
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        if self._started is None:
            return
        pause, self._started = now - self._started, None
        with self._lock:
            t = self._totals
            self._totals = GcTotals(t.collections + 1, t.seconds + pause,
                                    max(t.max_pause_s, pause),
                                    t.full_collections + int(info.get("generation") == 2))  # fmt: skip

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def reset(self) -> None:
        with self._lock:
            self._totals = GcTotals()

    def totals(self) -> GcTotals:
        with self._lock:
            return self._totals


def freeze() -> int:
    """Collect once, then exempt every object alive now from later collections; the number
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
