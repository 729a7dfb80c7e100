"""A real MCP client session against the installed `gpurig mcp` console script.

Over stdio, as Claude Code and Claude Desktop run it: every tool is listed with input and output
schemas and annotations, the host tools are called, bad arguments come back as error results,
and the server keeps serving afterwards. Then once over streamable HTTP on loopback.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
from mcp import Client, StdioServerParameters

from tools.doctor import DoctorReport
from tools.gpu import GpuArchReport
from tools.host import HostCapacity

HOST_TOOLS = {"check_host_capacity", "verify_gpu_arch", "doctor"}


def _text(result) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


async def _stdio_session(gpurig_bin: str, tmp_path: Path) -> None:
    params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=dict(os.environ))
    async with Client(params, read_timeout_seconds=120) as client:
        listed = (await client.list_tools()).tools
        names = {t.name for t in listed}
        assert names >= HOST_TOOLS
        for tool in listed:  # every tool, whichever area registered it
            assert tool.input_schema.get("type") == "object", tool.name
            assert tool.output_schema and tool.output_schema.get("type") == "object", tool.name
            assert tool.annotations is not None, tool.name
            assert (tool.description or "").strip(), tool.name
        by_name = {t.name: t for t in listed}
        for name in HOST_TOOLS:
            assert by_name[name].annotations.read_only_hint is True
        assert "need_gib" in by_name["check_host_capacity"].input_schema["properties"]
        assert "verdict" in by_name["verify_gpu_arch"].output_schema["properties"]

        # check_host_capacity: structured content that validates as the tool's model
        missing = tmp_path / "not" / "yet"
        result = await client.call_tool("check_host_capacity", {"paths": [str(missing)]})
        assert not result.is_error, _text(result)
        report = HostCapacity.model_validate(result.structured_content)
        assert report.paths[0].exists is False
        assert report.paths[0].measured_at == str(tmp_path)

        # verify_gpu_arch: no GPU on CI -> a verdict, not an error
        result = await client.call_tool("verify_gpu_arch", {})
        assert not result.is_error, _text(result)
        gpu = GpuArchReport.model_validate(result.structured_content)
        assert gpu.probe is not None and gpu.probe.torch.imported
        if not gpu.nvml.available:
            assert gpu.verdict == "fail" and "no NVIDIA GPU visible" in gpu.summary

        # bad arguments: error results, each saying what is wrong
        bad = await client.call_tool("check_host_capacity", {"need_gib": "lots"})
        assert bad.is_error and "need_gib" in _text(bad)
        bad = await client.call_tool("check_host_capacity", {"need_gib": -1})
        assert bad.is_error and "greater than 0" in _text(bad)
        bad = await client.call_tool("check_host_capacity", {"paths": [""]})
        assert bad.is_error and "empty path" in _text(bad)
        bad = await client.call_tool("verify_gpu_arch", {"python_bin": str(tmp_path / "nope")})
        assert bad.is_error
        assert "does not exist" in _text(bad) and "What to do" in _text(bad)
        bad = await client.call_tool("no_such_tool", {})
        assert bad.is_error

        # ... and the server keeps serving
        result = await client.call_tool("doctor", {})
        assert not result.is_error, _text(result)
        doc = DoctorReport.model_validate(result.structured_content)
        assert [c.name for c in doc.checks][:2] == ["filesystems", "host memory"]
        result = await client.call_tool("check_host_capacity", {"need_gib": 1})
        assert not result.is_error


def test_stdio_session(gpurig_bin: str, tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(_stdio_session(gpurig_bin, tmp_path), timeout=180))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _http_session(url: str) -> None:
    async with Client(url) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert names >= HOST_TOOLS
        result = await client.call_tool("check_host_capacity", {"paths": ["/"]})
        assert not result.is_error
        assert HostCapacity.model_validate(result.structured_content).paths[0].real_path == "/"


def test_streamable_http(gpurig_bin: str) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [
            gpurig_bin,
            "mcp",
            "--transport",
            "streamable-http",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the HTTP server did not come up in 30 s"
                time.sleep(0.2)
        asyncio.run(asyncio.wait_for(_http_session(url), timeout=60))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
