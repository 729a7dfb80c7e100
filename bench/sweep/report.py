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
from pathlib import Path

from tabulate import tabulate

from bench.sweep.aggregate import add_c1_shares, failure_lines, summarize
from bench.sweep.models import VARIATION_FLAG, CellRecord, Roofline, SummaryRow, SweepConfig
from bench.sweep.plots import make_plots
from bench.sweep.store import SweepStore
from tools.fileio import write_atomic

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
]


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    """Per (input, concurrency): each target's output tok/s (per-stream tok/s), winner, ratio."""
    labels = [t.label for t in config.targets]
    headers = ["input", "conc", *[f"{lab} tok/s (per stream)" for lab in labels]]
    if len(labels) > 1:
        headers += ["winner", "ratio"]
    body = []
    for row in rows:
        line = [str(row.input_len), str(row.concurrency)]
        for tc in row.targets:
            if tc.output_tok_s is None:
                line.append(f"FAILED: {(tc.reason or '')[:40]}")
                continue
            mark = " ~" if tc.variable else ""
            mark += " (partial)" if tc.status == "partial" else ""
            line.append(f"{_f(tc.output_tok_s, 2)} ({_f(tc.per_stream_tok_s, 2)}){mark}")
        if len(labels) > 1:
            line += [row.winner or "-", f"{row.ratio:.2f}x" if row.ratio else "-"]
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _detail_table(config: SweepConfig, rows: list[SummaryRow]) -> str:
    labels = [t.label for t in config.targets]
    headers = ["input", "conc"]
    for lab in labels:
        headers += [f"{lab} TTFT p50 ms", f"{lab} TTFT p99 ms", f"{lab} req/s", f"{lab} spread"]
    body = []
    for row in rows:
        line = [str(row.input_len), str(row.concurrency)]
        for tc in row.targets:
            spread = "-" if tc.variation is None else f"{tc.variation:.1%}"
            line += [_f(tc.ttft_p50_ms), _f(tc.ttft_p99_ms), _f(tc.req_s, 3), spread]
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


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


def _telemetry_notes(cells: list[CellRecord]) -> list[str]:
    notes: list[str] = []
    missing = {c.telemetry.gpu_missing for c in cells if c.telemetry.gpu_missing}
    if missing:
        notes.append(f"No GPU telemetry: {'; '.join(sorted(missing))}.")
    for c in cells:
        g = c.telemetry.gpu
        if g is None:
            continue
        busy = {k: v for k, v in g.throttle.items() if v >= 0.2 and k != "gpu_idle"}
        if busy:
            what = ", ".join(f"{k} {v:.0%} of samples" for k, v in busy.items())
            clock = f"SM clock at {g.clock_share:.0%} of max" if g.clock_share else ""
            notes.append(f"{c.key().name()}: throttled ({what}) {clock}".rstrip())
    gpus: dict[str, list] = {}
    for c in cells:
        if c.telemetry.gpu is not None:
            gpus.setdefault(c.target, []).append(c.telemetry.gpu)
    for t, gs in gpus.items():
        util = [g.util_max for g in gs if g.util_max is not None]
        clock = [g.clock_share for g in gs if g.clock_share is not None]
        power = [g.power_mean_w for g in gs if g.power_mean_w is not None]
        limit = next((g.power_limit_w for g in gs if g.power_limit_w), None)
        notes.append(
            f"{t}: {gs[0].name or 'GPU'} utilization up to {max(util, default=0):.0f}%, SM clock "
            f"{min(clock, default=0):.0%}-{max(clock, default=0):.0%} of max, power up to "
            f"{max(power, default=0):.0f} W"
            + (f" of {limit:.0f} W" if limit else "")
            + f" ({sum(g.samples for g in gs)} samples)."
        )
    cpu = [c for c in cells if c.telemetry.server_cpu_cores is not None]
    if cpu:
        by_target: dict[str, list[float]] = {}
        for c in cpu:
            by_target.setdefault(c.target, []).append(c.telemetry.server_cpu_cores or 0.0)
        for t, xs in by_target.items():
            notes.append(f"{t}: server process CPU {min(xs):.2f}-{max(xs):.2f} cores during cells.")
    batched = [c for c in cells if c.telemetry.decode_rows_per_step is not None]
    if batched:
        per: dict[tuple[str, int], list[float]] = {}
        for c in batched:
            per.setdefault((c.target, c.concurrency), []).append(c.telemetry.decode_rows_per_step)
        parts = [f"{t} c={conc}: {max(xs):.1f}" for (t, conc), xs in sorted(per.items())]
        notes.append("Engine sequences per decode step (batching): " + ", ".join(parts) + ".")
    hits = [c for c in cells if c.telemetry.prefix_cache_hit_rate is not None]
    if hits:
        worst = max(hits, key=lambda c: c.telemetry.prefix_cache_hit_rate or 0.0)
        notes.append(
            f"Prefix cache hit rate up to {worst.telemetry.prefix_cache_hit_rate:.1%} "
            f"({worst.key().name()})."
        )
    return notes


