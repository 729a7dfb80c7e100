"""The thread that steps an in-process engine while it has work: how engine/runtime.py's
`Engine` implements `start`/`wake`/`stop` of engine/interface.py's `ServedEngine`.

Why one thread: the engine's steps are serialised anyway (its lock), and a request's outputs
reach its sink on the stepping thread, which hands them to the server's event loop
(engine/server/queue.py); a thread that sleeps while the engine is idle costs nothing.
"""

from __future__ import annotations

import threading
from typing import Protocol


class Steppable(Protocol):
    """What the thread uses of its engine."""

    @property
    def has_work(self) -> bool: ...

    def step(self) -> bool: ...


class StepThread:
    """Steps `engine` while it has work; woken when a request arrives or is cancelled."""

    def __init__(self, engine: Steppable, name: str = "gpurig-engine") -> None:
        self.engine = engine
        self.name = name
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping (the step under way finishes first)."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._closing:
            if self.engine.has_work:
                self.engine.step()  # a failing step ends its requests with the error itself
                continue
            self._wake.wait(timeout=1.0)
            self._wake.clear()
