"""Totals, the paired table and REPORT.md, computed from the stored rows alone (so a resumed or
rebuilt run reports exactly what a run from scratch would)."""

from __future__ import annotations

import json

from tabulate import tabulate

from bench.eval import buckets
from bench.eval.models import Answer, EvalResult, Paired, Row, ServerSpec, Total
from bench.eval.stats import mcnemar_exact, wilson


def said(answer: Answer, by_tokens: bool = False) -> str:
    """What a server said, as one comparable string: its token ids where both servers gave
    them (text differs over a broken byte run each side renders its own way), else its text and
    calls (or its error)."""
    if answer.error:
        return f"error: {answer.error}"
    if by_tokens:
        return json.dumps(answer.token_ids)
    calls = [json.dumps(c, sort_keys=True) for c in answer.tool_calls]
    return json.dumps([answer.text or "", calls])


def totals(rows: list[Row], servers: list[ServerSpec]) -> list[Total]:
    out = []
    for s in servers:
        name = s.name or ""
        answers = [r.answers[name] for r in rows if name in r.answers]
        right = sum(a.right for a in answers)
        n = len(answers)
        low, high = wilson(right, n)
        out.append(
            Total(
                server=name,
                base_url=s.base_url,
                model=s.model or "",
                right=right,
                answered=n,
                errors=sum(a.error is not None for a in answers),
                rate=round(right / n, 4) if n else 0.0,
                ci95=(round(low, 4), round(high, 4)),
                buckets=buckets.per_server(answers),
            )
        )
    return out


def paired(rows: list[Row], a: str, b: str) -> Paired:
    """The 2x2 table of verdicts question by question, McNemar's p, and the ids that differ."""
    cells = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    only_a, only_b, differ = [], [], []
    same = 0
    for r in rows:
        x, y = r.answers[a], r.answers[b]
        cells[(x.right, y.right)] += 1
        if x.right and not y.right:
            only_a.append(r.id)
        elif y.right and not x.right:
            only_b.append(r.id)
        tokens = x.token_ids is not None and y.token_ids is not None
        if said(x, tokens) == said(y, tokens):
            same += 1
        else:
            differ.append(r.id)
    return Paired(
        both_right=cells[(True, True)],
        only_a=cells[(True, False)],
        only_b=cells[(False, True)],
        both_wrong=cells[(False, False)],
        same_answer=same,
        mcnemar_p=round(mcnemar_exact(len(only_a), len(only_b)), 6),
        only_a_ids=only_a,
        only_b_ids=only_b,
        differing_ids=differ,
        buckets=buckets.paired(rows, a, b),
    )


def totals_table(result: EvalResult, fmt: str) -> str:
    rows = [
        [t.server, t.model, f"{t.right}/{t.answered}", f"{100 * t.rate:.1f}%",
         f"{100 * t.ci95[0]:.1f}-{100 * t.ci95[1]:.1f}%", t.errors]
        for t in result.totals
    ]  # fmt: skip
    headers = ["server", "model", "right", "rate", "95% interval", "errors"]
    return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)


def paired_table(result: EvalResult, fmt: str) -> str:
    p = result.paired
    if p is None:
        return ""
    a, b = result.totals[0].server, result.totals[1].server
    rows = [
        [f"{a} right", p.both_right, p.only_a],
        [f"{a} wrong", p.only_b, p.both_wrong],
    ]
    return tabulate(rows, headers=["", f"{b} right", f"{b} wrong"], tablefmt=fmt)


def ids_line(ids: list[str], most: int = 20) -> str:
    shown = ", ".join(ids[:most])
    return shown + (f" (+{len(ids) - most} more)" if len(ids) > most else "") if ids else "none"


def markdown(result: EvalResult) -> str:
    """REPORT.md: what ran, the totals, the paired table and the ids that differ."""
    lines = [
        f"# Evaluation {result.run_id}",
        "",
        f"Suite `{result.suite}`, {result.questions} questions, greedy, both servers through "
        "their own chat template (/v1/chat/completions). Per-question answers: "
        f"`{result.answers_path}`.",
        "",
        totals_table(result, "github"),
        "",
    ]
    by_bucket = buckets.server_table(result.totals, "github")
    if by_bucket:
        lines += ["Wrong answers by bucket:", "", by_bucket, ""]
    p = result.paired
    if p is not None:
        a, b = result.totals[0].server, result.totals[1].server
        lines += [
            paired_table(result, "github"),
            "",
            f"McNemar exact p = {p.mcnemar_p:.4g} ({p.only_a} only {a}, {p.only_b} only {b}); "
            f"the same answer on {p.same_answer} of {result.questions}.",
            "",
            f"- only {a} right: {ids_line(p.only_a_ids)}",
            f"- only {b} right: {ids_line(p.only_b_ids)}",
            f"- answers differ: {ids_line(p.differing_ids)}",
            "",
        ]
        pair_buckets = buckets.paired_table(p, a, b, "github")
        if pair_buckets:
            lines += ["Failure buckets, paired question by question:", "", pair_buckets, ""]
            lines += [
                f"- {x.bucket}: {a} fails, {b} right: {ids_line(x.a_fails_b_passes_ids, 10)}; "
                f"{b} fails, {a} right: {ids_line(x.b_fails_a_passes_ids, 10)}"
                for x in p.buckets
                if x.a_fails_b_passes or x.b_fails_a_passes
            ]
            lines.append("")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines).rstrip() + "\n"
