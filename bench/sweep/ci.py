"""Mean and 95% confidence interval over a cell's repeats (Student's t: a handful of repeats is
the usual case, where the normal 1.96 would claim too much), whether two intervals overlap, and
the paired difference (repeat by repeat) with its interval: the tests `compare_sweeps` uses
before it calls a difference real.
"""

from __future__ import annotations

import math
import statistics

# Student's t at 97.5% for 1..30 degrees of freedom (scipy.stats.t.ppf), then the normal's
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.16, 2.145, 2.131, 2.12, 2.11, 2.101, 2.093, 2.086, 2.08, 2.074, 2.069, 2.064, 2.06,
        2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    return T975[df - 1] if df <= len(T975) else 1.96


def mean_ci(values: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, half-width of its 95% interval); the half-width is None below two values."""
    xs = [float(x) for x in values if x is not None]
    if not xs:
        return None, None
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return round(mean, 4), None
    sem = statistics.stdev(xs) / math.sqrt(len(xs))
    half = t975(len(xs) - 1) * sem
    return round(mean, 4), round(half, 4)


def overlap(a: tuple[float | None, float | None], b: tuple[float | None, float | None]) -> bool:
    """Whether two (mean, half-width) intervals overlap; an interval that is not known (one
    repeat) overlaps everything: no difference is claimed without repeats."""
    (ma, ha), (mb, hb) = a, b
    if ma is None or mb is None or ha is None or hb is None:
        return True
    return ma - ha <= mb + hb and mb - hb <= ma + ha


def paired(
    base: dict[int, float | None], other: dict[int, float | None]
) -> tuple[float | None, float | None, int]:
    """(mean, 95% half-width, pairs) of other - base over the keys both hold a value for (a
    sweep's repeats): pairing takes out what the two share (the same prompts, the same repeat
    position), so a difference can show where the two intervals of `overlap` still overlap."""
    diffs = [other[k] - base[k] for k in sorted(base.keys() & other.keys())
             if base[k] is not None and other[k] is not None]  # fmt: skip
    mean, half = mean_ci(diffs)
    return mean, half, len(diffs)


def excludes_zero(mean: float | None, half: float | None) -> bool:
    """The interval mean ± half lies wholly on one side of 0 (unknown: False)."""
    return mean is not None and half is not None and (mean - half > 0 or mean + half < 0)
