"""The engine in a process of its own (engine/process/core.py, client.py): a real spawned
process on a tiny checkpoint (the CPU reference path) gives the tokens the in-process engine
gives, refuses what it refuses before queueing, cancels, reports its counters, fails open
requests with a clear error when it dies, and reports a bad checkpoint; then
`gpurig engine serve --engine-process on` serves real HTTP and leaves no process behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from serve_support import free_port

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.errors import CheckpointError, ContextLengthError, EngineError
from engine.options import EngineOptions
from engine.process.client import EngineClient
from engine.process.core import Core, CoreSpec
from engine.sampling import SamplingParams

CONTEXT = 256


def _options() -> dict:
    return {"device": "cpu", "max_context": CONTEXT, "options": EngineOptions(fast="off"),
            "max_num_seqs": 4, "warm_up": False}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("core") / "tiny"
    make_checkpoint(path, preset="tiny", seed=11)
    return path


@pytest.fixture(scope="module")
def client(tiny):
    c = EngineClient(CoreSpec(tiny, _options(), torch_threads=1))
    yield c
    c.close()


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [(13 * i + salt) % 300 + 20 for i in range(n - 1)]


async def _run(c: EngineClient, prompt: list[int], params: SamplingParams, cancel_after=None):
    """The request's outputs until it ends: (tokens, the last output, its sequence)."""
    loop = asyncio.get_running_loop()
    outs: asyncio.Queue = asyncio.Queue()
    seq = await c.add_request_async(
        prompt, params, lambda _s, out: loop.call_soon_threadsafe(outs.put_nowait, out)
    )
    tokens: list[int] = []
    while True:
        out = await asyncio.wait_for(outs.get(), 60)
        tokens += out.tokens
        if cancel_after is not None and len(tokens) >= cancel_after:
            seq.cancel()
        if out.finished or out.error is not None:
            return tokens, out, seq


def test_tokens_equal_the_in_process_engine(tiny, client) -> None:
    prompts = [_prompt(n, s) for n, s in ((5, 1), (40, 2), (120, 3))]
    params = SamplingParams(max_tokens=9, stop_ids=())
    ref = engine.load(tiny, **_options())
    try:
        want = [ref.generate(p, params) for p in prompts]
    finally:
        ref.close()

    async def all_at_once():
        return await asyncio.gather(*(_run(client, p, params) for p in prompts))

    got = asyncio.run(all_at_once())
    assert [tokens for tokens, _, _ in got] == want
    assert client.facts == ref.facts  # engine/interface.py's EngineFacts, sent as they are
    for _tokens, last, seq in got:
        assert last.finish_reason == "length" and seq.finished and seq.finish_reason == "length"
        assert seq.arrived <= seq.started_at <= seq.first_token_at  # the engine's clock is ours
    assert not client.has_work
    time.sleep(0.2)  # the counters come with the step that leaves the engine idle
    stats = client.stats()
    assert stats.running == 0 and stats.step_rows >= 3 * 8
    assert stats.process_gc_s < 5  # the engine process's collector, timed there


def test_the_core_counts_its_own_process_collections(tiny) -> None:
    """What the core sends with the counters: the engine's own, and the pauses of its
    process's collector (which stop its stepping thread; the server's metrics report them)."""
    eng = engine.load(tiny, **_options())
    core = Core(None, eng)  # type: ignore[arg-type] - no pipe: only its counters are read
    core.gc.install()
    try:
        assert core.stats().process_gc_collections == 0
        gc.collect()
        gc.collect()
        stats = core.stats()
    finally:
        core.gc.uninstall()
        eng.close()
    assert stats.process_gc_collections == 2 and stats.process_gc_s > 0
    assert 0 < stats.process_gc_max_pause_s <= stats.process_gc_s
    assert stats.max_num_seqs == eng.max_num_seqs  # the engine's counters beside them


def test_the_core_notes_its_sending_and_receiving_for_the_late_steps(tiny) -> None:
    """The engine process's loop marks when a step's outputs are sent and when what came in is
    received, after the engine's own notes, so a late step's host time splits into deliver /
    send / receive / loop (engine/step_clock.py)."""
    import multiprocessing
    import threading

    eng = engine.load(tiny, **_options())
    ours, theirs = multiprocessing.Pipe()
    core = Core(theirs, eng)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        ours.send(("add", 1, _prompt(6, 3), SamplingParams(max_tokens=4)))
        finished = False
        while not finished:
            msg = ours.recv()
            if msg[0] == "outs":
                finished = any(out.finished for rid, out, *_ in msg[1] if rid == 1)
        ours.send(("close",))
        while ours.recv() != ("closed",):
            pass
        loop.join(10)
        notes = dict(eng.runner.clock._notes)
    finally:
        eng.close()
    assert not loop.is_alive()
    # each iteration: the step's tokens delivered, then sent; the close received after them
    assert notes["collected"] <= notes["delivered"] <= notes["sent"] <= notes["received"]


