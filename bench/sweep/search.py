"""The SLO search: the highest load (concurrency, or request rate) at which a target still meets
the SLO, per target and input length, as `vllm bench sweep serve_sla` and GuideLLM's sweeps
look for it.

Doubling from the start level until a level fails (or the search's max passes), then bisection
between the highest passing level and the lowest failing one above it, until they are adjacent
(concurrency) or within `precision` of each other (rate). A level passes when every repeat met
the SLO. The next level is a pure function of the levels measured so far, so a resumed search
replays the cells on disk and carries on where the killed one stopped.
"""

from __future__ import annotations

from bench.sweep.models import CellRecord, SearchAnswer, SearchLevel, SearchSpec


def _bracket(levels: dict[float, bool]) -> tuple[float | None, float | None]:
    """(highest pass below the lowest fail, lowest fail): the search's bracket so far."""
    fails = [x for x, ok in levels.items() if not ok]
    hi = min(fails) if fails else None
    passes = [x for x, ok in levels.items() if ok and (hi is None or x < hi)]
    return (max(passes) if passes else None), hi


def next_level(spec: SearchSpec, levels: dict[float, bool]) -> float | None:
    """The next load to measure, or None when the search is over."""
    level = spec.start
    while level in levels and levels[level]:
        if level >= spec.max:
            return None  # passed all the way to the cap
        level = min(level * 2, spec.max)
    if level not in levels:
        return level
    lo, hi = _bracket(levels)
    if lo is None or hi is None:
        return None  # even the start failed
    if spec.axis == "concurrency":
        if hi - lo <= 1:
            return None
        return float((int(lo) + int(hi)) // 2)
    if (hi - lo) / hi <= spec.precision:
        return None
    return round((lo + hi) / 2, 4)


def level_of(spec: SearchSpec, cell: CellRecord) -> float:
    return cell.rate if spec.axis == "rate" and cell.rate is not None else float(cell.concurrency)


def passed(cells: list[CellRecord]) -> bool:
    """A level passes when every repeat met the SLO."""
    return bool(cells) and all(c.slo_met for c in cells)


def answer(
    spec: SearchSpec,
    target: str,
    input_len: int,
    cells: list[CellRecord],
    repeats: int,
) -> SearchAnswer:
    """The search's answer from the cells it measured (in the order they were measured)."""
    by_level: dict[float, list[CellRecord]] = {}
    for c in cells:
        by_level.setdefault(level_of(spec, c), []).append(c)
    complete = {x: cs for x, cs in by_level.items() if len(cs) >= repeats}
    levels = {x: passed(cs) for x, cs in complete.items()}
    measured = [
        SearchLevel(load=x, passed=levels[x], repeats=len(cs), values=_worst(cs))
        for x, cs in complete.items()
    ]
    lo, hi = _bracket(levels)
    done = bool(levels) and next_level(spec, levels) is None
    reason = None
    if levels and lo is None:
        failed = [c for c in cells if c.status == "failed"]
        reason = failed[0].reason if failed else f"the SLO is missed already at {spec.start:g}"
    return SearchAnswer(
        target=target,
        input_len=input_len,
        axis=spec.axis,
        answer=lo,
        first_fail=hi,
        capped=hi is None and lo is not None and lo >= spec.max,
        levels=measured,
        cells=len(cells),
        done=done,
        reason=reason,
    )


def _worst(cells: list[CellRecord]) -> dict[str, float | None]:
    """Each SLO figure's worst value over the level's repeats (None: no request completed)."""
    keys = {k for c in cells for k in c.slo_values}
    out: dict[str, float | None] = {}
    for k in sorted(keys):
        vals = [c.slo_values.get(k) for c in cells]
        out[k] = None if any(v is None for v in vals) else max(v for v in vals if v is not None)
    return out
