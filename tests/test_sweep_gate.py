"""The sweep's correctness gate against real `gpurig engine serve` processes on the CPU.

Three targets: two servers of the same checkpoint and one of a checkpoint made with another
seed. After every cell each answers the fixed probes greedily; the report compares them with
the reference's answers: the same checkpoint agrees in every cell, the other seed departs and
is marked in REPORT.md and results.json (which probe, where, both continuations). Through the
CLI, `--reference` picks another target. The comparison itself, and the plan's checks, on
recorded answers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.sweep import run_sweep
from bench.sweep.gate import compare_answer
from bench.sweep.gate_models import GateDeparture, ProbeAnswer
from bench.sweep.gate_probes import PROBE_TOKENS, TEXTS
from bench.sweep.models import SweepConfig
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess

PLAN = {"input_lens": [16], "output_len": 4, "concurrency": [1, 2], "repeats": 2,
        "prompts_per_cell": 2}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gate-ckpt")
    for name, seed in (("a", 0), ("b", 1)):
        make_checkpoint(root / name, preset="tiny", seed=seed)
    return {"a": root / "a", "b": root / "b"}


@pytest.fixture(scope="module")
def servers(checkpoints: dict[str, Path]):
    started = {}
    try:
        for label, ckpt in (("a1", "a"), ("a2", "a"), ("b", "b")):
            started[label] = ServerProcess(checkpoints[ckpt])
        yield started
    finally:
        for s in started.values():
            s.stop()


def _target(label: str, server: ServerProcess, model_dir: Path) -> dict:
    return {"label": label, "base_url": server.base + "/v1", "model_dir": str(model_dir)}


@pytest.mark.slow
def test_same_checkpoint_agrees_other_seed_departs(servers, checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    result = run_sweep(
        targets=[
            _target("a1", servers["a1"], checkpoints["a"]),
            _target("a2", servers["a2"], checkpoints["a"]),
            _target("b", servers["b"], checkpoints["b"]),
        ],
        out_dir=str(out),
        **PLAN,
    )
    assert result.state == "done" and not result.failures
    cells = [json.loads(x) for x in (out / "cells.jsonl").read_text().splitlines()]
    assert len(cells) == 12
    # every cell recorded the answers as token ids, PROBE_TOKENS of them per probe
    for c in cells:
        assert [p["probe"] for p in c["probes"]] == list(range(len(TEXTS))), c["probes"]
        assert all(p["error"] is None and len(p["tokens"]) == PROBE_TOKENS for p in c["probes"])
    first = {c["target"]: c["probes"] for c in reversed(cells)}  # each target's first cell
    assert first["a1"] == first["a2"] and first["a1"] != first["b"]

    gate = result.gate
    assert gate is not None and gate.reference == "a1"
    assert gate.reference_cell == "a1 in=16 c=1 r=1"
    verdicts = {(g.target, g.concurrency, g.repeat): g for g in gate.cells}
    assert len(verdicts) == 12
    for (target, _c, _r), g in verdicts.items():
        assert g.compared == len(TEXTS)
        assert g.verdict == ("departs" if target == "b" else "same"), g
    assert gate.departed == 4
    # a departure names the probe, the first differing token and both continuations
    g = verdicts[("b", 1, 0)]
    ref = {p["probe"]: p["tokens"] for p in first["a1"]}
    mine = {p["probe"]: p["tokens"] for p in first["b"]}
    for d in g.departures:
        a, b = ref[d.probe], mine[d.probe]
        assert a[: d.position] == b[: d.position] and a[d.position] != b[d.position]
        assert d.unit == "token"
        assert d.reference.startswith(str(a[d.position : d.position + 12])[:-1])
        assert d.target.startswith(str(b[d.position : d.position + 12])[:-1])
    assert {d.probe for d in g.departures} == {p for p in ref if ref[p] != mine[p]}

    data = json.loads((out / "results.json").read_text())
    assert data["gate"]["departed"] == 4
    assert {c["target"] for c in data["gate"]["cells"] if c["verdict"] == "departs"} == {"b"}
    report = (out / "REPORT.md").read_text()
    assert "## Correctness gate" in report and "reference **a1**" in report
    assert "8 of 12 compared cells gave the reference's answers; 4 departed." in report
    listed = ", ".join(f"{d.probe} at token {d.position}" for d in g.departures)
    assert re.search(rf"\| b in=16 c=1 r=1 +\| {listed} +\|", report), report
    # each distinct continuation once (the same in all four cells of b)
    rows = [line for line in report.splitlines() if re.match(r"\| b +\| \d +\| token ", line)]
    assert len(rows) == len(g.departures)
    marked = [line for line in report.splitlines() if line.startswith("| 16 ")][:2]  # main
    assert marked and all("≠ref" in line.split("|")[5] for line in marked)  # b's column
    assert all("≠ref" not in "|".join(line.split("|")[3:5]) for line in marked)  # a1, a2
    summary = {tc.target: tc.gate_departs for row in result.summary for tc in row.targets}
    assert summary == {"a1": 0, "a2": 0, "b": 2}


@pytest.mark.slow
def test_cli_reference_flag(servers, checkpoints, tmp_path: Path, run_gpurig) -> None:
    out = tmp_path / "cli"
    done = run_gpurig(
        "sweep", "run",
        "--target", f"a1={servers['a1'].base}/v1", "--target", f"b={servers['b'].base}/v1",
        "--model-dir", f"a1={checkpoints['a']}", "--model-dir", f"b={checkpoints['b']}",
        "--input-lens", "16", "--output-len", "4", "--concurrency", "1", "--repeats", "1",
        "--prompts-per-cell", "2", "--reference", "b", "--out", str(out), "--json",
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    gate = json.loads(done.stdout)["gate"]
    assert gate["reference"] == "b"
    assert {c["target"]: c["verdict"] for c in gate["cells"]} == {"a1": "departs", "b": "same"}
    bad = run_gpurig("sweep", "run", "--target", "a=http://127.0.0.1:9/v1", "--reference", "z",
                     "--out", str(tmp_path / "bad"))  # fmt: skip
    assert bad.returncode != 0 and "reference 'z' is not a target label" in bad.stderr


def test_no_gate_records_no_probes() -> None:
    config = SweepConfig(sweep_id="s", out_dir="/tmp/s", created="now", input_lens=[16],
                         output_len=4, concurrency=[1], repeats=1, seed=0, gate=False,
                         targets=[{"label": "a", "base_url": "http://x/v1"}])  # fmt: skip
    from bench.sweep.gate import evaluate

    assert evaluate(config, []) is None


def test_compare_answer_tokens_then_text() -> None:
    same = compare_answer(ProbeAnswer(probe=1, tokens=[5, 6]), ProbeAnswer(probe=1, tokens=[5, 6]))
    assert same is None
    d = compare_answer(
        ProbeAnswer(probe=1, tokens=[5, 6, 7], text="xyz"),
        ProbeAnswer(probe=1, tokens=[5, 9, 7], text="xqz"),
    )
    assert isinstance(d, GateDeparture) and (d.unit, d.position) == ("token", 1)
    assert d.reference.startswith("[6, 7]") and d.target.startswith("[9, 7]")
    # a shorter answer departs where it ends
    d = compare_answer(ProbeAnswer(probe=0, tokens=[1, 2]), ProbeAnswer(probe=0, tokens=[1]))
    assert isinstance(d, GateDeparture) and d.position == 1 and d.target == "[]"
    # text where one side has no ids
    d = compare_answer(ProbeAnswer(probe=2, tokens=[1], text="hello"),
                       ProbeAnswer(probe=2, text="help!"))  # fmt: skip
    assert isinstance(d, GateDeparture) and (d.unit, d.position) == ("character", 3)
    assert (d.reference, d.target) == ("'lo'", "'p!'")
    why = compare_answer(ProbeAnswer(probe=0, tokens=[1]), ProbeAnswer(probe=0, text="a"))
    assert isinstance(why, str) and "token ids only" in why
    why = compare_answer(ProbeAnswer(probe=0, tokens=[1]), ProbeAnswer(probe=0, error="boom"))
    assert why == "boom"