def test_refusal_raises_before_anything_is_queued(client) -> None:
    async def too_long():
        return await client.add_request_async(_prompt(CONTEXT + 10, 1), SamplingParams(), None)

    with pytest.raises(ContextLengthError) as info:
        asyncio.run(too_long())
    assert info.value.limit == CONTEXT
    assert not client.has_work
    # the client serves the next request as before
    tokens, last, _ = asyncio.run(_run(client, _prompt(6, 4), SamplingParams(max_tokens=3)))
    assert len(tokens) <= 3 and last.finished


def test_cancel_ends_the_request_early(client) -> None:
    params = SamplingParams(max_tokens=200, stop_ids=())
    tokens, last, seq = asyncio.run(_run(client, _prompt(8, 5), params, cancel_after=2))
    assert 2 <= len(tokens) < 200 and last.finished and last.finish_reason is None
    assert seq.cancelled and not client.has_work


def test_reset_stats_zeroes_the_engine_counters(client) -> None:
    asyncio.run(_run(client, _prompt(6, 6), SamplingParams(max_tokens=4, stop_ids=())))
    assert client.reset_stats()
    assert client.stats().steps == 0 and client.stats().step_rows == 0
    assert client.stats().process_gc_s < 0.05  # its pauses were counted from zero again


def test_a_dead_engine_fails_open_requests_and_refuses_new_ones(tiny) -> None:
    c = EngineClient(CoreSpec(tiny, _options(), torch_threads=1))
    try:

        async def killed_midway():
            loop = asyncio.get_running_loop()
            outs: asyncio.Queue = asyncio.Queue()
            await c.add_request_async(_prompt(8, 7), SamplingParams(max_tokens=4000, stop_ids=()),
                                      lambda _s, o: loop.call_soon_threadsafe(outs.put_nowait, o))  # fmt: skip
            first = await asyncio.wait_for(outs.get(), 60)
            os.kill(c.process.pid, signal.SIGKILL)  # the engine process this test started
            while True:
                out = await asyncio.wait_for(outs.get(), 60)
                if out.error is not None or out.finished:
                    return first, out

        first, last = asyncio.run(killed_midway())
        assert first.tokens and isinstance(last.error, EngineError)
        assert "engine process has ended (killed by SIGKILL" in str(last.error)
        with pytest.raises(EngineError, match="engine process has ended"):
            asyncio.run(c.add_request_async(_prompt(4, 1), SamplingParams(), None))
        assert not c.has_work
    finally:
        c.close()
    assert not c.process.is_alive()


def test_a_bad_checkpoint_is_reported_and_the_process_is_gone(tmp_path) -> None:
    (tmp_path / "empty").mkdir()

    def alive() -> set[int]:
        return {p.pid for p in psutil.Process().children()
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}  # fmt: skip

    before = alive()
    with pytest.raises(CheckpointError, match="config.json"):
        EngineClient(CoreSpec(tmp_path / "empty", _options()))
    assert alive() <= before  # its engine process is gone


