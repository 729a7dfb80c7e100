"""Service-level objectives: which requests met them, a cell's goodput, and whether it passed.

An SLO is `{METRIC_pP_ms: limit}` with METRIC one of ttft, tpot, itl, e2e (e.g. `ttft_p99_ms:
500`). Two questions, two answers:
- a request is good when its own TTFT, TPOT and E2E latency are each within the limits (ITL:
  its own gaps' P-th percentile), as `vllm bench serve --goodput` counts; goodput is good
  requests per second of the cell (vLLM's `request_goodput`), and the share is good / sent;
- a cell meets the SLO when each P-th percentile over its requests is within its limit, a
  failed request counting as infinitely slow (so a cell that drops requests cannot pass).
"""

from __future__ import annotations

import math
import re

import numpy as np

from bench.sweep.models import SLO_KEY, RequestResult

FAILED_MS = 1e15


def parse_key(key: str) -> tuple[str, float]:
    """'ttft_p99_ms' -> ('ttft', 99.0)."""
    m = re.match(SLO_KEY, key)
    if m is None:
        raise ValueError(f"not an SLO key: {key!r}")
    return m.group(1), float(m.group(2))


def request_value(r: RequestResult, metric: str, q: float) -> float | None:
    """The request's own figure for `metric` (None when it has none, e.g. a failed one)."""
    if r.error is not None:
        return None
    if metric == "itl":
        return float(np.percentile(r.itl_ms, q)) if r.itl_ms else 0.0
    return {"ttft": r.ttft_ms, "tpot": r.tpot_ms, "e2e": r.e2e_ms}[metric]


def is_good(r: RequestResult, slo: dict[str, float]) -> bool:
    for key, limit in slo.items():
        metric, q = parse_key(key)
        value = request_value(r, metric, q)
        if metric == "tpot" and value is None and r.error is None:
            continue  # a one-token answer has no TPOT (vLLM counts it good on the others)
        if value is None or value > limit:
            return False
    return True


def cell_value(requests: list[RequestResult], metric: str, q: float) -> float | None:
    """The P-th percentile of `metric` over the cell; failed requests as +inf."""
    values: list[float] = []
    for r in requests:
        if r.error is not None:
            values.append(math.inf)
        elif metric == "itl":
            values.extend(r.itl_ms)
        else:
            v = request_value(r, metric, q)
            if v is not None:
                values.append(v)
    if not values:
        return None
    # numpy interpolates inf - inf to nan: a stand-in far above any latency, mapped back to inf
    finite = [min(v, FAILED_MS) for v in values]
    out = float(np.percentile(finite, q, method="linear"))
    slowest = max((v for v in values if not math.isinf(v)), default=-1.0)
    return math.inf if out > slowest else round(out, 3)


def evaluate(
    requests: list[RequestResult], duration_s: float, slo: dict[str, float]
) -> dict[str, object]:
    """The CellRecord's SLO fields: slo_values, slo_met, goodput_req_s, slo_share."""
    if not slo or not requests:
        return {}
    values = {key: cell_value(requests, *parse_key(key)) for key in slo}
    met = all(v is not None and v <= slo[k] for k, v in values.items())
    good = sum(1 for r in requests if is_good(r, slo))
    return {
        "slo_values": {k: (None if v is None or math.isinf(v) else v) for k, v in values.items()},
        "slo_met": met,
        "goodput_req_s": round(good / duration_s, 4) if duration_s > 0 else None,
        "slo_share": round(good / len(requests), 4),
    }
