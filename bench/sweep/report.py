"""The sweep's report, rebuilt from its files alone: REPORT.md, results.json, results.csv, PNGs.

results.json holds everything (the plan, every cell with every request, the summary, the
roofline); results.csv one row per cell and repeat; REPORT.md the tables a person reads: the
main table (output tok/s and per-stream tok/s per target, winner and ratio), TTFT, the roofline,
repeat-to-repeat variation, failures and throttling notes.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path

from tabulate import tabulate

from bench.sweep.aggregate import add_c1_shares, failure_lines, search_answers, summarize
from bench.sweep.gate import evaluate as evaluate_gate
from bench.sweep.gate_models import GateReport
from bench.sweep.gate_report import MARK as GATE_MARK
from bench.sweep.gate_report import gate_section, mark_rows
from bench.sweep.models import (
    VARIATION_FLAG,
    CellRecord,
    Roofline,
    SearchAnswer,
    SummaryRow,
    SweepConfig,
    TargetCell,
    load_name,
)
from bench.sweep.plots import make_plots
from bench.sweep.report_cells import CSV_EXTRA, cell_sections, csv_extra
from bench.sweep.report_notes import telemetry_notes
from bench.sweep.saturation import axis_stops
from bench.sweep.store import SweepStore
from tools.fileio import write_atomic

Cell = Callable[[TargetCell], str]
CSV_FIELDS = [
    "target",
    "input_len",
    "concurrency",
    "repeat",
    "seed",
    "driver",
    "status",
    "reason",
    "n_requests",
    "completed",
    "failed",
    "short_outputs",
    "long_outputs",
    "duration_s",
    "input_tokens",
    "output_tokens",
    "output_tok_s",
    "per_stream_tok_s",
    "req_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "rate",
    "scheduled_rate",
    "achieved_rate",
    "slo_met",
    "goodput_req_s",
    "slo_share",
    "ttft_cold_ms",
    "ttft_warm_ms",
    "mean_prompt_tokens",
]


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _load_cols(row: SummaryRow, with_rate: bool) -> list[str]:
    """The row's input and load cells: conc (a cap, or '-' for none, on rate rows), rate."""
    n = "dataset" if row.input_len == 0 else str(row.input_len)
    conc = str(row.concurrency) if row.concurrency else "-"
    cols = [n, conc]
    if with_rate:
        cols.append("-" if row.rate is None else f"{row.rate:g}/s")
    return cols


def _has_rate(rows: list[SummaryRow]) -> bool:
    return any(r.rate is not None for r in rows)


def _load_headers(rows: list[SummaryRow]) -> list[str]:
    return ["input", "conc", *(["rate"] if _has_rate(rows) else [])]


def main_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    """Per (input, load): each target's output tok/s (per-stream tok/s), winner, ratio."""
    labels = [t.label for t in config.targets]
    headers = [*_load_headers(rows), *[f"{lab} tok/s (per stream)" for lab in labels]]
    if len(labels) > 1:
        headers += ["winner", "ratio"]
    body = []
    for row in rows:
        line = _load_cols(row, _has_rate(rows))
        for tc in row.targets:
            if tc.output_tok_s is None:
                line.append(f"FAILED: {(tc.reason or '')[:40]}")
                continue
            mark = " ~" if tc.variable else ""
            mark += GATE_MARK if tc.gate_departs else ""
            mark += " (partial)" if tc.status == "partial" else ""
            line.append(f"{_f(tc.output_tok_s, 2)} ({_f(tc.per_stream_tok_s, 2)}){mark}")
        if len(labels) > 1:
            line += [row.winner or "-", f"{row.ratio:.2f}x" if row.ratio else "-"]
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _detail_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    labels = [t.label for t in config.targets]
    headers = _load_headers(rows)
    for lab in labels:
        headers += [f"{lab} TTFT p50 ms", f"{lab} TTFT p99 ms", f"{lab} req/s", f"{lab} spread"]
    body = []
    for row in rows:
        line = _load_cols(row, _has_rate(rows))
        for tc in row.targets:
            spread = "-" if tc.variation is None else f"{tc.variation:.1%}"
            line += [_f(tc.ttft_p50_ms), _f(tc.ttft_p99_ms), _f(tc.req_s, 3), spread]
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _pm(tc: TargetCell, name: str, digits: int = 1) -> str:
    mean, half = tc.mean.get(name), tc.ci95.get(name)
    if mean is None:
        return "-"
    return f"{mean:,.{digits}f}" + ("" if half is None else f" ± {half:,.{digits}f}")


