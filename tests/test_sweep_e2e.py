"""Real sweeps against real `gpurig engine serve` processes on loopback (tiny checkpoints, CPU).

Checked through the files the sweep writes: the same prompt ids reached both targets, every cell
is there, results.csv and results.json agree, the plots are PNG images; a target down from the
start and one killed mid-sweep fail their cells with reasons while the other completes; a killed
sweep process resumes; the MCP tool reports progress per request.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import time
from pathlib import Path

import pytest
from mcp import Client

from bench.sweep import run_sweep, sweep_status
from bench.sweep.models import SweepResult
from bench.sweep.prompts import pool_ids, token_prompt
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess, free_port

pytestmark = pytest.mark.slow
PLAN = {"input_lens": [16, 40], "output_len": 4, "concurrency": [1, 2], "repeats": 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweep-ckpt")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        make_checkpoint(root / name, preset="tiny", seed=seed)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def servers(checkpoints: dict[str, Path]):
    started = {name: ServerProcess(path) for name, path in checkpoints.items()}
    yield started
    for s in started.values():
        s.stop()


def _target(label: str, server: ServerProcess, model_dir: Path) -> dict:
    return {"label": label, "base_url": server.base + "/v1", "model_dir": str(model_dir)}


def _png_ok(path: str) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    from matplotlib.image import imread

    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100, image.shape


def test_two_engines_same_prompts_every_cell(servers, checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    seen: list[tuple[int, int]] = []
    result = run_sweep(
        targets=[
            _target("a", servers["a"], checkpoints["a"]),
            _target("b", servers["b"], checkpoints["b"]),
        ],
        out_dir=str(out),
        progress=lambda done, total, _msg: seen.append((done, total)),
        prompts_per_cell=4,
        **PLAN,
    )
    assert result.state == "done" and not result.failures
    # progress: once per request at least, ending at the total (2 x 2 x 2 x 2 cells x 4)
    total = 2 * 2 * 2 * 2 * 4
    assert seen[-1] == (total, total) and len([s for s in seen if s[0] > 0]) >= total

    data = json.loads((out / "results.json").read_text())
    cells = data["cells"]
    keys = {(c["target"], c["input_len"], c["concurrency"], c["repeat"]) for c in cells}
    assert len(cells) == len(keys) == 16
    assert all(c["status"] == "ok" and c["completed"] == 4 for c in cells)

    # identical prompt ids for both targets, and they are the seeded ones
    config = data["config"]
    pool = pool_ids(config["pool_size"], config["pool_exclude"])
    assert config["pool_size"] == 512 and 2 in config["pool_exclude"]  # <bos> never drawn
    by_target: dict[str, dict] = {"a": {}, "b": {}}
    for c in cells:
        for r in c["requests"]:
            key = (c["input_len"], c["repeat"], r["index"])
            by_target[c["target"]][key] = r["prompt_sha"]
            assert r["prompt_tokens"] == c["input_len"] == r["input_tokens"]
            assert r["output_tokens"] == 4 and r["error"] is None
            assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"]
    assert by_target["a"] == by_target["b"]
    from bench.sweep.prompts import sha

    assert by_target["a"][(16, 1, 0)] == sha(token_prompt(pool, 0, 16, 1, 0))
    # each concurrency level takes fresh prompts (no prefix-cache reuse within a target)
    indices = {(c["input_len"], c["repeat"], c["concurrency"]): c for c in cells}
    c1 = {r["index"] for r in indices[(16, 0, 1)]["requests"]}
    c2 = {r["index"] for r in indices[(16, 0, 2)]["requests"]}
    assert c1 == set(range(4)) and c2 == set(range(4, 8))

    # the CSV and the JSON agree, row for row
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 16
    for row in rows:
        cell = next(
            c
            for c in cells
            if (c["target"], c["input_len"], c["concurrency"], c["repeat"])
            == (row["target"], int(row["input_len"]), int(row["concurrency"]), int(row["repeat"]))
        )
        for field in ("output_tok_s", "per_stream_tok_s", "ttft_p50_ms", "tpot_p50_ms"):
            assert float(row[field]) == pytest.approx(cell[field])
        assert int(row["output_tokens"]) == cell["output_tokens"] == 16
        # per stream is 1000 / median TPOT, output tok/s is tokens over the cell's wall time
        assert cell["per_stream_tok_s"] == pytest.approx(1000 / cell["tpot_p50_ms"], rel=1e-3)
        assert cell["output_tok_s"] == pytest.approx(16 / cell["duration_s"], rel=1e-3)

    # summary: medians over the two repeats, a winner per row
    assert len(result.summary) == 4
    for row in result.summary:
        a, b = row.targets
        a_cells = [
            c["output_tok_s"]
            for c in cells
            if (c["target"], c["input_len"], c["concurrency"])
            == ("a", row.input_len, row.concurrency)
        ]
        assert a.output_tok_s == pytest.approx(sum(a_cells) / 2, rel=1e-3)
        assert row.winner in ("a", "b") and row.ratio >= 1.0

    assert len(result.plots) == 3
    for p in result.plots:
        _png_ok(p)
    report = (out / "REPORT.md").read_text()
    assert "| 16 " in report and "a tok/s (per stream)" in report
    assert (
        "no bandwidth: no NVIDIA GPU visible" in report
    )  # no GPU here: the ceiling says why it is missing
    roof = {r.target: r for r in result.roofline}
    assert roof["a"].bytes_per_token == roof["b"].bytes_per_token > 0
    assert roof["a"].ceiling_tok_s is None and "no bandwidth" in (roof["a"].missing or "")
    tele = cells[0]["telemetry"]
    assert tele["server_pid"] == servers[cells[0]["target"]].proc.pid
    assert tele["server_cpu_cores"] is not None and tele["metrics_after"]["generation_tokens"] > 0
    if tele["gpu"] is None:
        assert tele["gpu_missing"]
    # the engine batches: at concurrency 2 its decode steps carried more than one sequence
    for c in cells:
        rows = c["telemetry"]["decode_rows_per_step"]
        assert rows is not None and 1.0 <= rows <= c["concurrency"], c["telemetry"]
    assert max(c["telemetry"]["decode_rows_per_step"] for c in cells if c["concurrency"] == 2) > 1
    assert "Engine sequences per decode step (batching): a c=1: 1.0, a c=2: " in report


def test_down_and_killed_targets_fail_with_reasons(servers, checkpoints, tmp_path: Path) -> None:
    victim = ServerProcess(checkpoints["b"])
    down = f"http://127.0.0.1:{free_port()}/v1"

    def progress(done: int, total: int, message: str) -> None:
        # kill the second target once its first cell is on disk
        if message.startswith("victim in=16 c=1 r=1: ok") and victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)

    try:
        result = run_sweep(
            targets=[
                _target("good", servers["a"], checkpoints["a"]),
                _target("victim", victim, checkpoints["b"]),
                {"label": "down", "base_url": down, "model_dir": str(checkpoints["a"])},
            ],
            out_dir=str(tmp_path / "sweep"),
            progress=progress,
            **{**PLAN, "input_lens": [16], "prompts_per_cell": 4},
        )
    finally:
        victim.stop()
    cells = json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]
    by = {}
    for c in cells:
        by.setdefault(c["target"], []).append(c)
    assert len(cells) == 12
    assert all(c["status"] == "ok" for c in by["good"])
    assert all(c["status"] == "failed" for c in by["down"])
    assert all(
        "target down" in c["reason"] and "connection refused" in c["reason"] for c in by["down"]
    )
    victim_cells = sorted(by["victim"], key=lambda c: (c["concurrency"], c["repeat"]))
    assert victim_cells[0]["status"] == "ok"
    assert all(c["status"] == "failed" for c in victim_cells[1:])
    assert all("target down" in c["reason"] for c in victim_cells[1:])
    report = (tmp_path / "sweep" / "REPORT.md").read_text()
    assert "- down: target down" in report and "- victim: target down" in report
    assert "FAILED" in report
    assert any(f.startswith("down: target down") and "(4 cells)" in f for f in result.failures)
    # the table still has the good target's numbers in every row
    assert all(row.targets[0].output_tok_s for row in result.summary)


def test_resume_after_killing_the_sweep_process(servers, checkpoints, tmp_path: Path, run_gpurig):
    out = tmp_path / "sweep"
    started = run_sweep(
        targets=[_target("a", servers["a"], checkpoints["a"])],
        input_lens=[16],
        output_len=4,
        concurrency=[1],
        repeats=6,
        prompts_per_cell=4,
        out_dir=str(out),
        wait=False,
    )
    assert started.state == "running" and started.status is not None
    pid = started.status.worker_pid
    assert pid
    deadline = time.monotonic() + 90
    cells_file = out / "cells.jsonl"
    while time.monotonic() < deadline:
        if cells_file.exists() and len(cells_file.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    status = sweep_status(str(out))
    assert status.state == "running" and status.cells_total == 6
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    before = [json.loads(x) for x in cells_file.read_text().splitlines()]
    assert 2 <= len(before) < 6
    status = sweep_status(str(out))
    assert status.state == "stopped" and "resume" in status.message
    assert status.cells_done == len(before)

    done = run_gpurig("sweep", "run", "--resume", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "requests" in done.stderr  # the progress bar
    after = [json.loads(x) for x in cells_file.read_text().splitlines()]
    keys = [(c["repeat"]) for c in after]
    assert sorted(keys) == list(range(6))  # every cell once
    assert after[: len(before)] == before  # the finished cells were kept as they were
    assert all(c["status"] == "ok" for c in after)
    status = run_gpurig("sweep", "status", str(out), "--json")
    assert json.loads(status.stdout)["state"] == "done"
    rebuilt = run_gpurig("sweep", "report", str(out))
    assert rebuilt.returncode == 0 and "REPORT.md" in rebuilt.stdout


def test_mcp_run_sweep_reports_progress(servers, checkpoints, tmp_path: Path) -> None:
    from mcp_server.server import mcp

    notes: list[tuple[float, float | None]] = []

    async def on_progress(progress: float, total: float | None, _message: str | None) -> None:
        notes.append((progress, total))

    async def session() -> tuple[SweepResult, dict]:
        async with Client(mcp) as client:
            result = await client.call_tool(
                "run_sweep",
                {
                    "targets": [_target("a", servers["a"], checkpoints["a"])],
                    "input_lens": [16],
                    "output_len": 4,
                    "concurrency": [2],
                    "repeats": 1,
                    "out_dir": str(tmp_path / "mcp"),
                },
                progress_callback=on_progress,
            )
            assert not result.is_error, result.content
            status = await client.call_tool("sweep_status", {"sweep": str(tmp_path / "mcp")})
            bad = await client.call_tool(
                "run_sweep", {"targets": [{"label": "x"}], "out_dir": str(tmp_path / "bad")}
            )
            assert bad.is_error and "base_url" in " ".join(b.text for b in bad.content)
            return SweepResult.model_validate(result.structured_content), status.structured_content

    result, status = asyncio.run(session())
    assert result.state == "done" and Path(result.report).is_file()
    assert status["state"] == "done" and status["cells_done"] == 1
    assert notes and notes[-1] == (8.0, 8.0)
    assert [p for p, _ in notes] == sorted(p for p, _ in notes)


FAKE_VLLM = """#!{python}
# A stand-in for `vllm bench serve`: records its argv and saves the recorded result file.
import json, sys
argv = sys.argv[1:]
with open({log!r}, "a") as fh:
    fh.write(json.dumps(argv) + "\\n")
