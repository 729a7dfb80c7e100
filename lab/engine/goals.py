"""Issue 26's goals, judged from what `lab/device/goals.sh` leaves in its output folder: one
table of every goal that comes through the product, its figure, the target and met or missed.

    python3 -m lab.engine.goals DIR [--out DIR/goals.md] [--json DIR/goals.json]

DIR holds any of `cold_start.json` (lab.engine.cold_start), `sweep/results.json` (the issue's
sweep, lab.sweep_e2b), `steps.json` (lab.engine.batch_bench throughput), `gemm.json` (the
int4 product's table, lab.engine.gemm_bench) and `long/long_prompt.json` (the long prompts,
lab.engine.long_prompt all); a goal whose file is absent is listed as not measured, so a
partial run (GOALS_PARTS) still gets a table.

Why a tool and not a note written by hand: the goals were re-judged in every session's notes
from three JSON files, and the judgement (which repeat, which warm start, median or worst)
drifted between sessions. Here it is written once: the sweep's means over repeats (what its
report headlines), every warm start (not the best), every first request of every variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tools.fileio import write_atomic

C1_PER_STREAM = 1000.0
AGGREGATE = {8: 3500.0, 16: 5000.0}
STEP_RATIO = 1.3  # the 8-row step against the 1-row step
COLD_S = 60.0
WARM_S = 15.0
FIRST_RATIO = 2.0  # a first request's time to first token against its warm one
PRODUCT_PCT = 50.0  # the int4 product's % of read bandwidth at 8 and 16 rows, every shape
PRODUCT_ROWS = (8, 16)
LONG_TOKENS = 131000
LONG_READ = 15000.0  # the 131k prompt's read under the cap, tok/s
LONG_DECODE = 450.0  # and the decode after it


class Goal(BaseModel):
    """One goal: met is None where its figure was not measured in this folder."""

    name: str
    target: str
    value: str
    met: bool | None
    source: str


class GoalsError(ValueError):
    """A result file that exists but cannot be read as its tool writes it."""


def _load(path: Path) -> Any | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GoalsError(f"{path}: not a readable JSON result ({exc}); rerun the part that "
                         "writes it (lab/device/goals.sh, GOALS_PARTS)") from exc  # fmt: skip


def _missing(name: str, target: str, source: str) -> Goal:
    return Goal(name=name, target=target, value="not measured", met=None, source=source)


def sweep_goals(results: dict[str, Any] | None) -> list[Goal]:
    """c = 1 per stream and c = 8 / 16 aggregate, from the sweep's summary (means over repeats;
    per stream: 1000 / the median TPOT, as the sweep's report)."""
    src = "sweep/results.json"
    cells: dict[int, dict[str, Any]] = {}
    if results is not None:
        try:
            for row in results["summary"]:
                for t in row["targets"]:
                    if t.get("status") == "ok":
                        cells[int(row["concurrency"])] = t
        except (KeyError, TypeError) as exc:
            raise GoalsError(f"{src}: no sweep summary in it ({exc!r}); rerun the sweep part "
                         "of goals.sh (GOALS_PARTS=sweep)") from exc  # fmt: skip
    goals = []
    c1 = cells.get(1)
    name, target = "c = 1, tok/s per stream", f">= {C1_PER_STREAM:,.0f}"
    if c1 is None:
        goals.append(_missing(name, target, src))
    else:
        v = float(c1["per_stream_tok_s"])
        goals.append(Goal(name=name, target=target, value=f"{v:,.1f} (TPOT {c1['tpot_p50_ms']} ms)",
                          met=v >= C1_PER_STREAM, source=src))  # fmt: skip
    for conc, floor in AGGREGATE.items():
        cell = cells.get(conc)
        name, target = f"c = {conc}, tok/s aggregate", f">= {floor:,.0f}"
        if cell is None:
            goals.append(_missing(name, target, src))
            continue
        mean = float(cell.get("mean", {}).get("output_tok_s", cell["output_tok_s"]))
        ci = cell.get("ci95", {}).get("output_tok_s")
        spread = f" +- {ci:,.1f}" if ci else ""
        goals.append(Goal(name=name, target=target, value=f"{mean:,.1f}{spread}",
                          met=mean >= floor, source=src))  # fmt: skip
    return goals


