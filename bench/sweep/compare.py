"""compare_sweeps: the same cells of two or more sweeps side by side (GuideLLM's and AIPerf's
multi-run comparison), for "did my change make the server faster?".

Cells are matched on (target label, input length, load); for each figure the table shows every
sweep's mean over its repeats with the 95% interval, and each later sweep's ratio to the first.
A difference is marked (`*`) only where the two intervals do not overlap: with one repeat
there is no interval and nothing is marked, however far apart the numbers are. Beside that, the
paired difference: cell by cell and repeat by repeat (the same seeded prompts in both sweeps),
the mean of later - baseline and the 95% interval of those differences (`*` where it excludes
0), which sees a steady difference that two wide intervals hide. The overlay plots draw every
sweep's line on the same axes, the intervals as error bars.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field
from tabulate import tabulate

from bench.sweep.aggregate import summarize
from bench.sweep.ci import excludes_zero, overlap, paired
from bench.sweep.models import TargetCell, load_name
from bench.sweep.plots import save
from bench.sweep.store import SweepStore
from tools.errors import InvalidInputError
from tools.fileio import write_atomic

FIGURES = (
    ("output_tok_s", "output tok/s", True),
    ("ttft_p50_ms", "TTFT p50 ms", False),
    ("tpot_p50_ms", "TPOT p50 ms", False),
)


class CompareValue(BaseModel):
    sweep: str
    mean: float | None = None
    ci95: float | None = None
    median: float | None = None
    repeats: int = 0
    ratio: float | None = Field(None, description="mean over the first sweep's mean")
    differs: bool = Field(False, description="its 95% interval and the first's do not overlap")
    diff_mean: float | None = Field(None, description="mean of (this - first) per cell repeat")
    diff_ci95: float | None = Field(None, description="half-width of its 95% interval")
    pairs: int = Field(0, description="repeats both sweeps measured in this cell")
    paired_differs: bool = Field(False, description="the paired interval excludes 0")


class CompareRow(BaseModel):
    target: str
    input_len: int
    concurrency: int
    rate: float | None = None
    figure: str
    values: list[CompareValue]


class CompareResult(BaseModel):
    sweeps: list[str] = Field(description="the sweeps' directories, the first is the baseline")
    labels: list[str]
    out_dir: str
    rows: list[CompareRow]
    only_in_some: int = Field(0, description="cells not in every sweep (left out)")
    table: str
    report: str
    plots: list[str] = Field(default_factory=list)


def _cells_of(store: SweepStore) -> dict[tuple, TargetCell]:
    config = store.load_config()
    out = {}
    for row in summarize(config, store.load_cells()):
        for tc in row.targets:
            if tc.repeats_ok:
                out[(tc.target, row.input_len, row.concurrency, row.rate)] = tc
    return out


Repeats = dict[tuple, dict[int, dict[str, float | None]]]


def repeats_of(store: SweepStore) -> Repeats:
    """(target, input, concurrency, rate) -> repeat -> figure -> value, for cells not failed."""
    out: Repeats = {}
    for c in store.load_cells():
        if c.status != "failed":
            figures = {f: getattr(c, f) for f, _, _ in FIGURES}
            out.setdefault((c.target, c.input_len, c.concurrency, c.rate), {})[c.repeat] = figures
    return out


def _labels(stores: list[SweepStore]) -> list[str]:
    ids = [s.load_config().sweep_id for s in stores]
    if len(set(ids)) == len(ids):
        return ids
    return [f"{i + 1}:{s.dir.name}" for i, s in enumerate(stores)]


def compare_rows(
    labels: list[str],
    per_sweep: list[dict[tuple, TargetCell]],
    repeats: list[Repeats] | None = None,
) -> list[CompareRow]:
    """One row per (cell, figure) present in every sweep, in the first sweep's order; with
    `repeats` (each sweep's repeats_of) the paired differences too."""
    common = [k for k in per_sweep[0] if all(k in cells for cells in per_sweep[1:])]
    rows = []
    for key in common:
        target, n, conc, rate = key
        for figure, _title, _higher in FIGURES:
            values = []
            for label, cells in zip(labels, per_sweep, strict=True):
                tc = cells[key]
                values.append(
                    CompareValue(
                        sweep=label,
                        mean=tc.mean.get(figure),
                        ci95=tc.ci95.get(figure),
                        median=getattr(tc, figure),
                        repeats=tc.repeats_ok,
                    )
                )
            base = values[0]
            for v in values[1:]:
                if base.mean and v.mean is not None:
                    v.ratio = round(v.mean / base.mean, 4)
                v.differs = not overlap((base.mean, base.ci95), (v.mean, v.ci95))
            by_repeat = [{r: f[figure] for r, f in sweep.get(key, {}).items()}
                         for sweep in repeats or []]  # fmt: skip
            for v, mine in zip(values[1:], by_repeat[1:], strict=False):
                v.diff_mean, v.diff_ci95, v.pairs = paired(by_repeat[0], mine)
                v.paired_differs = excludes_zero(v.diff_mean, v.diff_ci95)
            rows.append(CompareRow(target=target, input_len=n, concurrency=conc, rate=rate,
                                   figure=figure, values=values))  # fmt: skip
    return rows


def _fmt(v: CompareValue, first: bool) -> str:
    if v.mean is None:
        return "-"
    text = f"{v.mean:,.2f}" + ("" if v.ci95 is None else f" ± {v.ci95:,.2f}")
    if not first and v.ratio is not None:
        text += f" ({v.ratio:.2f}x{' *' if v.differs else ''})"
    return text


def _cell(r: CompareRow) -> list[str]:
    """A row's target, input and load columns."""
    n = "dataset" if r.input_len == 0 else str(r.input_len)
    return [r.target, n, load_name(r.concurrency, r.rate)]


def table(labels: list[str], rows: list[CompareRow], figure: str) -> str:
    body = []
    for r in rows:
        if r.figure != figure:
            continue
        body.append([*_cell(r), *[_fmt(v, i == 0) for i, v in enumerate(r.values)]])
    return tabulate(body, headers=["target", "input", "load", *labels], tablefmt="github",
                    disable_numparse=True)  # fmt: skip


def _fmt_diff(v: CompareValue) -> str:
    if v.diff_mean is None:
        return "-"
    half = "" if v.diff_ci95 is None else f" ± {v.diff_ci95:,.2f}"
    return f"{v.diff_mean:+,.2f}{half} ({v.pairs} pairs){' *' if v.paired_differs else ''}"


def paired_table(labels: list[str], rows: list[CompareRow], figure: str) -> str:
    """Each later sweep's paired difference from the baseline, per cell."""
    body = []
    for r in rows:
        if r.figure != figure:
            continue
        body.append([*_cell(r), *[_fmt_diff(v) for v in r.values[1:]]])
    headers = ["target", "input", "load", *[f"{label} - {labels[0]}" for label in labels[1:]]]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def overlay_plots(labels: list[str], rows: list[CompareRow], out_dir: Path) -> list[str]:
    """Per figure: one panel per (target, input length, loop kind), one line per sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for figure, title, _higher in FIGURES:
        mine = [r for r in rows if r.figure == figure]
        panels = sorted({(r.target, r.input_len, r.rate is not None) for r in mine})
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (target, n, open_loop) in zip(axes[0], panels, strict=True):
            points = [r for r in mine if (r.target, r.input_len, r.rate is not None)
                      == (target, n, open_loop)]  # fmt: skip
            points.sort(key=lambda r: r.rate if open_loop else r.concurrency)
            xs = [r.rate if open_loop else r.concurrency for r in points]
            for i, label in enumerate(labels):
                ys = [r.values[i].mean for r in points]
                err = [r.values[i].ci95 or 0.0 for r in points]
                ax.errorbar(xs, [y if y is not None else float("nan") for y in ys], yerr=err,
                            marker="o", capsize=3, label=label)  # fmt: skip
            ax.set_title(f"{target}, input {n}")
            ax.set_xlabel("offered req/s" if open_loop else "concurrency")
            ax.set_ylabel(title)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        written.append(save(fig, out_dir / f"compare_{figure}.png"))
    return written


def compare_sweeps(sweeps: list[str], out_dir: str | None = None) -> CompareResult:
    """Compare two or more sweeps (directories or ids); the first is the baseline. Writes
    COMPARE.md, compare.json and overlay plots to `out_dir` (default: a new directory beside
    the sweeps)."""
    from bench.sweep.lookup import find_sweep_dir, sweeps_dir

    if len(sweeps) < 2:
        raise InvalidInputError("compare needs two or more sweeps", "pass A B [C ...]")
    stores = [SweepStore(find_sweep_dir(s)) for s in sweeps]
    labels = _labels(stores)
    per_sweep = [_cells_of(s) for s in stores]
    rows = compare_rows(labels, per_sweep, [repeats_of(s) for s in stores])
    if not rows:
        raise InvalidInputError(
            "these sweeps have no cell in common (same target label, input length and load)",
            "compare sweeps of the same plan, e.g. before and after a change",
        )
    all_keys = set().union(*per_sweep)
    only_some = len(all_keys) - len({(r.target, r.input_len, r.concurrency, r.rate) for r in rows})
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir).expanduser().resolve() if out_dir else sweeps_dir() / f"compare-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plots").mkdir(exist_ok=True)
    plots = overlay_plots(labels, rows, out / "plots")
    main = table(labels, rows, "output_tok_s")
    parts = [
        "# Sweep comparison",
        "",
        "Baseline: "
        + labels[0]
        + "; "
        + ", ".join(f"{label} = {s.dir}" for label, s in zip(labels, stores, strict=True)),
        "",
        "Mean over repeats ± half-width of its 95% interval; (ratio to the baseline); `*`: the "
        "intervals do not overlap (a difference the repeats support). No `*` without repeats.",
        "",
    ]
    for figure, title, _ in FIGURES:
        parts += [f"## {title}", "", table(labels, rows, figure), ""]
    parts += [
        "## Paired differences",
        "",
        "Per cell, repeat by repeat (the same seeded prompts in each sweep): the mean of later - "
        "baseline ± half-width of the 95% interval of those differences (Student's t); `*`: "
        "the interval excludes 0. No interval below two pairs.",
        "",
    ]
    for figure, title, _ in FIGURES:
        parts += [f"### {title}, paired", "", paired_table(labels, rows, figure), ""]
    if only_some:
        parts += [f"{only_some} cell(s) are not in every sweep and are left out.", ""]
    parts += ["## Plots", "", *[f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots], ""]
    report = out / "COMPARE.md"
    write_atomic(report, "\n".join(parts))
    result = CompareResult(
        sweeps=[str(s.dir) for s in stores],
        labels=labels,
        out_dir=str(out),
        rows=rows,
        only_in_some=only_some,
        table=main,
        report=str(report),
        plots=plots,
    )
    write_atomic(out / "compare.json", json.dumps(result.model_dump(), indent=1) + "\n")
    return result