def render_markdown(
    config: SweepConfig,
    rows: list[SummaryRow],
    cells: list[CellRecord],
    roofline: list[Roofline],
    failures: list[str],
    plots: list[str],
    plot_note: str | None,
) -> str:
    targets = "\n".join(
        f"- **{t.label}**: "
        + (t.base_url or f"started by the sweep: {json.dumps(t.server, sort_keys=True)}")
        for t in config.targets
    )
    expected = len(config.cell_keys())
    flagged = [
        f"{tc.target} in={r.input_len} c={r.concurrency}: {tc.variation:.1%}"
        for r in rows
        for tc in r.targets
        if tc.variable and tc.variation is not None
    ]
    spread = max((tc.variation or 0.0 for r in rows for tc in r.targets), default=0.0)
    parts = [
        f"# Sweep {config.sweep_id}",
        "",
        f"Driver `{config.driver}`, input lengths {config.input_lens}, output {config.output_len} "
        f"tokens (ignore_eos), concurrency {config.concurrency}, {config.repeats} repeat(s), "
        f"seed {config.seed}; the same prompt token ids for every target (a seed per input "
        f"length and repeat). Cells: {len(cells)} of {expected}. Medians over repeats; "
        "per stream = 1000 / median TPOT.",
        "",
        targets,
        "",
        "## Output tok/s (per-stream tok/s)",
        "",
        main_table(config, rows),
        "",
        f"`~`: repeat-to-repeat variation of output tok/s above {VARIATION_FLAG:.0%}.",
        "",
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
        "## Failures",
        "",
        "\n".join(f"- {line}" for line in failures)
        if failures
        else "None: every request completed.",
        "",
        "## Telemetry",
        "",
        "\n".join(f"- {n}" for n in _telemetry_notes(cells)) or "Nothing notable.",
        "",
        "## Plots",
        "",
        "\n".join(f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots) or (plot_note or ""),
        "",
    ]
    return "\n".join(parts)


def cells_csv(cells: list[CellRecord]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for c in sorted(cells, key=lambda c: (c.target, c.input_len, c.concurrency, c.repeat)):
        data = c.model_dump(include=set(CSV_FIELDS))
        writer.writerow({k: "" if data.get(k) is None else data[k] for k in CSV_FIELDS})
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
    plots, plot_note = make_plots(config, rows, store.dir / "plots")
    markdown = render_markdown(config, rows, cells, roofline, failures, plots, plot_note)
    results = {
        "config": config.model_dump(),
        "roofline": [r.model_dump() for r in roofline],
        "summary": [r.model_dump() for r in rows],
        "failures": failures,
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
        "summary": rows,
        "roofline": roofline,
        "failures": failures,
        "table": main_table(config, rows),
    }