def arg(flag):
    return argv[argv.index(flag) + 1]
saved = json.load(open({fixture!r}))
saved["max_concurrency"] = int(arg("--max-concurrency"))
with open(arg("--result-dir") + "/" + arg("--result-filename"), "w") as fh:
    json.dump(saved, fh)
"""


def test_vllm_bench_driver_runs_the_command_and_reads_its_file(
    servers, checkpoints, tmp_path: Path
) -> None:
    import sys

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    log = tmp_path / "argv.jsonl"
    fixture = Path(__file__).parent / "data" / "vllm_bench_serve_result.json"
    script = bin_dir / "vllm"
    script.write_text(FAKE_VLLM.format(python=sys.executable, log=str(log), fixture=str(fixture)))
    script.chmod(0o755)
    target = {**_target("v", servers["a"], checkpoints["a"]), "python_bin": str(bin_dir / "python")}
    result = run_sweep(
        targets=[target],
        input_lens=[16],
        output_len=128,
        concurrency=[1, 4],
        repeats=1,
        driver="vllm-bench",
        out_dir=str(tmp_path / "sweep"),
    )
    saved = json.loads(fixture.read_text())
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) == 2
    for argv, conc in zip(calls, (1, 4), strict=True):
        assert argv[:2] == ["bench", "serve"]
        assert argv[argv.index("--max-concurrency") + 1] == str(conc)
        assert argv[argv.index("--random-input-len") + 1] == "16"
        assert argv[argv.index("--port") + 1] == str(servers["a"].port)
        assert argv[argv.index("--tokenizer") + 1] == str(checkpoints["a"])
        assert argv[argv.index("--model") + 1] == "a"  # the served id from /v1/models
    seeds = [argv[argv.index("--seed") + 1] for argv in calls]
    assert seeds[0] != seeds[1]  # fresh prompts per concurrency level
    cells = json.loads((tmp_path / "sweep" / "results.json").read_text())["cells"]
    assert [c["status"] for c in cells] == ["partial", "partial"]  # the recorded failed request
    assert all(
        c["output_tok_s"] == pytest.approx(saved["output_throughput"], abs=1e-3) for c in cells
    )
    assert [str(c["seed"]) for c in cells] == seeds
    assert result.failures and "ClientResponseError: 500" in result.failures[0]  # the exception


@pytest.fixture
def small_demo(tmp_path: Path, monkeypatch):
    """bench.sweep.demo on a one-cell plan, its records in the test's own GPURIG_HOME."""
    from bench.sweep import demo

    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GPURIG_PYTHON", raising=False)
    monkeypatch.setattr(
        demo, "DEMO_PLAN", {"input_lens": [16], "output_len": 4, "concurrency": [1], "repeats": 1}
    )
    return demo