def per_target_table(
    config: SweepConfig, rows: list[SummaryRow], columns: list[tuple[str, Cell]]
) -> str:
    """One line per (input, load), and for each target the given (header, value) columns."""
    headers = _load_headers(rows)
    for t in config.targets:
        headers += [f"{t.label} {name}" for name, _ in columns]
    body = []
    for row in rows:
        line = _load_cols(row, _has_rate(rows))
        for tc in row.targets:
            line += [value(tc) for _, value in columns]
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _share(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}%}"


def ci_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    """Means over repeats with their 95% intervals, beside the medians of the main table."""
    return per_target_table(config, rows, [
        ("tok/s", lambda tc: _pm(tc, "output_tok_s", 2)),
        ("TTFT p50 ms", lambda tc: _pm(tc, "ttft_p50_ms")),
        ("TPOT p50 ms", lambda tc: _pm(tc, "tpot_p50_ms", 2)),
    ])  # fmt: skip


def slo_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    """Per cell: met in every repeat (yes/no), goodput (req/s meeting every SLO), share."""
    return per_target_table(config, rows, [
        ("SLO met", lambda tc: "-" if tc.slo_met is None else ("yes" if tc.slo_met else "no")),
        ("goodput req/s", lambda tc: _f(tc.goodput_req_s, 3)),
        ("share met", lambda tc: _share(tc.slo_share)),
    ])  # fmt: skip


def rate_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    """Open-loop rows: offered, achieved (sends), completed req/s and latency."""
    labels = [t.label for t in config.targets]
    headers = ["input", "conc", "offered req/s"]
    for lab in labels:
        headers += [f"{lab} achieved req/s", f"{lab} completed req/s", f"{lab} E2E p50 ms"]
    body = []
    for row in rows:
        if row.rate is None:
            continue
        line = _load_cols(row, False) + [f"{row.rate:g}"]
        for tc in row.targets:
            line += [_f(tc.achieved_rate, 3), _f(tc.req_s, 3), _f(tc.e2e_p50_ms)]
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def prefix_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    """Shared prefixes: each server's prefix-cache hit rate (its counters) and the TTFT of a
    group's first request against the rest of its group (what the cache buys)."""
    return per_target_table(config, rows, [
        ("hit rate", lambda tc: _share(tc.prefix_cache_hit_rate, 1)),
        ("TTFT first ms", lambda tc: _f(tc.ttft_cold_ms)),
        ("TTFT rest ms", lambda tc: _f(tc.ttft_warm_ms)),
    ])  # fmt: skip


