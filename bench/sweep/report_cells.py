"""The report's sections on what happened in and between cells: the cache reset before each,
the GPU's energy beside the roofline share, the stall probes, the warm-up left out, and
over-saturated rate cells with the rate axes stopped early; and their columns in results.csv.
Each section is empty when the sweep did not use its option (none for a sweep without them).
"""

from __future__ import annotations

import statistics
from collections import Counter

from tabulate import tabulate

from bench.sweep.cell_models import AxisStop
from bench.sweep.models import CellRecord, Roofline, SweepConfig, load_name

CSV_EXTRA = ["cache_reset", "excluded", "energy_j", "j_per_output_token", "avg_power_w",
             "probe_ttft_p50_ms", "probe_ttft_p99_ms", "probe_failed", "saturated"]  # fmt: skip


def csv_extra(c: CellRecord) -> dict[str, object]:
    """The cell's values of CSV_EXTRA (None where it has none)."""
    e, p, s = c.telemetry.energy, c.stall_probes, c.saturation
    reset = None if c.cache_reset is None else ("done" if c.cache_reset.done else "not done")
    return {
        "cache_reset": reset,
        "excluded": c.excluded,
        "energy_j": e.energy_j if e else None,
        "j_per_output_token": e.j_per_output_token if e else None,
        "avg_power_w": e.avg_power_w if e else None,
        "probe_ttft_p50_ms": p.ttft_p50_ms if p else None,
        "probe_ttft_p99_ms": p.ttft_p99_ms if p else None,
        "probe_failed": p.failed if p else None,
        "saturated": s.saturated if s else None,
    }


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _groups(cells: list[CellRecord]) -> dict[tuple, list[CellRecord]]:
    """Cells by (input length, cap or concurrency, rate), then target, in the report's order."""
    out: dict[tuple, list[CellRecord]] = {}
    for c in sorted(cells, key=lambda c: (c.input_len, c.rate is not None, c.rate or 0.0,
                                          c.concurrency, c.target)):  # fmt: skip
        out.setdefault((c.input_len, c.concurrency, c.rate), []).append(c)
    return out


def _where(key: tuple) -> str:
    n, conc, rate = key
    return f"in={'dataset' if n == 0 else n} {load_name(conc, rate)}"


def cache_lines(config: SweepConfig, cells: list[CellRecord]) -> list[str]:
    """One line per target: how many cells began with their cache emptied, and how (or why
    not)."""
    if not config.cache_reset:
        return ["Off (--no-cache-reset): cells may find earlier cells' prompts in the cache."]
    lines = []
    for t in config.targets:
        mine = [c for c in cells if c.target == t.label and c.cache_reset is not None]
        if not mine:
            continue
        done = sum(1 for c in mine if c.cache_reset and c.cache_reset.done)
        details = Counter((c.cache_reset.how or "-", c.cache_reset.detail)
                          for c in mine if c.cache_reset)  # fmt: skip
        said = "; ".join(f"{how}: {detail}" for (how, detail), _ in details.most_common(2))
        state = "reset" if done == len(mine) else ("not supported" if not done else "reset")
        lines.append(f"{t.label}: {state} before {done} of {len(mine)} cells ({said})")
    return lines


def energy_section(
    config: SweepConfig, cells: list[CellRecord], roofline: list[Roofline]
) -> list[str]:
    """J per output token and average power per cell (medians over repeats), beside the
    per-stream speed's share of the target's roofline ceiling."""
    with_energy = [c for c in cells if c.telemetry.energy and c.telemetry.energy.energy_j]
    if not with_energy:
        missing = {c.telemetry.energy.missing for c in cells if c.telemetry.energy}
        missing.discard(None)
        return [f"{'; '.join(sorted(m for m in missing if m)) or 'no energy: not measured'}."]
    ceiling = {r.target: r.ceiling_tok_s for r in roofline if r.ceiling_tok_s}
    headers = ["cell"]
    for t in config.targets:
        headers += [f"{t.label} J/token", f"{t.label} avg W", f"{t.label} roofline %"]
    body = []
    for key, group in _groups(cells).items():
        line = [_where(key)]
        for t in config.targets:
            mine = [c for c in group if c.target == t.label and c.completed]
            jt = _median([c.telemetry.energy.j_per_output_token for c in mine
                          if c.telemetry.energy])  # fmt: skip
            w = _median([c.telemetry.energy.avg_power_w for c in mine if c.telemetry.energy])
            speed = _median([c.per_stream_tok_s for c in mine])
            share = speed / ceiling[t.label] if speed and ceiling.get(t.label) else None
            line += ["-" if jt is None else f"{jt:.4f}", "-" if w is None else f"{w:.0f}",
                     "-" if share is None else f"{share:.1%}"]  # fmt: skip
        body.append(line)
    table = tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)
    return [table, "", "From NVML's energy counter read at each cell's start and end (as vLLM's "
            "benchmarks/lib/energy.py): J/token over completed output tokens; roofline %: "
            "per-stream tok/s over the target's batch-1 ceiling."]  # fmt: skip


