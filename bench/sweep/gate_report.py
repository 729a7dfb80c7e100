"""The correctness gate in the report: its section of REPORT.md, and the mark each summary
cell gets when a repeat's probe answers departed from the reference's (the main table shows it).
"""

from __future__ import annotations

from tabulate import tabulate

from bench.sweep.gate_models import GateReport
from bench.sweep.models import SummaryRow, load_name

MARK = " ≠ref"


def mark_rows(rows: list[SummaryRow], gate: GateReport | None) -> None:
    """Each TargetCell's gate_departs: the repeats that departed (None: none compared)."""
    if gate is None:
        return
    by: dict[tuple, list[str]] = {}
    for g in gate.cells:
        by.setdefault((g.target, g.input_len, g.concurrency, g.rate), []).append(g.verdict)
    for row in rows:
        for tc in row.targets:
            verdicts = by.get((tc.target, row.input_len, row.concurrency, row.rate), [])
            compared = [v for v in verdicts if v != "not compared"]
            tc.gate_departs = sum(v == "departs" for v in compared) if compared else None


def _cell_name(g) -> str:
    return f"{g.target} in={g.input_len} {load_name(g.concurrency, g.rate)} r={g.repeat + 1}"


def _cell(text: str, width: int = 90) -> str:
    """One Markdown table cell: no pipe or newline breaks the row, long text is cut."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def gate_section(gate: GateReport | None) -> list[str]:
    """REPORT.md's lines: the verdict, and one line per departure (probe, position, both)."""
    if gate is None:
        return []
    lines = ["## Correctness gate", ""]
    lines.append(
        f"After each cell every target answered {len(gate.probes)} fixed probes greedily "
        f"({gate.max_tokens} tokens, temperature 0, ignore_eos), compared with the reference "
        f"**{gate.reference}**'s answers"
        + (f" of its cell {gate.reference_cell}" if gate.reference_cell else "")
        + " (token ids where both returned them, else text)."
        + f" `{MARK.strip()}` in the main table: a repeat departed."
    )
    lines.append("")
    if gate.reason:
        return [*lines, f"Nothing compared: {gate.reason}.", ""]
    compared = [g for g in gate.cells if g.verdict != "not compared"]
    same = sum(g.verdict == "same" for g in compared)
    lines += [f"{same} of {len(compared)} compared cells gave the reference's answers; "
              f"{gate.departed} departed.", ""]  # fmt: skip
    departing = [g for g in gate.cells if g.departures]
    if departing:
        body = [[_cell_name(g), ", ".join(f"{d.probe} at {d.unit} {d.position}"
                                          for d in g.departures)] for g in departing]  # fmt: skip
        lines += [tabulate(body, headers=["cell", "probes departed (first difference)"],
                           tablefmt="github", disable_numparse=True), ""]  # fmt: skip
        seen: dict[tuple, None] = {}
        for g in departing:
            for d in g.departures:
                key = (g.target, d.probe, d.unit, d.position, d.reference, d.target)
                seen.setdefault(key)
        body = [[target, str(probe), f"{unit} {pos}", _cell(ref), _cell(got)]
                for target, probe, unit, pos, ref, got in seen]  # fmt: skip
        headers = ["target", "probe", "first difference", "reference continues",
                   "target continues"]  # fmt: skip
        lines += ["Continuations from the first difference (each distinct one once):", "",
                  tabulate(body, headers=headers, tablefmt="github", disable_numparse=True),
                  ""]  # fmt: skip
    skipped = [g for g in gate.cells if g.verdict == "not compared" and g.reason]
    if skipped:
        reasons = sorted({g.reason or "" for g in skipped})
        lines += [f"Not compared: {len(skipped)} cell(s): {'; '.join(reasons)[:300]}.", ""]
    lines += ["Probes: " + "; ".join(f"{i}: {p}" for i, p in enumerate(gate.probes)), ""]
    return lines
