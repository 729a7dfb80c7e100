"""Interleaved A/B and paired comparison, against real `gpurig engine serve` processes.

An interleaved sweep runs every target's cell before the next cell (ABAB), on the same seeded
prompts; `compare_sweeps` of two real sweeps gives, per cell and figure, the paired difference
(repeat by repeat) with its 95% interval, checked here against the recorded cells by hand.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench.sweep import run_sweep
from bench.sweep.ci import T975
from bench.sweep.compare import compare_sweeps
from bench.sweep.models import SweepConfig
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess

PLAN = {"input_lens": [16], "output_len": 4, "concurrency": [1, 2], "repeats": 3,
        "prompts_per_cell": 2, "gate": False}  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ab-ckpt")
    started = {}
    try:
        for name, seed in (("a", 0), ("b", 1)):
            make_checkpoint(root / name, preset="tiny", seed=seed)
            started[name] = (ServerProcess(root / name), root / name)
        yield started
    finally:
        for s, _ in started.values():
            s.stop()


def _targets(servers) -> list[dict]:
    return [{"label": k, "base_url": s.base + "/v1", "model_dir": str(d)}
            for k, (s, d) in servers.items()]  # fmt: skip


def _cells(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "cells.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_interleaved_order_and_paired_compare(servers, tmp_path: Path) -> None:
    first = run_sweep(targets=_targets(servers), out_dir=str(tmp_path / "s1"), interleave=True,
                      **PLAN)  # fmt: skip
    assert first.state == "done" and not first.failures
    cells = _cells(tmp_path / "s1")
    assert [c["target"] for c in cells] == ["a", "b"] * 6  # ABAB, cell by cell
    pairs = list(zip(cells[::2], cells[1::2], strict=True))
    order = [(a["concurrency"], a["repeat"]) for a, _ in pairs]
    assert order == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    for a, b in pairs:  # both sides of a pair: the same cell, the same prompts
        assert (a["concurrency"], a["repeat"], a["seed"]) == (
            b["concurrency"],
            b["repeat"],
            b["seed"],
        )
        assert [r["prompt_sha"] for r in a["requests"]] == [r["prompt_sha"] for r in b["requests"]]

    second = run_sweep(targets=_targets(servers), out_dir=str(tmp_path / "s2"), **PLAN)
    assert second.state == "done"
    assert [c["target"] for c in _cells(tmp_path / "s2")] == ["a"] * 6 + ["b"] * 6  # in turn

    result = compare_sweeps([str(tmp_path / "s1"), str(tmp_path / "s2")], str(tmp_path / "cmp"))
    base = {(c["target"], c["concurrency"], c["repeat"]): c for c in cells}
    later = {(c["target"], c["concurrency"], c["repeat"]): c for c in _cells(tmp_path / "s2")}
    assert len(result.rows) == 2 * 2 * 3  # (target, concurrency) x figures
    for row in result.rows:
        diffs = [later[(row.target, row.concurrency, r)][row.figure]
                 - base[(row.target, row.concurrency, r)][row.figure] for r in range(3)]  # fmt: skip
        mean = statistics.fmean(diffs)
        half = T975[1] * statistics.stdev(diffs) / math.sqrt(3)  # t(2 df) = 4.303
        v = row.values[1]
        assert v.pairs == 3
        assert v.diff_mean == pytest.approx(mean, abs=1e-3)
        assert v.diff_ci95 == pytest.approx(half, abs=1e-3)
        assert v.paired_differs == (abs(mean) > half)
        assert row.values[0].diff_mean is None  # the baseline has no difference to itself
    report = Path(result.report).read_text()
    assert "## Paired differences" in report and "(3 pairs)" in report
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["rows"][0]["values"][1]["pairs"] == 3


def test_interleave_refuses_started_servers_and_a_search() -> None:
    plan = dict(sweep_id="s", out_dir="/tmp/s", created="now", input_lens=[16], output_len=4,
                repeats=1, seed=0, interleave=True)  # fmt: skip
    with pytest.raises(ValueError, match="every target must be a running server"):
        SweepConfig(targets=[{"label": "a", "server": {"model": "/m"}}], concurrency=[1], **plan)
    with pytest.raises(ValueError, match="a search decides its cells"):
        SweepConfig(targets=[{"label": "a", "base_url": "http://x/v1"}],
                    search={"axis": "concurrency"}, slo={"ttft_p99_ms": 5}, **plan)  # fmt: skip


def test_cli_interleave_flag() -> None:
    import argparse

    from mcp_server import cli_sweep
    from mcp_server.request_flags import build

    parser = argparse.ArgumentParser()
    cli_sweep.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sweep", "run", "--target", "a=http://x/v1", "--interleave",
                              "--no-gate", "--reference", "a"])  # fmt: skip
    request = build(cli_sweep.SWEEP, args)
    assert (request.interleave, request.gate, request.reference) == (True, False, "a")
    args = parser.parse_args(["sweep", "run", "--target", "a=http://x/v1"])
    request = build(cli_sweep.SWEEP, args)
    assert (request.interleave, request.gate, request.reference) == (False, True, None)