def step_goal(steps: dict[str, Any] | None) -> list[Goal]:
    """The 8-row decode step within 1.3x of the 1-row step: fresh and at depth where given."""
    name, target, src = "8-row step / 1-row step", f"<= {STEP_RATIO}x", "steps.json"
    if steps is None:
        return [_missing(name, target, src)]
    goals = []
    for key, label in (("buckets", ""), ("buckets_at_depth", ", at depth")):
        by_rows = {int(b["rows"]): float(b["step_us"]) for b in steps.get(key) or []}
        if 1 in by_rows and 8 in by_rows:
            ratio = by_rows[8] / by_rows[1]
            goals.append(Goal(name=name + label, target=target, met=ratio <= STEP_RATIO,
                              value=f"{ratio:.2f}x ({by_rows[8]:,.0f} / {by_rows[1]:,.0f} us)",
                              source=src))  # fmt: skip
    return goals or [_missing(name, target, src)]


def start_goals(runs: list[dict[str, Any]] | None) -> list[Goal]:
    """Ready cold within 60 s, every warm start (the engine in its own process: `warm`) within
    15 s, and every first request within 2x its warm time to first token."""
    src = "cold_start.json"
    if runs is None:
        return [_missing("cold start, ready", f"<= {COLD_S:.0f} s", src),
                _missing("warm start, ready", f"<= {WARM_S:.0f} s", src),
                _missing("first request / warm TTFT", f"<= {FIRST_RATIO}x", src)]  # fmt: skip
    if not isinstance(runs, list):
        raise GoalsError(f"{src}: expected the list of variants lab.engine.cold_start writes")
    goals = []
    for variant, limit, label in (("cold", COLD_S, "cold start, ready"),
                                  ("warm", WARM_S, "warm start, ready"),
                                  ("warm_in_process", WARM_S,
                                   "warm start, engine in the server's process")):  # fmt: skip
        ready = [float(r["ready_s"]) for r in runs if r.get("variant") == variant
                 and r.get("ready_s") is not None]  # fmt: skip
        if not ready:
            if variant != "warm_in_process":
                goals.append(_missing(label, f"<= {limit:.0f} s", src))
            continue
        value = " / ".join(f"{s:.1f} s" for s in ready)
        goals.append(Goal(name=label, target=f"<= {limit:.0f} s", value=value,
                          met=max(ready) <= limit, source=src))  # fmt: skip
    ratios = [(float(q["ratio"]), int(q["tokens"]), r.get("variant", "?")) for r in runs
              for q in r.get("requests") or [] if q.get("ratio") is not None]  # fmt: skip
    name, target = "first request / warm TTFT", f"<= {FIRST_RATIO}x"
    if not ratios:
        goals.append(_missing(name, target, src))
    else:
        worst, tokens, variant = max(ratios)
        goals.append(Goal(name=name, target=target, met=worst <= FIRST_RATIO, source=src,
                          value=f"worst {worst:.2f}x ({tokens} tokens, {variant})"))  # fmt: skip
    return goals


def product_goals(gemm: dict[str, Any] | None) -> list[Goal]:
    """The int4 product as the engine runs it (`w4_gemm`) at 8 and 16 rows at >= 50% of the
    card's read bandwidth on every shape of the table: the worst shape decides."""
    src = "gemm.json"
    goals = []
    for m in PRODUCT_ROWS:
        name = f"int4 product at {m} rows, % of bandwidth"
        target = f">= {PRODUCT_PCT:.0f}% every shape"
        try:
            cells = [c for c in (gemm or {}).get("cells", [])
                     if c["method"] == "w4_gemm" and c["m"] == m and "pct_peak" in c]  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise GoalsError(f"{src}: not lab.engine.gemm_bench's cells ({exc!r}); rerun the "
                             "gemm part of goals.sh (GOALS_PARTS=gemm)") from exc  # fmt: skip
        if not cells:
            goals.append(_missing(name, target, src))
            continue
        worst = min(cells, key=lambda c: c["pct_peak"])
        best = max(cells, key=lambda c: c["pct_peak"])
        at_goal = sum(c["pct_peak"] >= PRODUCT_PCT for c in cells)
        value = (f"{worst['pct_peak']:.0f}% ({worst['shape']}) to {best['pct_peak']:.0f}% "
                 f"({best['shape']}); {at_goal} of {len(cells)} shapes at the goal")  # fmt: skip
        goals.append(Goal(name=name, target=target, value=value,
                          met=worst["pct_peak"] >= PRODUCT_PCT, source=src))  # fmt: skip
    return goals


