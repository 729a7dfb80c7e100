"""start/stop/status against a stand-in vLLM that replays recorded output (no GPU here).

The stand-in is a real package in a real venv (tests/data/fake_vllm), run by the same code that
runs vLLM: found through the serving interpreter, its `--help` parsed for flags, the command
started detached under the supervisor. Each recorded failure text must come back as its named
cause with a remedy and the tail; a start that never gets ready times out with the tail; a
server that ignores SIGTERM is SIGKILLed after the stop timeout; a reused pid is never
signalled.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from serve_support import H200, free_port, install_fake_vllm, scenario_env

from tools.serving import server_status, start_vllm_server, stop_vllm_server
from tools.serving import state as st
from tools.serving.models import ServerRecord

HUB = "google/gemma-4-E2B-it"


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory) -> str:
    return str(install_fake_vllm(tmp_path_factory.mktemp("fakevllm") / "venv"))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # not this machine's downloads
    yield
    for record in st.list_records():  # never leave a process behind
        stop_vllm_server(record.name, timeout_s=2)


def start(python: str, scenario: str, **kw) -> ServerRecord:
    kw.setdefault("timeout_s", 30)
    env = {**scenario_env(scenario, kw.pop("log", "0.29")), **kw.pop("env", {})}
    return start_vllm_server(HUB, python_bin=python, port=free_port(), gpus=H200, env=env, **kw)


CAUSES = {
    "fail_turing_smem": ("turing_smem", "OutOfResources", "gpurig patch apply"),
    "fail_mmap_enomem": ("mmap_enomem", "unable to mmap 10246621918 bytes", "swapon"),
    "fail_libcudart": ("libcudart_missing", "libcudart.so.13", "torch"),
    "fail_libcudnn": ("libcudnn_missing", "libcudnn.so.9", "--no-deps"),
    "fail_cuda_oom": ("cuda_oom", "CUDA out of memory", "gpu_memory_utilization"),
    "fail_address_in_use": ("address_in_use", "address already in use", "port"),
    "fail_unknown_flag": ("unknown_flag", "--max-modle-len", "extra_args"),
    "fail_gemma4_old": ("gemma4_unsupported", "head_dim", "0.27.2"),
}


@pytest.mark.parametrize("scenario", sorted(CAUSES))
def test_each_recorded_failure_is_named(fake_python, scenario):
    cause, evidence, remedy = CAUSES[scenario]
    t0 = time.monotonic()
    record = start(fake_python, scenario)
    assert time.monotonic() - t0 < 15  # seconds, not the 900 s timeout
    assert record.state == "dead"
    assert record.failure is not None
    assert record.failure.cause == cause, record.failure
    assert evidence in record.failure.evidence
    assert remedy in record.failure.remedy
    assert record.failure.exit == "exit code 1"
    assert any(evidence in line for line in record.failure.log_tail)
    # the record on disk says the same, and status shows it from there
    status = server_status(record.name).servers[0]
    assert status.state == "dead" and status.failure.cause == cause
    assert status.ended == "exit code 1"


def test_oom_kill_without_kernel_log_still_names_the_suspect(fake_python):
    record = start(fake_python, "fail_oom_killed")
    assert record.state == "dead"
    assert record.failure.exit == "killed by SIGKILL"
    # dmesg is not readable here (or holds no line for this pid): the cause says so, with swap
    assert record.failure.cause in ("killed", "host_oom_killed")
    assert "swapon" in record.failure.remedy
    assert "Loading safetensors checkpoint shards" in record.failure.log_tail[-1]


def test_unknown_failure_keeps_the_tail(fake_python):
    record = start(fake_python, "fail_unknown")
    assert record.failure.cause == "unknown"
    assert record.failure.log_tail[-1].endswith("something nobody has seen before")


def test_never_ready_times_out_with_the_tail_and_is_stopped(fake_python):
    t0 = time.monotonic()
    record = start(fake_python, "hang", timeout_s=2)
    assert 2 <= time.monotonic() - t0 < 15
    assert record.state == "dead"
    assert record.failure.cause == "not_ready_in_time"
    assert any("KV cache size" in line for line in record.failure.log_tail)
    assert not psutil.pid_exists(record.pid) or not st_alive(record)
    assert record.startup_facts.kv_cache_tokens == 519568


def st_alive(record: ServerRecord) -> bool:
    from tools.serving.process import is_ours

    return is_ours(record.pid, record.pid_create_time)


def test_ready_with_startup_facts_then_stubborn_stop(fake_python):
    record = start(fake_python, "stubborn", log="0.31", name="stubborn")
    assert record.state == "ready", record.failure
    assert record.served_model_name == HUB
    assert record.command[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", HUB]
    assert record.vllm_version == "0.33.0"
    facts = record.startup_facts
    assert facts.vllm_version == "0.31.0" and facts.kv_cache_tokens == 315974
    assert facts.attention_backend == "TRITON_ATTN"
    assert facts.dtype_cast == "Casting torch.bfloat16 to torch.float16"
    status = server_status("stubborn").servers[0]
    assert status.state == "ready" and status.health == "ok" and status.uptime_s >= 0
    result = stop_vllm_server("stubborn", timeout_s=1)
    assert result.killed_after_timeout and result.signal == "SIGKILL"
    assert 1 <= result.seconds < 10
    assert result.port_free
    assert not st_alive(record)
    again = stop_vllm_server("stubborn")
    assert again.signalled is False and again.state == "stopped"
    assert server_status("stubborn").servers[0].state == "stopped"


def test_wait_false_then_status_sees_it_become_ready(fake_python):
    record = start(
        fake_python,
        "serve",
        wait=False,
        name="nowait",
        env={"HF_TOKEN": "hf_secret"},
        extra_args=["--api-key", "sk-secret"],
    )
    assert record.state == "starting"
    # secrets stay out of the record, which is readable by its owner only
    text = Path(record.log_path).with_suffix(".json").read_text()
    assert "secret" not in text and record.env["HF_TOKEN"] == "***"
    assert record.command[record.command.index("--api-key") + 1] == "***"
    assert Path(record.log_path).with_suffix(".json").stat().st_mode & 0o077 == 0
    deadline = time.monotonic() + 20
    while server_status("nowait").servers[0].state != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert stop_vllm_server().name == "nowait"  # the only one running


def test_a_reused_pid_is_never_signalled():
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        created = psutil.Process(other.pid).create_time()
        fake = ServerRecord(
            name="reused", backend="vllm", pid=other.pid, pid_create_time=created - 100.0,
            port=free_port(), host="127.0.0.1", base_url="http://127.0.0.1:1/v1", model=HUB,
            served_model_name=HUB, state="ready", log_path="/nonexistent.log",
            exit_path="/nonexistent.exit.json", command=["vllm", "serve", HUB],
            started_at=st.now_iso(),
        )  # fmt: skip
        st.write_record(fake)
        status = server_status("reused").servers[0]
        assert status.state == "dead"  # the recorded process is gone; this pid is someone else
        result = stop_vllm_server("reused", timeout_s=1)
        assert result.signalled is False
        time.sleep(0.2)
        assert other.poll() is None  # still running: never signalled
    finally:
        other.kill()
        other.wait()
