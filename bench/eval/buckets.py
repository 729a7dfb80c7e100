"""Wrong answers by bucket (score_bfcl.BUCKETS: wrong tool, missing parameter, parameter type,
unparsed, spurious call, ...), per server and across the pair.

Why paired: two servers of one checkpoint that each lose 10 BFCL questions may lose them the
same way (the model) or not (one server's tool parser leaving calls unparsed). The counts where
one side fails a way while the other is right on that question name the difference; the ones
where both fail the same way are the model's.
"""

from __future__ import annotations

from collections import Counter

from tabulate import tabulate

from bench.eval.models import Answer, BucketPair, Paired, Row
from bench.eval.score_bfcl import BUCKETS


def bucket_of(answer: Answer) -> str | None:
    """The bucket of a wrong answer (`wrong_answer` where a run from before has none)."""
    if answer.right:
        return None
    return answer.bucket or ("error" if answer.error else "wrong_answer")


def _ordered(names: set[str]) -> list[str]:
    known = [b for b in BUCKETS if b in names]
    return known + sorted(names - set(BUCKETS))


def per_server(answers: list[Answer]) -> dict[str, int]:
    counts = Counter(b for b in map(bucket_of, answers) if b)
    return {b: counts[b] for b in _ordered(set(counts))}


def paired(rows: list[Row], a: str, b: str) -> list[BucketPair]:
    """One BucketPair per bucket either side fell in, in BUCKETS' order."""
    pairs = [(r.id, bucket_of(r.answers[a]), bucket_of(r.answers[b])) for r in rows]
    seen = {x for _, x, _ in pairs if x} | {y for _, _, y in pairs if y}
    out = []
    for bucket in _ordered(seen):
        a_only = [i for i, x, y in pairs if x == bucket and y is None]
        b_only = [i for i, x, y in pairs if y == bucket and x is None]
        out.append(
            BucketPair(
                bucket=bucket,
                a=sum(x == bucket for _, x, _ in pairs),
                b=sum(y == bucket for _, _, y in pairs),
                a_fails_b_passes=len(a_only),
                b_fails_a_passes=len(b_only),
                both=sum(x == y == bucket for _, x, y in pairs),
                a_fails_b_passes_ids=a_only,
                b_fails_a_passes_ids=b_only,
            )
        )
    return out


def server_table(totals: list, fmt: str) -> str:
    """Buckets down, servers across: how each server's wrong answers fall."""
    names = _ordered({b for t in totals for b in t.buckets})
    if not names:
        return ""
    rows = [[b, *(t.buckets.get(b, 0) for t in totals)] for b in names]
    return tabulate(rows, headers=["wrong by", *(t.server for t in totals)], tablefmt=fmt)


def paired_table(p: Paired, a: str, b: str, fmt: str) -> str:
    if not p.buckets:
        return ""
    rows = [[x.bucket, x.a, x.b, x.a_fails_b_passes, x.b_fails_a_passes, x.both] for x in p.buckets]
    headers = ["bucket", a, b, f"{a} fails, {b} right", f"{b} fails, {a} right", "both"]
    return tabulate(rows, headers=headers, tablefmt=fmt)
