"""The real thing end to end: `gpurig engine serve` on a tiny scripted checkpoint, started by one
`gpurig mcp` process (stdio, as Claude Code runs it) with progress notifications, outliving it,
then seen, queried, spot-checked and stopped by a SECOND `gpurig mcp` process; the port is free
again afterwards.

The checkpoint is real (W4A16, tiny) but scripted (tests/server_support.py): after the end of
the generation prompt its greedy decode writes "391" and ends the turn. So the seeds' first
check passes and the other two fail, with the answer shown: spot_check judges real output.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters
from serve_support import free_port
from server_support import make_scripted_checkpoint

from tools.errors import RefusedError
from tools.serving import (
    LogsResult,
    QueryResult,
    ServerRecord,
    SpotCheckResult,
    StatusReport,
    StopResult,
    server_status,
    start_vllm_server,
    stop_vllm_server,
)
from tools.serving import state as st

END_OF_PROMPT = 101  # "<channel|>": the end of a thinking-off generation prompt
END_OF_TURN = 106


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "scripted"
    make_scripted_checkpoint(path, [[END_OF_PROMPT, "391", END_OF_TURN]])
    return path


def _text(result) -> str:
    return " ".join(getattr(b, "text", "") for b in result.content)


async def _call(client: Client, name: str, args: dict, **kw):
    result = await client.call_tool(name, args, **kw)
    assert not result.is_error, _text(result)
    return result.structured_content


async def _first_session(params: StdioServerParameters, model: Path, port: int) -> tuple:
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with Client(params, read_timeout_seconds=120) as client:
        args = {"model": str(model), "backend": "engine", "name": "e2e", "port": port,
                "device": "cpu", "timeout_s": 90}  # fmt: skip
        record = ServerRecord.model_validate(
            await _call(client, "start_vllm_server", args, progress_callback=on_progress)
        )
    return record, progress


async def _second_session(params: StdioServerParameters) -> tuple:
    async with Client(params, read_timeout_seconds=120) as client:
        status = StatusReport.model_validate(await _call(client, "server_status", {}))
        query = QueryResult.model_validate(
            await _call(client, "query_model", {"prompt": "What is 17*23?", "max_tokens": 8})
        )
        check = SpotCheckResult.model_validate(
            await _call(client, "spot_check", {"checks": [{"prompt": "17 times 23?",
                                                           "expect": "391"}]})
        )  # fmt: skip
        logs = LogsResult.model_validate(
            await _call(client, "get_server_logs", {"name": "e2e", "grep": "chat/completions"})
        )
        bad = await client.call_tool("stop_vllm_server", {"name": "no-such"})
        assert bad.is_error and "no server named" in _text(bad) and "What to do" in _text(bad)
        stop = StopResult.model_validate(await _call(client, "stop_vllm_server", {}))
        after = StatusReport.model_validate(await _call(client, "server_status", {"name": "e2e"}))
    return status, query, check, logs, stop, after


def test_engine_lifecycle_across_two_mcp_processes(gpurig_bin, scripted, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("GPURIG_HOME", str(home))
    env = {**os.environ, "GPURIG_HOME": str(home)}
    params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=env)
    port = free_port()

    record, progress = asyncio.run(
        asyncio.wait_for(_first_session(params, scripted, port), timeout=150)
    )
    assert record.state == "ready", record.failure
    assert record.base_url == f"http://127.0.0.1:{port}/v1"
    assert record.served_model_name == "scripted"
    assert record.command[1:4] == ["-m", "engine.server", "--model"]
    assert record.startup_facts.device == "cpu" and record.startup_facts.max_context
    # the KV block pool's line, in vLLM's words, read by the same parser as vLLM's
    facts = record.startup_facts
    assert facts.kv_cache_tokens and facts.max_concurrency_tokens == facts.max_context
    assert facts.max_concurrency == round(facts.kv_cache_tokens / facts.max_context, 2)
    assert progress and progress[-1][2] == "ready"
    assert [p[0] for p in progress] == sorted(p[0] for p in progress)  # increasing
    assert all(p[1] == 90 for p in progress)
    # the MCP server that started it has exited; the server has not
    assert not asyncio.run(_port_closed(port))
    with pytest.raises(RefusedError, match="still running"):  # same name, while it runs
        start_vllm_server(str(scripted), backend="engine", name="e2e", port=free_port())
    with pytest.raises(RefusedError, match=f"port {port}"):
        start_vllm_server(str(scripted), backend="engine", name="other", port=port)

    status, query, check, logs, stop, after = asyncio.run(
        asyncio.wait_for(_second_session(params), timeout=150)
    )
    (server,) = status.servers
    assert (server.name, server.state, server.health) == ("e2e", "ready", "ok")
    assert server.uptime_s > 0 and server.server_pid and server.server_pid != server.pid
    assert query.text == "391" and query.finish_reason == "stop"
    assert query.completion_tokens >= 1 and query.ttft_s is not None
    assert query.prompt_tokens > 5
    by_expect = {c.expect: c for c in check.checks}
    assert by_expect["391"].passed and by_expect["391"].answer == "391"
    assert not by_expect["Canberra"].passed and by_expect["Canberra"].answer == "391"
    assert not by_expect["Au"].passed
    assert (check.passed, check.failed, check.ok) == (2, 2, False)
    assert logs.lines and all("chat/completions" in ln for ln in logs.lines)
    assert stop.name == "e2e" and stop.was == "ready" and stop.signal == "SIGTERM"
    assert not stop.killed_after_timeout and stop.port_free
    assert after.servers[0].state == "stopped"
    assert asyncio.run(_port_closed(port))
    assert server_status().servers[0].state == "stopped"
    assert stop_vllm_server("e2e").signalled is False  # stopping a stopped server is fine


async def _port_closed(port: int) -> bool:
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    w.close()
    return False


def test_two_engines_at_once_by_name(scripted, tmp_path, monkeypatch):
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    try:
        a = start_vllm_server(str(scripted), backend="engine", name="a", port=free_port(),
                              device="cpu", timeout_s=90,
                              extra_args=["--no-warmup", "--max-num-seqs", "2"])  # fmt: skip
        b = start_vllm_server(str(scripted), backend="engine", name="b", port=free_port(),
                              device="cpu", timeout_s=90, wait=False)  # fmt: skip
        assert a.state == "ready" and b.state == "starting"
        assert "--no-warmup" in a.command
        # vLLM's batch-size flag, passed through to the engine's scheduler
        assert a.command[a.command.index("--max-num-seqs") + 1] == "2"
        assert "max_num_seqs 2" in Path(a.log_path).read_text()
        with pytest.raises(Exception, match="2 servers are running"):
            stop_vllm_server()
        assert stop_vllm_server("a").port_free
        assert {s.name: s.state for s in server_status().servers}["a"] == "stopped"
    finally:
        for r in st.list_records():
            stop_vllm_server(r.name, timeout_s=5)
    for rec in st.list_records():  # both ports free again
        with socket.socket() as s:
            s.bind(("127.0.0.1", rec.port))