def test_serve_with_engine_process_answers_and_leaves_nothing(tiny) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mcp_server.cli", "engine", "serve", "--model", str(tiny),
         "--device", "cpu", "--port", str(port), "--max-context", str(CONTEXT),
         "--engine-process", "on", "--no-warmup", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "GPURIG_FAST": "off"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the server never answered /health")
        children = psutil.Process(server.pid).children(recursive=True)
        # multiprocessing's resource tracker is a child too; the engine runs spawn_main
        engines = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        assert len(engines) == 1, [p.cmdline() for p in children]
        body = {"model": "tiny", "prompt": _prompt(12, 3), "max_tokens": 6, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 6
        assert reply["choices"][0]["finish_reason"] == "length"
        too_long = {**body, "prompt": _prompt(CONTEXT + 5, 1)}
        refused = httpx.post(f"{url}/v1/completions", json=too_long, timeout=60)
        assert refused.status_code == 400 and "maximum context length" in refused.text
        metrics = httpx.get(f"{url}/metrics", params={"format": "json"}, timeout=10).json()
        assert metrics["decode_step_rows_total"] >= 5
        # the engine process (under the server this test started) dies: the server says so
        engines[0].kill()
        engines[0].wait(10)
        for _ in range(50):
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code != 200:
                break
            time.sleep(0.1)
        assert health.status_code == 503 and "killed by SIGKILL" in health.text
        dead = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert dead.status_code == 500 and "engine process has ended" in dead.text
    finally:
        server.send_signal(signal.SIGINT)  # the server this test started
        out, _ = server.communicate(timeout=60)
    assert server.returncode == 0, out
    assert "engine process on" in out
    # the engine, and multiprocessing's resource tracker a moment after its server
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_the_engine_process_ends_when_its_server_is_killed(tiny, tmp_path) -> None:
    script = (
        "import sys, time\n"
        "from engine.options import EngineOptions\n"
        "from engine.process.core import CoreSpec\n"
        "from engine.process.client import EngineClient\n"
        f"c = EngineClient(CoreSpec(sys.argv[1], {{'device': 'cpu', 'max_context': {CONTEXT}, "
        "'options': EngineOptions(fast='off'), 'warm_up': False}))\n"
        "print(c.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script, str(tiny)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        engine_pid = int(server.stdout.readline())
        assert psutil.pid_exists(engine_pid)
    finally:
        server.kill()  # the stand-in server this test started, outright: no shutdown runs
        server.wait(30)
    proc = psutil.Process(engine_pid) if psutil.pid_exists(engine_pid) else None
    if proc is not None:
        gone, _ = psutil.wait_procs([proc], timeout=20)
        assert gone or proc.status() == psutil.STATUS_ZOMBIE, "the engine outlived its server"


def test_auto_puts_the_engine_in_its_own_process_on_cuda_only(tiny, run_gpurig) -> None:
    from engine.server.main import _serves_cuda

    assert _serves_cuda("cuda:0") and _serves_cuda("cuda")
    assert not _serves_cuda("cpu") and not _serves_cuda("no-such-device")
    bad = run_gpurig("engine", "serve", "--model", str(tiny), "--engine-process", "maybe")
    assert bad.returncode == 2 and "--engine-process" in bad.stderr and "maybe" in bad.stderr
    from_env = run_gpurig("engine", "serve", "--model", str(tiny),
                          env={"GPURIG_ENGINE_PROCESS": "sometimes"})  # fmt: skip
    assert from_env.returncode == 2 and "use auto, on or off" in from_env.stderr


def test_the_engine_process_is_guessed_before_torch(tmp_path, monkeypatch) -> None:
    """The server starts the engine process before it imports torch when it expects one: "on",
    a CUDA --device, or under "auto" an NVIDIA driver's files (a driver cannot exist here: the
    files stand in for it). torch decides "auto" afterwards."""
    import argparse

    from engine.server import main as serve

    def expected(mode: str, device: str | None = None) -> bool:
        return serve._engine_process_expected(argparse.Namespace(engine_process=mode,
                                                                 device=device))  # fmt: skip

    driver = tmp_path / "version"
    monkeypatch.setattr(serve, "NVIDIA_DRIVER_FILES", (str(driver),))
    assert expected("on") and expected("on", "cpu") and not expected("off", "cuda")
    assert expected("auto", "cuda:1") and expected("auto", "CUDA") and not expected("auto", "cpu")
    assert not expected("auto")  # no driver
    driver.write_text("NVRM version: 580.159.04\n")
    assert expected("auto") and not expected("auto", "cpu")


def test_the_server_starts_its_engine_process_before_importing_torch(tiny) -> None:
    """Through the real command line: when `start_core` is called, this process has not
    imported torch (the spawned process imports it meanwhile, not after)."""
    script = (
        "import sys\n"
        "import engine.process.core as core\n"
        "def start(spec):\n"
        "    print('torch before the engine process:', 'torch' in sys.modules, flush=True)\n"
        "    raise SystemExit(3)\n"
        "core.start_core = start\n"
        "from mcp_server.cli import main\n"
        "sys.exit(main(['engine', 'serve', '--model', sys.argv[1], '--device', 'cuda',\n"
        "               '--no-warmup']))\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(tiny)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 3, run.stderr
    assert "torch before the engine process: False" in run.stdout


def test_a_started_core_serves_its_client_or_is_abandoned(tiny) -> None:
    """`start_core` begins loading at once; an EngineClient takes the started process and
    serves from it; one abandoned (the server chose to load in its own process) is stopped and
    reaped."""
    from engine.process.core import start_core

    spec = CoreSpec(tiny, _options(), torch_threads=1)
    started = start_core(spec)
    c = EngineClient(spec, started=started)
    try:
        assert c.process is started.process
        params = SamplingParams(max_tokens=4, temperature=0.0)
        tokens, out, _ = asyncio.run(_run(c, _prompt(10, 5), params))
        assert len(tokens) == 4 and out.finished
    finally:
        c.close()
    spare = start_core(spec)
    pid = spare.process.pid
    assert psutil.pid_exists(pid)
    spare.abandon()
    assert not spare.process.is_alive() and spare.process.exitcode == -signal.SIGTERM
    assert pid not in {p.pid for p in psutil.Process().children()}
