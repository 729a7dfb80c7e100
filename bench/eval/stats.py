"""The numbers a paired evaluation needs: a 95% interval for a rate, and McNemar's exact test.

Wilson's score interval, not the normal one: the normal interval collapses to zero width at 0 or
n right and runs outside [0, 1] near them, which is where small suites (and a stand-in model
that is always right) live. McNemar exact: only the discordant questions carry information about
which server is better; under "no difference" each is a fair coin, so the p-value is the
two-sided binomial tail of min(b, c) out of b + c.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson(right: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of right / n; (0, 1) when nothing was asked."""
    if n <= 0:
        return 0.0, 1.0
    p = right / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b questions only a got right and c only b got right:
    2 x P(X <= min(b, c)) for X ~ Binomial(b + c, 1/2), capped at 1 (1 when b + c = 0)."""
    if b < 0 or c < 0:
        raise ValueError("counts cannot be negative")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1))
    # exact integers until the one division: no underflow for thousands of questions
    return min(1.0, 2 * tail / 2**n)