def probe_section(config: SweepConfig, cells: list[CellRecord]) -> list[str]:
    """The stall probes' TTFT per cell (medians over repeats; sent and failed summed)."""
    if not config.probe_rate:
        return []
    headers = ["cell"] + [f"{t.label} probe TTFT p50 / p99 ms (sent, failed)"
                          for t in config.targets]  # fmt: skip
    body = []
    for key, group in _groups(cells).items():
        line = [_where(key)]
        for t in config.targets:
            ps = [c.stall_probes for c in group if c.target == t.label and c.stall_probes]
            if not ps:
                line.append("-")
                continue
            p50, p99 = _median([p.ttft_p50_ms for p in ps]), _median([p.ttft_p99_ms for p in ps])
            sent, failed = sum(p.sent for p in ps), sum(p.failed for p in ps)
            figures = "-" if p50 is None else f"{p50:,.1f} / {p99 or 0:,.1f}"
            line.append(f"{figures} ({sent}, {failed})")
        body.append(line)
    table = tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)
    return [table, "", f"Single-token requests at {config.probe_rate:g}/s beside each cell's "
            "load, outside its concurrency cap: what the load does to a user arriving "
            "meanwhile."]  # fmt: skip


def steady_lines(config: SweepConfig, cells: list[CellRecord]) -> list[str]:
    if not (config.exclude_first or config.exclude_first_s):
        return []
    rule = " or ".join(
        x for x in (f"the first {config.exclude_first} requests" if config.exclude_first else "",
                    f"those sent in the first {config.exclude_first_s:g} s"
                    if config.exclude_first_s else "") if x
    )  # fmt: skip
    total = sum(c.excluded for c in cells)
    return [f"Warm-up: {rule} of each cell left out of its figures ({total} requests in all, "
            "kept in results.json marked `excluded`)."]  # fmt: skip


def saturation_lines(
    config: SweepConfig, cells: list[CellRecord], stops: list[AxisStop]
) -> list[str]:
    """Over-saturated rate cells, and the rate axes stopped early with why."""
    lines = [f"{c.key().name()}: {c.saturation.reason}" for c in cells
             if c.saturation is not None and c.saturation.saturated]  # fmt: skip
    for s in stops:
        skipped = ", ".join(f"{r:g}/s" for r in s.skipped)
        lines.append(f"**{s.target} in={s.input_len}: the rate axis stopped after {s.rate:g}/s** "
                     f"({s.reason}); not run: {skipped}")  # fmt: skip
    if not lines and any(c.saturation is not None for c in cells):
        lines.append("No rate cell over-saturated: completions kept up with arrivals.")
    return lines


def cell_sections(config: SweepConfig, cells: list[CellRecord], roofline: list[Roofline],
                  stops: list[AxisStop]) -> list[str]:  # fmt: skip
    """REPORT.md's sections for the above, each a heading, its body and a blank line."""
    out: list[str] = []

    def section(title: str, body: list[str], bullets: bool = False) -> None:
        if body:
            lines = [f"- {b}" for b in body] if bullets else body
            out.extend([f"## {title}", "", *lines, ""])

    section("Energy per token (beside the roofline share)", energy_section(config, cells, roofline))
    section("Stall probes", probe_section(config, cells))
    section("Cache resets between cells", cache_lines(config, cells), bullets=True)
    steady = steady_lines(config, cells) + saturation_lines(config, cells, stops)
    section("Steady state and saturation", steady, bullets=True)
    return out
