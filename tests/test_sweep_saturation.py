"""Steady state and saturation (issue 53, part 7): warm-up requests left out of a cell's figures,
the over-saturation check of rate cells (completions behind arrivals and a growing queue, judged
the same below 1 req/s: vLLM #47651), and a rate axis stopped after its first failing rate, with
the reason in the report; units on simulated queues, then a real sweep against an engine server
held to one sequence at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sweep import run_sweep, saturation, steady
from bench.sweep.arrivals import arrival_times
from bench.sweep.models import CellRecord, RequestResult, SweepConfig, Target
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess


def queue(rate: float, service_s: float, n: int = 16, servers: int = 1) -> list[RequestResult]:
    """A FIFO queue's requests: seeded arrivals at `rate`, each served `service_s` by the first
    free of `servers`."""
    free = [0.0] * servers
    out = []
    for i, t in enumerate(arrival_times(n, rate, 1.0, [7, int(rate * 1000)])):
        k = free.index(min(free))
        begin = max(t, free[k])
        free[k] = begin + service_s
        out.append(RequestResult(index=i, prompt_sha="x", input_tokens=8, output_tokens=4,
                                 start_s=t, scheduled_s=t, ttft_ms=(begin - t) * 1000 + 5,
                                 e2e_ms=(free[k] - t) * 1000))  # fmt: skip
    return out


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.9, 4.0, 40.0])
def test_a_server_that_keeps_up_is_not_saturated_at_any_rate(rate: float) -> None:
    got = saturation.check(queue(rate, service_s=0.2 / rate))  # busy a fifth of the time
    assert got is not None and not got.saturated, got
    assert got.completion_rate == pytest.approx(got.offered_rate, rel=0.15)


@pytest.mark.parametrize("rate", [0.3, 0.9, 40.0])
def test_a_server_at_a_third_of_the_offered_rate_is_saturated(rate: float) -> None:
    got = saturation.check(queue(rate, service_s=3.0 / rate))
    assert got is not None and got.saturated and got.reason
    assert got.completion_rate == pytest.approx(rate / 3, rel=0.1)  # its capacity, below 1/s too
    assert got.outstanding_slope and got.outstanding_slope > 0
    assert got.reason.startswith("over-saturated: completions")


def test_closed_loop_cells_and_tiny_cells_are_not_judged() -> None:
    closed = queue(1.0, 0.1)
    for r in closed:
        r.scheduled_s = None
    assert saturation.check(closed) is None
    assert saturation.check(queue(1.0, 0.1, n=3)) is None


def _cell(rate: float, saturated: bool = False, slo_met: bool | None = None) -> CellRecord:
    reqs = queue(rate, 3.0 / rate if saturated else 0.1 / rate)
    return CellRecord(target="a", input_len=16, concurrency=0, repeat=0, seed=0, driver="builtin",
                      status="ok", started_at="now", rate=rate, completed=16, slo_met=slo_met,
                      slo_values={"ttft_p99_ms": 900.0} if slo_met is False else {},
                      saturation=saturation.check(reqs))  # fmt: skip


def _config(**kw) -> SweepConfig:
    return SweepConfig(sweep_id="s", out_dir="/tmp/x", created="now",
                       targets=[Target(label="a", base_url="http://x/v1")], input_lens=[16],
                       output_len=4, request_rate=[0.25, 0.5, 1.0, 2.0], repeats=1, seed=0, **kw)  # fmt: skip


def test_the_axis_stops_after_the_first_failing_rate_below_one_per_second() -> None:
    config = _config()
    stops = saturation.axis_stops(config, [_cell(0.25), _cell(0.5, saturated=True)])
    assert [(s.rate, s.skipped) for s in stops] == [(0.5, [1.0, 2.0])]
    assert stops[0].reason.startswith("over-saturated")
    key = config.cell_keys()[2]
    assert key.rate == 1.0 and saturation.skipped_by(config, key, [_cell(0.25), _cell(0.5, True)])
    slo = saturation.axis_stops(_config(slo={"ttft_p99_ms": 500}), [_cell(0.25, slo_met=False)])
    assert slo[0].rate == 0.25 and slo[0].reason == "missed the SLO (ttft_p99_ms 900.0)"
    assert saturation.axis_stops(_config(saturation_stop=False), [_cell(0.25, slo_met=False)]) == []
    assert saturation.axis_stops(config, [_cell(0.25), _cell(0.5)]) == []


def test_warm_up_marks_the_first_requests_and_the_window_shrinks() -> None:
    reqs = queue(2.0, 0.1, n=10)
    assert steady.mark_warmup(reqs, 3, 0.0) == 3
    kept, window = steady.measured(reqs)
    assert len(kept) == 7 and all(r.excluded for r in reqs[:3])
    assert window == pytest.approx(reqs[-1].start_s + reqs[-1].e2e_ms / 1000 - reqs[3].start_s)
    by_time = queue(2.0, 0.1, n=10)
    t3 = by_time[3].start_s
    assert steady.mark_warmup(by_time, 0, t3 - 1e-9) == 3
    assert steady.mark_warmup(queue(2.0, 0.1, n=4), 10, 0.0) == 0  # would leave nothing: none


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("sat-ckpt") / "tiny"
    make_checkpoint(path, preset="tiny", seed=0)
    proc = ServerProcess(path, "--max-num-seqs", "1")
    yield proc
    proc.stop()


def test_a_real_rate_sweep_stops_once_the_server_falls_behind(one_at_a_time, tmp_path) -> None:
    result = run_sweep([{"label": "e", "base_url": one_at_a_time.base + "/v1"}],
                       input_lens=[16], output_len=32, request_rate=[0.8, 60.0, 120.0],
                       repeats=1, prompts_per_cell=8, exclude_first=1, gate=False,
                       out_dir=str(tmp_path / "s"))  # fmt: skip
    data = json.loads(Path(result.results_json).read_text())
    cells = {c["rate"]: c for c in data["cells"]}
    assert set(cells) == {0.8, 60.0}  # 120/s was not run
    assert cells[0.8]["saturation"]["saturated"] is False
    assert cells[60.0]["saturation"]["saturated"] is True
    assert all(c["excluded"] == 1 and c["completed"] == 7 for c in cells.values())
    assert sum(r["excluded"] for r in cells[0.8]["requests"]) == 1
    (stop,) = data["axis_stops"]
    assert stop["rate"] == 60.0 and stop["skipped"] == [120.0]
    report = Path(result.report).read_text()
    section = report.split("## Steady state and saturation")[1].split("\n## ")[0]
    assert "the first 1 requests of each cell left out" in section
    assert "**e in=16: the rate axis stopped after 60/s** (over-saturated: completions" in section
    assert "not run: 120/s" in section
    assert "FAILED: skipped: the rate axis stopped at 60/s" in result.table