def test_demo_starts_and_stops_its_servers(small_demo, tmp_path: Path, monkeypatch) -> None:
    """`gpurig demo`'s function on a smaller plan: both targets are `server` targets, started
    through tools.serving one at a time and stopped after their cells."""
    from tools.serving import server_status

    demo = small_demo
    # no peer on this "machine": no vLLM interpreter named, no llama.cpp build, none on PATH
    monkeypatch.delenv("GPURIG_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("GPURIG_LLAMA_CPP_DIR", str(tmp_path / "no-llama-cpp"))
    path = os.environ.get("PATH", "").split(os.pathsep)
    monkeypatch.setenv(
        "PATH", os.pathsep.join(d for d in path if not Path(d, "llama-server").exists())
    )
    assert demo.demo_llama(None) is None
    assert [h.split(":")[0] for h in demo.missing_peers(None, None)] == ["vLLM", "llama.cpp"]
    result = demo.run_demo(work_dir=str(tmp_path / "demo"), device="cpu")
    assert result.state == "done" and not result.failures, result.failures
    assert [t.target for t in result.summary[0].targets] == ["engine-tiny", "engine-small"]
    assert all(t.output_tok_s for t in result.summary[0].targets)
    assert "engine-tiny tok/s" in result.table and Path(result.report).is_file()
    servers = server_status().servers
    assert len(servers) == 2 and all(s.state == "stopped" for s in servers)
    roof = {r.target: r for r in result.roofline}
    assert roof["engine-small"].bytes_per_token > roof["engine-tiny"].bytes_per_token > 0


def test_demo_adds_llamacpp_where_it_is_built(small_demo, tmp_path: Path) -> None:
    """With gpurig's llama.cpp build on the machine the demo serves the engine and llama-server
    on the same weights (a bf16 checkpoint, its f16 GGUF exported once), one after the other."""
    from tools import llamacpp
    from tools.errors import NotFoundError
    from tools.serving import server_status

    try:
        llamacpp.find_binary("llama-server")
        llamacpp.find_converter()
    except NotFoundError as exc:
        pytest.skip(f"{exc.message}: {exc.remedy}")
    result = small_demo.run_demo(work_dir=str(tmp_path / "demo"), device="cpu")
    assert result.state == "done" and not result.failures, result.failures
    assert [t.target for t in result.summary[0].targets] == ["engine", "llama.cpp"]
    assert all(t.output_tok_s for t in result.summary[0].targets)
    checkpoints = tmp_path / "demo" / "checkpoints"
    assert llamacpp.is_gguf(checkpoints / "tiny-bf16.gguf")
    assert sorted(s.backend for s in server_status().servers) == ["engine", "llamacpp"]
    assert all(s.state == "stopped" for s in server_status().servers)
    # the same prompt ids went to both: the llama.cpp target read the checkpoint's tokenizer
    cells = json.loads(Path(result.out_dir, "results.json").read_text())["cells"]
    shas = {c["target"]: sorted(r["prompt_sha"] for r in c["requests"]) for c in cells}
    assert shas["engine"] == shas["llama.cpp"]
