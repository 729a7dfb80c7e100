"""From a cell's requests to its numbers: throughput, per-stream speed, percentiles, failures.

The definitions follow `vllm bench serve`, so the two drivers' cells compare: output tok/s is
the completed requests' output tokens over the cell's wall time (first send to last byte);
TPOT is (e2e - TTFT) / (output tokens - 1) per request; per-stream tok/s is 1000 / median TPOT;
ITL is every gap between two stream chunks; percentiles are numpy's linear ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from bench.sweep.arrivals import rate_of
from bench.sweep.models import RequestResult

MAX_REASON = 300


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def reason_of(error: str) -> str:
    """A failure reason to count, bounded: the error's first line, or a Python traceback's
    last (the exception: `vllm bench serve` saves whole tracebacks as its errors)."""
    lines = [x for x in error.strip().splitlines() if x.strip()]
    if not lines:
        return "unknown error"
    line = lines[-1] if lines[0].startswith("Traceback (most recent call last)") else lines[0]
    return line.strip()[:MAX_REASON]


def stats(requests: list[RequestResult], duration_s: float, output_len: int) -> dict[str, Any]:
    """The CellRecord fields computed from its requests."""
    ok = [r for r in requests if r.error is None]
    failed = [r for r in requests if r.error is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    itl = [x for r in ok for x in r.itl_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    median_tpot = pct(tpot, 50)
    return {
        "duration_s": round(duration_s, 4),
        "n_requests": len(requests),
        "completed": len(ok),
        "failed": len(failed),
        "failure_reasons": dict(Counter(reason_of(r.error or "") for r in failed)),
        "short_outputs": sum(1 for r in ok if r.output_tokens < (r.output_len or output_len)),
        "long_outputs": sum(1 for r in ok if r.output_tokens > (r.output_len or output_len)),
        "input_tokens": sum(r.input_tokens for r in ok),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / duration_s, 3) if ok and duration_s > 0 else None,
        "per_stream_tok_s": round(1000.0 / median_tpot, 3) if median_tpot else None,
        "req_s": round(len(ok) / duration_s, 4) if ok and duration_s > 0 else None,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": median_tpot,
        "tpot_p99_ms": pct(tpot, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p99_ms": pct(e2e, 99),
        **_open_loop(requests),
        **_prefix(ok),
        "mean_prompt_tokens": _mean([r.prompt_tokens for r in ok if r.prompt_tokens]),
    }


def _mean(xs: list) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def _open_loop(requests: list[RequestResult]) -> dict[str, Any]:
    """A rate cell's achieved send rate: (n - 1) / (last send - first send) of first turns."""
    if not any(r.scheduled_s is not None for r in requests):
        return {}
    return {"achieved_rate": rate_of([r.start_s for r in requests if r.turn == 0])}


def _prefix(ok: list[RequestResult]) -> dict[str, Any]:
    """What a shared prefix buys: the median TTFT of each group's first request (which pays to
    read the prefix) and of the others (which a prefix cache serves)."""
    cold = [r.ttft_ms for r in ok if r.group is not None and r.group_first and r.ttft_ms]
    warm = [r.ttft_ms for r in ok if r.group is not None and not r.group_first and r.turn == 0]
    warm = [x for x in warm if x]
    if not cold or not warm:
        return {}
    return {"ttft_cold_ms": pct(cold, 50), "ttft_warm_ms": pct(warm, 50)}


def status_of(completed: int, failed: int) -> tuple[str, str | None]:
    """ok / partial / failed, and the reason when not ok."""
    if completed == 0:
        return "failed", "no request completed"
    if failed:
        return "partial", f"{failed} of {completed + failed} requests failed"
    return "ok", None
