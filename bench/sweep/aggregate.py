"""From cells to the sweep's answer: medians over repeats, their spread, ratios and the winner.

For each (input length, concurrency) and target: the median of each figure over the repeats
that completed requests, the repeat-to-repeat variation of output tok/s ((max - min) / median,
flagged above 5%), each target's output tok/s over the first target's, and the winner (highest
median output tok/s) with its ratio over the runner-up.
"""

from __future__ import annotations

import statistics
from collections import Counter

from bench.sweep import saturation, search
from bench.sweep.ci import mean_ci
from bench.sweep.models import (
    VARIATION_FLAG,
    CellRecord,
    Roofline,
    SearchAnswer,
    SummaryRow,
    SweepConfig,
    TargetCell,
)

# figures given a mean and a 95% interval over repeats (beside the medians)
CI_FIELDS = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms", "req_s", "goodput_req_s")


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 3) if vals else None


def target_cell(label: str, cells: list[CellRecord]) -> TargetCell:
    usable = [c for c in cells if c.completed > 0]
    if not cells:
        return TargetCell(target=label, status="failed", repeats_ok=0, reason="not run")
    if not usable:
        reasons = Counter(c.reason or "failed" for c in cells)
        return TargetCell(
            target=label, status="failed", repeats_ok=0, reason=reasons.most_common(1)[0][0]
        )
    tok = [c.output_tok_s for c in usable if c.output_tok_s is not None]
    med = _median(tok)
    variation = round((max(tok) - min(tok)) / med, 4) if med and len(tok) > 1 else None
    partial = [c for c in cells if c.status != "ok"]
    means, cis = {}, {}
    for name in CI_FIELDS:
        means[name], cis[name] = mean_ci([getattr(c, name) for c in usable])
    slo_cells = [c for c in cells if c.slo_met is not None]
    hits = [c.telemetry.prefix_cache_hit_rate for c in usable]
    return TargetCell(
        target=label,
        status="partial" if partial else "ok",
        repeats_ok=len(usable),
        output_tok_s=med,
        per_stream_tok_s=_median([c.per_stream_tok_s for c in usable]),
        req_s=_median([c.req_s for c in usable]),
        ttft_p50_ms=_median([c.ttft_p50_ms for c in usable]),
        ttft_p99_ms=_median([c.ttft_p99_ms for c in usable]),
        tpot_p50_ms=_median([c.tpot_p50_ms for c in usable]),
        e2e_p50_ms=_median([c.e2e_p50_ms for c in usable]),
        variation=variation,
        variable=bool(variation is not None and variation > VARIATION_FLAG),
        reason=partial[0].reason if partial else None,
        mean=means,
        ci95=cis,
        achieved_rate=_median([c.achieved_rate for c in usable]),
        goodput_req_s=_median([c.goodput_req_s for c in cells]) if slo_cells else None,
        slo_share=_median([c.slo_share for c in cells]) if slo_cells else None,
        slo_met=all(c.slo_met for c in slo_cells) if slo_cells else None,
        prefix_cache_hit_rate=_median(hits),
        ttft_cold_ms=_median([c.ttft_cold_ms for c in usable]),
        ttft_warm_ms=_median([c.ttft_warm_ms for c in usable]),
    )


def load_levels(config: SweepConfig, cells: list[CellRecord]) -> list[tuple[int, float | None]]:
    """The grid's loads in order, then any a search measured (closed loop, then rate)."""
    levels = list(config.loads())
    extra = sorted(
        {(c.concurrency, c.rate) for c in cells} - set(levels),
        key=lambda x: (x[1] is not None, x[1] or 0.0, x[0]),
    )
    return levels + extra


def summarize(config: SweepConfig, cells: list[CellRecord]) -> list[SummaryRow]:
    stops = saturation.axis_stops(config, cells)  # rates never run: say why, not "not run"
    by_key: dict[tuple, list[CellRecord]] = {}
    for c in cells:
        by_key.setdefault((c.target, c.input_len, c.concurrency, c.rate), []).append(c)
    rows = []
    labels = [t.label for t in config.targets]
    for n in config.input_lens:
        for conc, rate in load_levels(config, cells):
            if config.search is not None and not any(
                (lab, n, conc, rate) in by_key for lab in labels
            ):
                continue
            tcs = [target_cell(lab, by_key.get((lab, n, conc, rate), [])) for lab in labels]
            for tc in tcs:
                stop = next((s for s in stops if (s.target, s.input_len, s.concurrency) ==
                             (tc.target, n, conc) and rate in s.skipped), None)  # fmt: skip
                if tc.reason == "not run" and stop is not None:
                    tc.reason = f"skipped: the rate axis stopped at {stop.rate:g}/s"
            first = tcs[0].output_tok_s
            for tc in tcs:
                if first and tc.output_tok_s is not None:
                    tc.vs_first = round(tc.output_tok_s / first, 4)
            ranked = sorted(
                (tc for tc in tcs if tc.output_tok_s), key=lambda t: t.output_tok_s or 0.0
            )[::-1]
            winner = ranked[0].target if ranked and len(tcs) > 1 else None
            ratio = None
            if len(ranked) > 1 and ranked[1].output_tok_s:
                ratio = round((ranked[0].output_tok_s or 0.0) / ranked[1].output_tok_s, 4)
            rows.append(
                SummaryRow(
                    input_len=n,
                    concurrency=conc,
                    rate=rate,
                    targets=tcs,
                    winner=winner,
                    ratio=ratio,
                )
            )
    return rows


def search_answers(config: SweepConfig, cells: list[CellRecord]) -> list[SearchAnswer]:
    """One answer per target and input length, replayed from the cells on disk."""
    if config.search is None:
        return []
    return [
        search.answer(
            config.search,
            t.label,
            n,
            [c for c in cells if c.target == t.label and c.input_len == n],
            config.repeats,
        )
        for t in config.targets
        for n in config.input_lens
    ]


def add_c1_shares(roofline: list[Roofline], rows: list[SummaryRow]) -> None:
    """Each target's concurrency-1 per-stream speed as a share of its ceiling."""
    for r in roofline:
        if not r.ceiling_tok_s:
            continue
        for row in rows:
            if row.concurrency != 1 or row.rate is not None:
                continue
            tc = next((t for t in row.targets if t.target == r.target), None)
            if tc and tc.per_stream_tok_s:
                r.c1_share[str(row.input_len)] = round(tc.per_stream_tok_s / r.ceiling_tok_s, 4)


def failure_lines(cells: list[CellRecord]) -> list[str]:
    """'target: reason (n cells)' for every failed or partial cause."""
    counts: Counter[tuple[str, str]] = Counter()
    for c in cells:
        if c.status == "failed":
            counts[(c.target, c.reason or "failed")] += 1
        elif c.status == "partial":
            for reason in c.failure_reasons:
                counts[(c.target, reason)] += 1
    return [
        f"{t}: {reason} ({n} cell{'s' if n > 1 else ''})"
        for (t, reason), n in sorted(counts.items())
    ]
