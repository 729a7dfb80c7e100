"""Stall probes (issue 53, part 4): single-token requests beside a cell's load, outside its
concurrency cap, against the real engine server; their TTFT per cell in results.json, the CSV
and REPORT.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.sweep import driver_builtin, run_sweep
from bench.sweep.probes import ProbePlan
from bench.sweep.workload import Job
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("probe-ckpt") / "tiny"
    make_checkpoint(path, preset="tiny", seed=0)
    proc = ServerProcess(path)
    yield proc
    proc.stop()


def test_probes_go_beside_the_load_outside_its_cap(server) -> None:
    """At concurrency 1 the load never has two requests out; probes overlap its requests, so
    they were not held behind its cap, and each made exactly one token."""
    rng = np.random.default_rng(0)
    jobs = [Job(index=i, parts=[rng.integers(10, 200, 32).tolist()], output_len=48)
            for i in range(3)]  # fmt: skip
    plan = ProbePlan(rate=20.0, prompt=lambda i: [11 + i] * 16, seed_parts=[0, 1])
    probed: list = []
    load, _ = driver_builtin.run_jobs(server.base + "/v1", None, jobs, 1, 60.0, probe=plan,
                                      probe_out=probed)  # fmt: skip
    assert all(r.error is None for r in load) and probed
    assert all(r.error is None and r.output_tokens == 1 for r in probed)

    def span(r):
        return r.start_s, r.start_s + r.e2e_ms / 1000

    overlapping = [p for p in probed
                   if any(span(x)[0] < span(p)[0] < span(x)[1] for x in load)]  # fmt: skip
    assert overlapping, "no probe was sent while a load request was out"
    last_end = max(span(x)[1] for x in load)
    assert all(p.start_s <= last_end for p in probed)  # no probe after the load had ended


def test_a_sweep_reports_probe_latency_per_cell(server, tmp_path: Path) -> None:
    result = run_sweep([{"label": "e", "base_url": server.base + "/v1"}], input_lens=[16],
                       output_len=24, concurrency=[1, 2], repeats=1, prompts_per_cell=4,
                       probe_rate=10.0, gate=False, out_dir=str(tmp_path / "s"))  # fmt: skip
    cells = json.loads(Path(result.results_json).read_text())["cells"]
    for c in cells:
        p = c["stall_probes"]
        assert p["rate"] == 10.0 and p["sent"] >= 1 and p["completed"] == p["sent"]
        assert p["failed"] == 0 and 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"] <= p["ttft_max_ms"]
        assert c["completed"] == 4  # the load's own figures count the load only
    report = Path(result.report).read_text()
    section = report.split("## Stall probes")[1].split("\n## ")[0]
    assert "e probe TTFT p50 / p99 ms (sent, failed)" in section and "in=16 c=2" in section
    assert "Single-token requests at 10/s" in section
    header = Path(result.results_csv).read_text().splitlines()[0]
    assert "probe_ttft_p50_ms" in header and "probe_failed" in header


def test_probes_need_the_builtin_driver() -> None:
    from bench.sweep.models import SweepRequest

    with pytest.raises(ValueError, match="need driver 'builtin'"):
        SweepRequest(driver="vllm-bench", probe_rate=1.0)
