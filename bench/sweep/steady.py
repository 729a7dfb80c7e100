"""Steady state: a cell's first requests left out of its figures (`exclude_first` requests,
or those sent in its first `exclude_first_s` seconds), as GuideLLM's and AIPerf's warm-up
windows do. The first requests of a cell meet an idle server (no batch to join, caches
cold), so a short cell's percentiles and throughput lean toward them. The excluded requests
stay in the cell's record, marked, and the cell says how many; its wall time is then the
measured requests' own (first measured send to last measured byte).
"""

from __future__ import annotations

from bench.sweep.models import RequestResult


def mark_warmup(requests: list[RequestResult], first_n: int, first_s: float) -> int:
    """Mark the warm-up requests (`excluded`); how many. None are marked when that would
    leave no request to measure."""
    if not requests or (first_n <= 0 and first_s <= 0):
        return 0
    order = sorted(requests, key=lambda r: r.start_s)
    t0 = order[0].start_s
    warm = [r for i, r in enumerate(order) if i < first_n or r.start_s - t0 < first_s]
    if len(warm) >= len(order):
        return 0
    for r in warm:
        r.excluded = True
    return len(warm)


def measured(requests: list[RequestResult]) -> tuple[list[RequestResult], float | None]:
    """The requests counted, and their wall time in seconds (None when none was excluded:
    the driver's own)."""
    kept = [r for r in requests if not r.excluded]
    if len(kept) == len(requests):
        return requests, None
    ends = [r.start_s + (r.e2e_ms or 0.0) / 1000 for r in kept]
    return kept, max(ends) - min(r.start_s for r in kept)
