"""Over-saturation of a rate cell, and stopping a request-rate axis early.

A cell is over-saturated when the server cannot keep up with its arrivals, so a queue grows for
as long as the cell lasts and its latencies measure the queue, not the server (GuideLLM's
over-saturation detection, which stops a benchmark on it). Two signs, both needed (as GuideLLM
needs both its slopes): completions fall well behind arrivals (their rate, (n - 1) / (last end
- first end), under KEEP_UP of the arrivals' own rate), and the requests due but not finished
grow along the cell (a least-squares slope over the arrival times, positive at 95%: its
t-interval's half-width under its size). Only counts and ratios of the cell's own times, no
whole seconds or whole requests per second, so a rate below 1 req/s is judged like any other
(vLLM #47651: integer rounding of sub-1 req/s rates gave a rate of 0).

A rate axis (one target, input length and cap) stops after the first rate at which most
repeats missed the SLO, were over-saturated or completed nothing: higher rates can only do
worse, and each would cost a cell of queueing. The decision is a function of the cells on disk,
so a resumed sweep skips the same cells and the report names the same stop.
"""

from __future__ import annotations

import math

import numpy as np

from bench.sweep.arrivals import rate_of
from bench.sweep.cell_models import AxisStop, Saturation
from bench.sweep.models import CellKey, CellRecord, RequestResult, SweepConfig

KEEP_UP = 0.85  # completions under this share of the arrivals' rate: behind
MIN_CONVERSATIONS = 6


def _t95(dof: int) -> float:
    """Student's t, two-sided 95%, for `dof` degrees of freedom (a table, then the normal)."""
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
             10: 2.23, 15: 2.13, 20: 2.09, 30: 2.04, 60: 2.00}  # fmt: skip
    best = max((d for d in table if d <= dof), default=1)
    return table[best] if dof < 120 else 1.96


def slope(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(least-squares slope, half-width of its 95% interval), None for fewer than 4 points."""
    n = len(xs)
    if n < 4:
        return None
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    sxx = float(((x - x.mean()) ** 2).sum())
    if sxx <= 0:
        return None
    b = float(((x - x.mean()) * (y - y.mean())).sum()) / sxx
    resid = y - (y.mean() + b * (x - x.mean()))
    se = math.sqrt(float((resid**2).sum()) / (n - 2) / sxx)
    return b, _t95(n - 2) * se


def check(requests: list[RequestResult]) -> Saturation | None:
    """The over-saturation check of an open-loop cell's requests (None: not a rate cell, or
    too few conversations to tell)."""
    convs: dict[int, list[RequestResult]] = {}
    for r in requests:
        convs.setdefault(r.index, []).append(r)
    due, end, ok_end = [], [], []
    for turns in convs.values():
        first = next((t for t in turns if t.turn == 0), turns[0])
        if first.scheduled_s is None:
            return None
        finish = max(t.start_s + (t.e2e_ms or 0.0) / 1000 for t in turns)
        due.append(first.scheduled_s)
        end.append(finish)
        if all(t.error is None for t in turns):
            ok_end.append(finish)
    if len(due) < MIN_CONVERSATIONS:
        return None
    offered, completion = rate_of(due), rate_of(ok_end)
    pairs = sorted(zip(due, end, strict=True))
    outstanding = [sum(1 for d, e in pairs if d <= t < e) for t, _ in pairs]
    fit = slope([t for t, _ in pairs], [float(o) for o in outstanding])
    growing = fit is not None and fit[0] > 0 and fit[1] < fit[0]
    behind = bool(offered and (completion is None or completion < KEEP_UP * offered))
    out = Saturation(
        saturated=growing and behind,
        offered_rate=offered,
        completion_rate=completion,
        outstanding_slope=round(fit[0], 4) if fit else None,
        outstanding_max=max(outstanding) if outstanding else None,
    )
    if out.saturated:
        done = "none" if completion is None else f"{completion:.3g}"
        out.reason = (
            f"over-saturated: completions {done} req/s of {offered:.3g} offered, requests "
            f"outstanding grew {fit[0]:.3g}/s (up to {out.outstanding_max})"  # type: ignore[index]
        )
    return out


def _level_failure(cells: list[CellRecord]) -> str | None:
    """Why a rate level stops its axis (most repeats failing), or None."""
    whys = []
    for c in cells:
        if c.completed == 0:
            whys.append(f"no request completed ({c.reason or 'failed'})")
        elif c.slo_met is False:
            missed = [f"{k} {v if v is not None else 'inf'}" for k, v in c.slo_values.items()]
            whys.append("missed the SLO (" + ", ".join(missed) + ")")
        elif c.saturation is not None and c.saturation.saturated:
            whys.append(c.saturation.reason or "over-saturated")
    if not cells or 2 * len(whys) < len(cells):
        return None
    return whys[0]


def axis_stops(config: SweepConfig, cells: list[CellRecord]) -> list[AxisStop]:
    """Every rate axis the cells on disk stop: the failing rate, why, and the rates after it."""
    if not config.saturation_stop or config.search is not None or not config.request_rate:
        return []
    rates = sorted(config.request_rate)
    cap = config.max_concurrency or 0
    stops = []
    for t in config.targets:
        for n in config.input_lens:
            for i, rate in enumerate(rates):
                level = [c for c in cells if (c.target, c.input_len, c.rate, c.concurrency)
                         == (t.label, n, rate, cap)]  # fmt: skip
                if len(level) < config.repeats:
                    break  # not finished: nothing decided past it
                why = _level_failure(level)
                if why is not None:
                    if rates[i + 1 :]:
                        stop = AxisStop(target=t.label, input_len=n, concurrency=cap, rate=rate,
                                        reason=why, skipped=rates[i + 1 :])  # fmt: skip
                        stops.append(stop)
                    break
    return stops


def skipped_by(config: SweepConfig, key: CellKey, cells: list[CellRecord]) -> AxisStop | None:
    """The stop that skips this cell, if a lower rate of its axis failed."""
    if key.rate is None:
        return None
    for stop in axis_stops(config, cells):
        if (stop.target, stop.input_len, stop.concurrency) == (
            key.target, key.input_len, key.concurrency
        ) and key.rate in stop.skipped:  # fmt: skip
            return stop
    return None
