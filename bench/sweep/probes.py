"""Stall probes: single-token requests sent beside a cell's load, at their own seeded Poisson
rate and outside the load's concurrency cap, timed like any request. Their TTFT is what the
load does to a user who arrives meanwhile: a long prompt read without chunking, or a scheduler
that admits nothing new while it decodes, shows as probes waiting seconds for one token while
the load's own figures look fine. Each probe has a prompt of its own (seeded ids, or a short
text), so a prefix cache cannot answer it from an earlier probe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.sweep.cell_models import ProbeStats
from bench.sweep.cellstats import pct, reason_of
from bench.sweep.models import RequestResult

PROBE_LEN = 16  # prompt tokens of a probe
DRAIN_S = 30.0  # how long the probes still out when the load ends may take


@dataclass
class ProbePlan:
    """What to send: `rate` probes per second, probe i's prompt from `prompt(i)`, the gaps
    drawn from `seed_parts`."""

    rate: float
    prompt: Callable[[int], list[int] | str]
    seed_parts: list[int]


async def run_probes(
    plan: ProbePlan,
    send: Callable[[list[int] | str, int], Coroutine[Any, Any, RequestResult]],
    stop: asyncio.Event,
) -> list[RequestResult]:
    """Send probes until `stop` is set (the load has ended), then wait for those still out (at
    most DRAIN_S; the rest count as failed). `send(prompt, index)` sends one."""
    rng = np.random.default_rng(plan.seed_parts)
    tasks: list[asyncio.Task[RequestResult]] = []
    while True:
        gap = float(rng.exponential(1.0 / plan.rate))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), gap)
        if stop.is_set():
            break
        i = len(tasks)
        tasks.append(asyncio.create_task(send(plan.prompt(i), i)))
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=DRAIN_S)
    for t in pending:
        t.cancel()
    out = []
    for i, t in enumerate(tasks):
        if t in done and t.exception() is None:
            out.append(t.result())
        else:
            late = f"the probe had not ended {DRAIN_S:g} s after the load"
            out.append(RequestResult(index=i, prompt_sha="", input_tokens=0, error=late))
    return out


def probe_stats(rate: float, results: list[RequestResult]) -> ProbeStats:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    failed = [r for r in results if r.error is not None]
    return ProbeStats(
        rate=rate,
        sent=len(results),
        completed=len(ok),
        failed=len(failed),
        ttft_p50_ms=pct(ttft, 50),
        ttft_p99_ms=pct(ttft, 99),
        ttft_max_ms=round(max(ttft), 3) if ttft else None,
        failure_reasons=dict(Counter(reason_of(r.error or "") for r in failed)),
    )
