"""Cache resets between a sweep's cells (issue 53, part 3), against real servers: the engine
server's POST /reset_prefix_cache (it holds nothing across requests and says so), llama-server's
slot erase (refused without --slot-save-path, with that reason), vLLM's CPU build (where its
venv is built: it serves the reset only in dev mode), and a whole sweep over the engine whose
cells each record the reset and whose report says so, on by default and off with
--no-cache-reset.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.sweep import run_sweep
from bench.sweep.cache_reset import reset_cache
from engine.checkpoint_maker import make_checkpoint
from engine.errors import NotFoundError
from tests.server_support import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reset-ckpt") / "tiny"
    make_checkpoint(path, preset="tiny", seed=0, quantized=False)
    return path


@pytest.fixture(scope="module")
def engine_server(ckpt: Path):
    server = ServerProcess(ckpt)
    yield server
    server.stop()


def test_the_engine_answers_reset_prefix_cache_saying_it_holds_nothing(engine_server) -> None:
    r = httpx.post(engine_server.base + "/reset_prefix_cache", timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["success"] is True and body["prefix_cache"] is False
    assert body["reset"] == [] and "nothing to reset" in body["message"]
    got = reset_cache(engine_server.base)
    assert got.done and got.how == "POST /reset_prefix_cache" and got.detail.startswith("engine:")
    assert got.ms is not None and got.ms > 0
    wrong = httpx.get(engine_server.base + "/reset_prefix_cache", timeout=10)
    assert wrong.status_code == 405  # POST only, as vLLM's


def test_a_sweep_resets_before_every_cell_and_reports_it(engine_server, tmp_path: Path) -> None:
    target = [{"label": "e", "base_url": engine_server.base + "/v1"}]
    args = {"input_lens": [16], "output_len": 4, "concurrency": [1, 2], "repeats": 2,
            "prompts_per_cell": 2, "gate": False}  # fmt: skip
    result = run_sweep(target, out_dir=str(tmp_path / "on"), **args)
    cells = json.loads(Path(result.results_json).read_text())["cells"]
    assert len(cells) == 4 and all(c["cache_reset"]["done"] for c in cells)
    report = Path(result.report).read_text()
    assert "## Cache resets between cells" in report
    assert "e: reset before 4 of 4 cells (POST /reset_prefix_cache: engine:" in report
    header = Path(result.results_csv).read_text().splitlines()[0].split(",")
    assert "cache_reset" in header
    off = run_sweep(target, out_dir=str(tmp_path / "off"), cache_reset=False, **args)
    cells = json.loads(Path(off.results_json).read_text())["cells"]
    assert all(c["cache_reset"] is None for c in cells)
    assert "Off (--no-cache-reset)" in Path(off.report).read_text()


def test_an_unknown_server_and_a_dead_one_are_not_supported_with_why(engine_server) -> None:
    down = reset_cache(f"http://127.0.0.1:{free_port()}")
    assert not down.done and "the reset call failed: ConnectError" in down.detail
    # the engine's /v1 root has no reset, no /slots, no /version: what was tried is said
    none = reset_cache(engine_server.base + "/v1")
    assert not none.done and none.detail.startswith("not supported: the server has no POST")


# ---- llama-server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf(ckpt: Path) -> Path:
    from tools import llamacpp

    try:
        llamacpp.find_converter()
        llamacpp.find_binary("llama-server")
    except NotFoundError as exc:
        pytest.skip(f"{exc.message}: {exc.remedy}")
    return Path(llamacpp.export_gguf(ckpt, ckpt.parent / "tiny.gguf", outtype="f16").path)


def _llama_server(gguf: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    from tools import llamacpp

    port = free_port()
    cmd = [str(llamacpp.find_binary("llama-server")), "-m", str(gguf), "--port", str(port),
           "-np", "2", "-c", "512", *extra]  # fmt: skip
    log = (gguf.parent / f"llama-{port}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, (gguf.parent / f"llama-{port}.log").read_text()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server was not ready in 90 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def test_llama_server_slots_are_erased_where_it_allows_slot_actions(gguf: Path, tmp_path: Path):
    proc, base = _llama_server(gguf, "--slot-save-path", str(tmp_path))
    try:
        body = {"prompt": [2, 105, 40, 41, 42, 43, 44, 45], "max_tokens": 4, "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        first = reset_cache(base)
        assert first.done and first.how == "POST /slots/{id}?action=erase", first.detail
        assert first.detail.startswith("llama-server: 2 slot(s) erased (")
        held = int(re.search(r"\((\d+) tokens\)", first.detail).group(1))  # type: ignore[union-attr]
        assert held >= 8  # the prompt (and its answer) the slot kept for the next request
        again = reset_cache(base)
        assert again.done and "(0 tokens)" in again.detail  # nothing left to erase
    finally:
        _stop(proc)


def test_llama_server_without_slot_save_path_refuses_with_the_reason(gguf: Path) -> None:
    proc, base = _llama_server(gguf)
    try:
        got = reset_cache(base)
        assert not got.done and got.detail.startswith("llama-server refused: HTTP 501")
        assert "--slot-save-path" in got.detail
    finally:
        _stop(proc)


def test_a_llama_server_the_sweep_starts_can_be_reset(gguf: Path, tmp_path: Path, monkeypatch):
    """A `server` target the sweep starts itself gets --slot-save-path, so its slots are erased
    before each cell (a user's own flags win: bench.sweep.targets.resettable)."""
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    server = {"model": str(gguf), "backend": "llamacpp", "max_model_len": 512, "timeout_s": 120}
    result = run_sweep([{"label": "l", "server": server}], out_dir=str(tmp_path / "s"),
                       input_lens=[16], output_len=4, concurrency=[1], repeats=2,
                       prompts_per_cell=2, gate=False)  # fmt: skip
    cells = json.loads(Path(result.results_json).read_text())["cells"]
    assert len(cells) == 2 and all(c["cache_reset"]["done"] for c in cells), cells
    assert all("slot(s) erased" in c["cache_reset"]["detail"] for c in cells)


def test_resettable_adds_the_switches_only_where_the_user_set_none() -> None:
    from bench.sweep.targets import resettable

    vllm = resettable({"model": "m", "env": {"X": "1"}}, "s1")
    assert vllm["env"] == {"VLLM_SERVER_DEV_MODE": "1", "X": "1"}
    mine = resettable({"model": "m", "env": {"VLLM_SERVER_DEV_MODE": "0"}}, "s1")
    assert mine["env"]["VLLM_SERVER_DEV_MODE"] == "0"
    own = resettable({"backend": "llamacpp", "extra_args": ["--slot-save-path=/x"]}, "s1")
    assert own["extra_args"] == ["--slot-save-path=/x"]
    assert resettable({"backend": "engine"}, "s1") == {"backend": "engine"}


# ---- vLLM's CPU build ----------------------------------------------------------------------------


def test_vllm_without_dev_mode_is_not_supported_with_the_switch(vllm_cpu_server) -> None:
    """The shared server runs without VLLM_SERVER_DEV_MODE: vLLM 404s the reset; /version
    tells it is vLLM, and the reason names the switch."""
    got = reset_cache(vllm_cpu_server.base)
    assert not got.done and "VLLM_SERVER_DEV_MODE=1" in got.detail, got.detail
    assert got.detail.startswith("not supported: vLLM 0.32")


@pytest.mark.slow
def test_vllm_in_dev_mode_resets_its_prefix_cache(vllm_cpu_python: str, tmp_path: Path) -> None:
    """A vLLM of its own in dev mode: the same prompt twice hits its prefix cache; after the
    reset, the same prompt again hits nothing."""
    from tests.vllm_cpu_support import VllmCpuServer, cpu_runs_w4a16

    make_checkpoint(tmp_path / "tiny", preset="tiny", seed=0, quantized=cpu_runs_w4a16())
    server = VllmCpuServer(vllm_cpu_python, tmp_path / "tiny", free_port(), tmp_path / "v.log",
                           extra=["--enforce-eager", "--enable-prefix-caching"])  # fmt: skip
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the child's environment is read at its start
    try:
        server.start()
    finally:
        os.environ.pop("VLLM_SERVER_DEV_MODE", None)
    try:
        prompt = [10 + i % 390 for i in range(600)]  # whole blocks of the CPU build's size

        def hits() -> float:
            text = httpx.get(server.base + "/metrics", timeout=10).text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("vllm:prefix_cache_hits_total"))  # fmt: skip

        def ask() -> None:
            body = {"model": str(server.model), "prompt": prompt, "max_tokens": 2}
            assert httpx.post(server.base + "/v1/completions", json=body, timeout=120).is_success

        def settled() -> float:  # vLLM's counters reach /metrics a moment after the request
            time.sleep(2.0)
            return hits()

        ask()
        h0 = settled()
        ask()
        assert settled() > h0  # the second time, from the cache
        got = reset_cache(server.base)
        assert got.done and got.detail == "prefix cache reset", got.detail
        h1 = settled()
        ask()
        assert settled() == h1  # after the reset, nothing was cached
    finally:
        server.stop()


def test_cli_turns_the_reset_off() -> None:
    out = subprocess.run([sys.executable, "-m", "mcp_server.cli", "sweep", "run", "--help"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)  # fmt: skip
    assert "--no-cache-reset" in out.stdout and "--probe-rate" in out.stdout
