"""Open-loop arrivals: when each request of a rate cell is due, as `vllm bench serve` draws them.

Gaps between requests are gamma-distributed with shape `burstiness` and mean 1 / rate (vLLM's
`--burstiness`: 1 is a Poisson process, below 1 burstier, above 1 more regular); the first
request goes at 0. Seeded, so every target sees the same schedule in the same cell.
"""

from __future__ import annotations

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float, seed_parts: list[int]) -> list[float]:
    """Send times in seconds after the cell starts, for `n` requests offered at `rate` per s."""
    if n <= 0:
        return []
    rng = np.random.default_rng(seed_parts)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def rate_of(times: list[float]) -> float | None:
    """Requests per second of a sequence of send times: (n - 1) / (last - first)."""
    if len(times) < 2:
        return None
    span = max(times) - min(times)
    return round((len(times) - 1) / span, 4) if span > 0 else None