def long_goals(summary: dict[str, Any] | None) -> list[Goal]:
    """The 131k prompt under the 3,732 MiB cap: its read and the decode after it; and the
    uncapped read no slower than the capped one. A length that failed is missed, with its
    error."""
    src = "long/long_prompt.json"
    key = f"prompt_{LONG_TOKENS}"
    capped_goals = (
        ("131k read under the cap, tok/s", "prompt_tok_per_s", LONG_READ),
        ("131k decode under the cap, tok/s", "decode_tok_per_s", LONG_DECODE),
    )
    ratio_name, ratio_target = "131k read uncapped / capped", ">= 1.0x"
    if summary is None:
        return [_missing(n, f">= {f:,.0f}", src) for n, _, f in capped_goals] + [
            _missing(ratio_name, ratio_target, src)
        ]
    if not isinstance(summary, dict):
        raise GoalsError(f"{src}: expected the object lab.engine.long_prompt all writes")
    runs = {v: summary.get(v) if isinstance(summary.get(v), dict) else {}
            for v in ("capped", "uncapped")}  # fmt: skip
    cells = {v: r.get(key) if isinstance(r.get(key), dict) else None for v, r in runs.items()}

    def figure(variant: str, field: str) -> tuple[float | None, str]:
        cell = cells[variant]
        if cell is None:
            return None, "not measured"
        if cell.get(field) is None:
            return None, f"failed: {str(cell.get('error', 'no figure'))[:80]}"
        return float(cell[field]), ""

    goals = []
    for name, field, floor in capped_goals:
        target = f">= {floor:,.0f}"
        v, why = figure("capped", field)
        if v is None and why == "not measured":
            goals.append(_missing(name, target, src))
        else:
            goals.append(Goal(name=name, target=target, value=why or f"{v:,.1f}",
                              met=v is not None and v >= floor, source=src))  # fmt: skip
    capped, why_c = figure("capped", "prompt_tok_per_s")
    uncapped, why_u = figure("uncapped", "prompt_tok_per_s")
    name, target = ratio_name, ratio_target
    if capped is None or uncapped is None:
        if "not measured" in (why_c, why_u):
            goals.append(_missing(name, target, src))
        else:
            goals.append(Goal(name=name, target=target, value=why_u or why_c, met=False,
                              source=src))  # fmt: skip
    else:
        value = f"{uncapped / capped:.2f}x ({uncapped:,.0f} / {capped:,.0f})"
        goals.append(Goal(name=name, target=target, met=uncapped >= capped, source=src,
                          value=value))  # fmt: skip
    return goals


class GoalsReport(BaseModel):
    """The goals of one folder and the GPU its sweep names (None where it names none)."""

    device: str | None
    goals: list[Goal]


def report(folder: Path) -> GoalsReport:
    """Every goal that goals.sh's output folder can judge, each file read once."""
    if not folder.is_dir():
        raise GoalsError(f"{folder}: no such folder; give the folder goals.sh wrote ($OUT)")
    sweep = _load(folder / "sweep" / "results.json")
    gemm = _load(folder / "gemm.json")
    goals = (sweep_goals(sweep) + step_goal(_load(folder / "steps.json"))
             + start_goals(_load(folder / "cold_start.json")) + product_goals(gemm)
             + long_goals(_load(folder / "long" / "long_prompt.json")))  # fmt: skip
    device = next((str(r["device"]) for r in (sweep or {}).get("roofline") or []
                   if r.get("device")), None)  # fmt: skip
    if device is None and isinstance(gemm, dict) and gemm.get("device"):
        device = str(gemm["device"])
    return GoalsReport(device=device, goals=goals)


def judge(folder: Path) -> list[Goal]:
    """Every goal that goals.sh's output folder can judge."""
    return report(folder).goals


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met]


def render(goals: list[Goal], device: str | None = None) -> str:
    lines = ["# Issue 26's goals" + (f" ({device})" if device else ""), "",
             "| goal | target | now | | from |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {g.name} | {g.target} | {g.value} | {_verdict(g.met)} | `{g.source}` |"
              for g in goals]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m lab.engine.goals", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("folder", type=Path, help="the folder lab/device/goals.sh wrote ($OUT)")
    ap.add_argument("--out", type=Path, help="write the table here too (markdown)")
    ap.add_argument("--json", type=Path, help="write the goals here as JSON")
    args = ap.parse_args(argv)
    try:
        found = report(args.folder)
        goals = found.goals
        text = render(goals, found.device)
    except GoalsError as exc:
        print(f"goals: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.out:
        write_atomic(args.out, text)
    if args.json:
        write_atomic(args.json, json.dumps([g.model_dump() for g in goals], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