def search_section(config: SweepConfig, answers: list[SearchAnswer]) -> list[str]:
    """The search's answer, first thing in the report: one number per target and input."""
    if config.search is None:
        return []
    spec = config.search
    slo = ", ".join(f"{k} <= {v:g}" for k, v in config.slo.items())
    unit = "concurrency" if spec.axis == "concurrency" else "request rate (req/s)"
    body = []
    for a in answers:
        if a.answer is None:
            best = f"none: {a.reason or 'not measured'}"
        else:
            best = f"{a.answer:g}" + (" (the search's max)" if a.capped else "")
        trail = ", ".join(f"{lv.load:g} {'pass' if lv.passed else 'fail'}" for lv in a.levels)
        n = "dataset" if a.input_len == 0 else str(a.input_len)
        body.append([a.target, n, best, "-" if a.first_fail is None else f"{a.first_fail:g}",
                     f"{a.cells}", trail + ("" if a.done else " (unfinished)")])  # fmt: skip
    headers = ["target", "input", f"highest {unit} meeting the SLO", "first failing", "cells",
               "levels measured"]  # fmt: skip
    return [
        f"## SLO search: {slo}",
        "",
        tabulate(body, headers=headers, tablefmt="github", disable_numparse=True),
        "",
        f"Doubling from {spec.start:g}, then bisection; a level passes when all {config.repeats} "
        "repeat(s) meet every SLO percentile (failed requests count as infinitely slow).",
        "",
    ]


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def _roofline_table(roofline: list[Roofline]) -> str:
    body = []
    for r in roofline:
        shares = ", ".join(f"in {k}: {v:.1%}" for k, v in r.c1_share.items()) or "-"
        body.append(
            [
                r.target,
                _bytes(r.bytes_per_token),
                _f(r.bandwidth_gb_s),
                _f(r.ceiling_tok_s),
                shares,
                r.missing or "",
            ]
        )
    headers = ["target", "bytes/token", "read GB/s", "ceiling tok/s", "c=1 share", "missing"]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def render_markdown(
    config: SweepConfig,
    rows: list[SummaryRow],
    cells: list[CellRecord],
    roofline: list[Roofline],
    failures: list[str],
    plots: list[str],
    plot_note: str | None,
    answers: list[SearchAnswer] | None = None,
    gate: GateReport | None = None,
) -> str:
    answers = answers or []
    targets = "\n".join(
        f"- **{t.label}**: "
        + (t.base_url or f"started by the sweep: {json.dumps(t.server, sort_keys=True)}")
        for t in config.targets
    )
    expected = len(config.cell_keys())
    flagged = [
        f"{tc.target} in={r.input_len} {load_name(r.concurrency, r.rate)}: {tc.variation:.1%}"
        for r in rows
        for tc in r.targets
        if tc.variable and tc.variation is not None
    ]
    spread = max((tc.variation or 0.0 for r in rows for tc in r.targets), default=0.0)
    load = []
    if config.concurrency:
        load.append(f"concurrency {config.concurrency} (closed loop)")
    if config.request_rate:
        cap = f", at most {config.max_concurrency} in flight" if config.max_concurrency else ""
        kind = "Poisson" if config.burstiness == 1 else f"gamma, burstiness {config.burstiness:g}"
        load.append(f"request rates {config.request_rate} req/s (open loop, {kind}{cap})")
    if config.search is not None:
        load.append(f"an SLO search over {config.search.axis}")
    approx = config.prompt_source == "approximate-text"
    parts = [
        f"# Sweep {config.sweep_id}",
        "",
        *search_section(config, answers),
        f"Driver `{config.driver}`, input lengths {config.input_lens}, output {config.output_len} "
        f"tokens (ignore_eos), {'; '.join(load)}, {config.repeats} repeat(s), seed "
        f"{config.seed}; workload: {config.workload.describe()}; the same prompts for every "
        f"target (a seed per input length and repeat). Cells: {len(cells)}"
        + (f" of {expected}" if expected else "")
        + ". Medians over repeats; per stream = 1000 / median TPOT.",
        "",
        f"Prompts: {config.prompt_source_note or config.prompt_source}."
        + (" **Input lengths are approximate.**" if approx else ""),
        "",
        targets,
        "",
        "## Output tok/s (per-stream tok/s)",
        "",
        main_table(config, rows),
        "",
        f"`~`: repeat-to-repeat variation of output tok/s above {VARIATION_FLAG:.0%}.",
        "",
        *gate_section(gate),
        "## Means over repeats with 95% intervals",
        "",
        ci_table(config, rows),
        "",
        "Mean ± half-width of the 95% interval (Student's t over the repeats; none for one).",
        "",
        *(
            [
                "## SLO and goodput",
                "",
                slo_table(config, rows),
                "",
                "Goodput: requests meeting every SLO per second (vLLM's request_goodput); share: of "
                "the requests sent.",
                "",
            ]
            if config.slo
            else []
        ),  # fmt: skip
        *(
            [
                "## Request rate: offered and achieved",
                "",
                rate_table(config, rows),
                "",
                "Achieved: (n - 1) / (last send - first send); completed: requests over the cell's "
                "time (first send to last byte).",
                "",
            ]
            if _has_rate(rows)
            else []
        ),  # fmt: skip
        *(
            ["## Shared prefixes", "", prefix_table(config, rows), ""]
            if config.workload.prefix_len
            else []
        ),  # fmt: skip
        "## Time to first token, request rate, spread over repeats",
        "",
        _detail_table(config, rows),
        "",
        f"Largest repeat-to-repeat variation: {spread:.1%}."
        + (f" Flagged: {'; '.join(flagged)}." if flagged else ""),
        "",
        "## Roofline (batch-1 decode ceiling)",
        "",
        _roofline_table(roofline) if roofline else "Not measured.",
        "",
        "Bytes per token from the safetensors headers: the decoder's linears with their scales "
        "and the output layer (a tied embedding counted once); not the per-layer embedding "
        "rows (a lookup), not vision or audio towers.",
        "",
        *cell_sections(config, cells, roofline, axis_stops(config, cells)),
        "## Failures",
        "",
        "\n".join(f"- {line}" for line in failures)
        if failures
        else "None: every request completed.",
        "",
        "## Telemetry",
        "",
        "\n".join(f"- {n}" for n in telemetry_notes(cells)) or "Nothing notable.",
        "",
        "## Plots",
        "",
        "\n".join(f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots) or (plot_note or ""),
        "",
    ]
    return "\n".join(parts)


