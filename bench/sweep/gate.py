"""The correctness gate: after each cell, every target answers a fixed probe set greedily
(temperature 0, ignore_eos, PROBE_TOKENS tokens: bench/sweep/gate_probes.py), and the report
compares each cell's answers with the reference target's.

Per cell, not per cell group: a server that goes wrong under load (a corrupted KV block, a
batching bug, a kernel that misbehaves at some shape) shows it after the cell that did it, and
the probes cost a few sequential requests, run outside the cell's timed window and telemetry.
Sequential, one at a time: a batch of probes would make the answers depend on batch composition.

The reference's answers are those of its first cell (in run order) that answered every probe,
so the reference is gated too: its later cells are compared with its own first answers. Token
ids are compared where both sides returned them (vLLM and the engine server with
`return_token_ids`, llama-server through its native /completion), else the text. How each server
kind is asked is tools/compare_client.py's, reused here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.sweep.gate_models import CellGate, GateDeparture, GateReport, ProbeAnswer
from bench.sweep.gate_probes import PROBE_TOKENS, Probe, probe_set
from bench.sweep.models import CellRecord, SweepConfig
from bench.sweep.prompts import pool_ids
from tools.compare_client import CompareClient, CompareError
from tools.compare_types import ServerTarget

SHOWN_TOKENS = 12  # ids of each continuation shown from the first differing one
SHOWN_CHARS = 80


def probes_for(config: SweepConfig) -> list[Probe]:
    """Token-id probes when every target takes token ids and the sweep has a pool (the one its
    prompts come from, as bench.sweep.run.prompt_pool gives it), else text."""
    pool = None
    if config.pool_list:
        pool = np.asarray(config.pool_list, dtype=np.int64)
    elif config.pool_size:
        pool = pool_ids(config.pool_size, config.pool_exclude)
    as_ids = all(t.prompt_format == "token_ids" for t in config.targets)
    return probe_set(pool, as_ids)


class Prober:
    """One target's probe client for the whole sweep (its model resolved once)."""

    def __init__(self, config: SweepConfig, live) -> None:
        self.probes = probes_for(config)
        target = ServerTarget(base_url=live.base_url, model=live.model, name=live.label)
        self.client = CompareClient(
            target, live.label, timeout=min(config.request_timeout_s, 120.0)
        )
        self.resolved = False

    def close(self) -> None:
        self.client.close()

    def answers(self) -> list[ProbeAnswer]:
        """Every probe's answer; a probe the server refuses records why (never raises)."""
        if not self.resolved:
            try:
                self.client.resolve_model()
                self.resolved = True
            except CompareError as exc:
                return [ProbeAnswer(probe=p.index, error=exc.message) for p in self.probes]
        return [self._ask(p) for p in self.probes]

    def _ask(self, probe: Probe) -> ProbeAnswer:
        client = self.client
        try:
            if client.dialect == "llamacpp":
                ids = probe.ids if probe.ids is not None else client.prompt_ids(probe.text or "")
                return ProbeAnswer(
                    probe=probe.index, tokens=client.generate(ids, PROBE_TOKENS, 1).tokens
                )
            choice = client.complete(probe.prompt, PROBE_TOKENS, None)
        except CompareError as exc:
            return ProbeAnswer(probe=probe.index, error=exc.message)
        tokens, text = choice.get("token_ids"), choice.get("text")
        ok = isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
        return ProbeAnswer(probe=probe.index, tokens=tokens if ok else None,
                           text=text if isinstance(text, str) else None)  # fmt: skip


def _shown_ids(tokens: list[int], pos: int, text: str | None) -> str:
    tail = tokens[pos : pos + SHOWN_TOKENS]
    more = "..." if len(tokens) > pos + SHOWN_TOKENS else ""
    return f"{tail}{more}" + ("" if text is None else f" (answer {text[:SHOWN_CHARS]!r})")


def first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    """Where two answers (ids or characters) first differ; the shorter length if one is a
    prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip


def compare_answer(ref: ProbeAnswer, got: ProbeAnswer) -> GateDeparture | None | str:
    """None: the same; a departure; or a string saying why the two cannot be compared."""
    if ref.error or got.error:
        return got.error or ref.error or "no answer"
    if ref.tokens is not None and got.tokens is not None:
        a, b = ref.tokens, got.tokens
        if a == b:
            return None
        pos = first_difference(a, b)
        return GateDeparture(probe=got.probe, unit="token", position=pos,
                             reference=_shown_ids(a, pos, ref.text),
                             target=_shown_ids(b, pos, got.text))  # fmt: skip
    if ref.text is not None and got.text is not None:
        a, b = ref.text, got.text
        if a == b:
            return None
        pos = first_difference(a, b)
        return GateDeparture(probe=got.probe, unit="character", position=pos,
                             reference=repr(a[pos : pos + SHOWN_CHARS]),
                             target=repr(b[pos : pos + SHOWN_CHARS]))  # fmt: skip
    return "one side returned token ids only and the other text only"


def _answered(cell: CellRecord) -> bool:
    return bool(cell.probes) and all(p.error is None for p in cell.probes)


def evaluate(config: SweepConfig, cells: list[CellRecord]) -> GateReport | None:
    """Each cell's verdict against the reference's answers; None when the gate is off."""
    if not config.gate:
        return None
    reference = config.reference or config.targets[0].label
    probes = probes_for(config)
    report = GateReport(reference=reference, probes=[p.describe() for p in probes],
                        max_tokens=PROBE_TOKENS)  # fmt: skip
    ref_cell = next((c for c in cells if c.target == reference and _answered(c)), None)
    if ref_cell is None:
        report.reason = f"the reference {reference} answered no probe set in full"
    else:
        report.reference_cell = ref_cell.key().name()
    ref = {p.probe: p for p in ref_cell.probes} if ref_cell else {}
    for cell in cells:
        gate = CellGate(target=cell.target, input_len=cell.input_len, rate=cell.rate,
                        concurrency=cell.concurrency, repeat=cell.repeat,
                        verdict="not compared")  # fmt: skip
        why = []
        for answer in cell.probes:
            if answer.probe not in ref:
                continue
            outcome = compare_answer(ref[answer.probe], answer)
            if isinstance(outcome, str):
                why.append(f"probe {answer.probe}: {outcome}")
                continue
            gate.compared += 1
            if outcome is not None:
                gate.departures.append(outcome)
        if gate.departures:
            gate.verdict = "departs"
        elif gate.compared:
            gate.verdict = "same"
        gate.reason = "; ".join(why) or (None if gate.compared else _no_probes(cell, report))
        report.cells.append(gate)
    report.departed = sum(g.verdict == "departs" for g in report.cells)
    return report


def _no_probes(cell: CellRecord, report: GateReport) -> str:
    if report.reference_cell is None:
        return report.reason or "no reference answers"
    return "the cell failed" if cell.status == "failed" else "no probe answers in this cell"
