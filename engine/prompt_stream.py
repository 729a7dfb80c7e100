"""Prompt passes on a second CUDA stream, beside the decode steps (EngineOptions.async_prompts).

Why: under load a new request's prompt pass runs between two decode steps of every other
sequence, which all wait for it. At eight streams of 512-token prompts and 128 new tokens,
each request sees about seven such passes during its own 127 steps: about a tenth of its time
per token (lab/journal.md v21). A pass is large matrix products, a decode step of few rows
hundreds of short kernels that leave most of the GPU idle; on two streams the GPU can run the
pass in the gaps of the steps, and the decoding sequences stop waiting for it.

What it changes: the runner launches a plan's prompt chunks on the side stream (after
everything the main stream has queued: block tables, ring resets, the prompt ids) and returns
a `Landing` per pass. A sequence whose prompt is read joins the decode rows only once its last
pass has landed (the scheduler asks `ModelRunner.landed`), one or two steps later than on one
stream; the main stream then waits for that pass's event before the step that first reads its
cache. The pass writes only its own sequences' blocks and rings (and the padding slot, which
no sequence reads), so nothing the decode steps read changes under them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Landing(Protocol):
    """A launched prompt pass."""

    def done(self) -> bool:
        """Whether the pass has finished on the device (never blocks)."""
        ...

    def wait(self) -> None:
        """Block the host until the pass has finished."""
        ...

    def join(self) -> None:
        """Order the current stream's later work after the pass (no host wait)."""
        ...


class _EventLanding:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def join(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class SidePrompts:
    """Runs prompt passes on a stream of their own (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, read: Callable[[], None]) -> Landing:
        """`read()` launched on the side stream, after all the main stream has queued."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            read()
        event = torch.cuda.Event()
        event.record(self.stream)
        return _EventLanding(event)

    def synchronize(self) -> None:
        self.stream.synchronize()