def cells_csv(cells: list[CellRecord]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS + CSV_EXTRA, lineterminator="\n")
    writer.writeheader()
    for c in sorted(
        cells, key=lambda c: (c.target, c.input_len, c.rate or 0.0, c.concurrency, c.repeat)
    ):
        data = {**c.model_dump(include=set(CSV_FIELDS)), **csv_extra(c)}
        writer.writerow({k: "" if data.get(k) is None else data[k] for k in CSV_FIELDS + CSV_EXTRA})
    return buf.getvalue()


def build_report(store: SweepStore) -> dict:
    """Write REPORT.md, results.json, results.csv and plots/ from the sweep's files; returns
    the pieces run_sweep hands back."""
    config = store.load_config()
    cells = store.load_cells()
    rows = summarize(config, cells)
    roofline = store.load_roofline() or []
    add_c1_shares(roofline, rows)
    failures = failure_lines(cells)
    answers = search_answers(config, cells)
    gate = evaluate_gate(config, cells)
    mark_rows(rows, gate)
    plots, plot_note = make_plots(config, rows, store.dir / "plots")
    markdown = render_markdown(
        config, rows, cells, roofline, failures, plots, plot_note, answers, gate
    )
    results = {
        "config": config.model_dump(),
        "search": [a.model_dump() for a in answers],
        "roofline": [r.model_dump() for r in roofline],
        "summary": [r.model_dump() for r in rows],
        "failures": failures,
        "gate": gate.model_dump() if gate else None,
        "axis_stops": [s.model_dump() for s in axis_stops(config, cells)],
        "cells": [c.model_dump() for c in cells],
    }
    write_atomic(store.dir / "results.json", json.dumps(results, separators=(",", ":")) + "\n")
    write_atomic(store.dir / "results.csv", cells_csv(cells))
    write_atomic(store.dir / "REPORT.md", markdown)
    return {
        "report": str(store.dir / "REPORT.md"),
        "results_json": str(store.dir / "results.json"),
        "results_csv": str(store.dir / "results.csv"),
        "plots": plots,
        "plots_dir": str(store.dir / "plots"),
        "plot_note": plot_note,
        "gate": gate,
        "summary": rows,
        "search": answers,
        "roofline": roofline,
        "failures": failures,
        "table": main_table(config, rows),
    }
