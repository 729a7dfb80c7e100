"""What the plan's correctness gate and run order allow, checked when the plan is made
(SweepConfig's validator calls this): a reference that is one of the targets, and an interleaved
order only where it can run.

Interleaved (ABAB) runs every target's cell before the next cell, so every target must answer
at once: running servers (base_url) only, since a server the sweep starts holds the GPU alone and
is stopped before the next target's. A search decides its cells as it goes, level by level per
target, so it has no order to interleave.
"""

from __future__ import annotations

from typing import Any


def check_gate_and_order(config: Any, labels: list[str]) -> None:
    """ValueError (pydantic reports it at the field) when the plan cannot run as asked."""
    if config.reference is not None and config.reference not in labels:
        raise ValueError(
            f"reference {config.reference!r} is not a target label (labels: {', '.join(labels)})"
        )
    if not config.interleave:
        return
    started = [t.label for t in config.targets if t.server is not None]
    if started:
        raise ValueError(
            "interleave alternates targets cell by cell, so every target must be a running "
            f"server (base_url); started by the sweep: {', '.join(started)}"
        )
    if config.search is not None:
        raise ValueError("interleave runs a grid; a search decides its cells target by target")
