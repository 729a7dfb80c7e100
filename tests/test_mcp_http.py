"""`gpurig mcp --transport streamable-http` as a user starts it: real processes on loopback.

It says where it listens (on stderr, stdout stays clean), a taken port or a foreign address is
one clear line and exit 2 (no uvicorn traceback), and an address beyond loopback is refused
unless --allow-remote, with the SSH tunnel to use instead.
"""

from __future__ import annotations

import asyncio
import selectors
import socket
import subprocess
import time

from mcp import Client

MCP_ARGS = ["mcp", "--transport", "streamable-http"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line the server writes on stderr, waiting at most `timeout` seconds."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        if sel.select(timeout=deadline - time.monotonic()):
            chunk = proc.stderr.read1(4096) if hasattr(proc.stderr, "read1") else b""
            if not chunk:
                break
            line += chunk
    return line.decode(errors="replace")


async def _list(url: str) -> set[str]:
    async with Client(url) as client:
        assert client.server_info.version  # serverInfo carries the package version
        return {t.name for t in (await client.list_tools()).tools}


def test_prints_its_url_and_serves(gpurig_bin: str) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [gpurig_bin, *MCP_ARGS, "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        line = _first_line(proc, timeout=30)
        assert url in line, line
        # the port is bound before the line is printed: a client can connect right away
        names = asyncio.run(asyncio.wait_for(_list(url), timeout=60))
        assert {"doctor", "verify_gpu_arch"} <= names
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert out == b""  # nothing on stdout


def _run(gpurig_bin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [gpurig_bin, *MCP_ARGS, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_taken_port_is_one_clear_line(gpurig_bin: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = _run(gpurig_bin, "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in out.stderr
    assert "--port" in out.stderr  # the remedy, in the CLI's words
    assert "Traceback" not in out.stderr and "uvicorn" not in out.stderr.lower()
    assert len(out.stderr.splitlines()) <= 3


def test_beyond_loopback_needs_allow_remote(gpurig_bin: str) -> None:
    port = _free_port()
    out = _run(gpurig_bin, "--host", "0.0.0.0", "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert "0.0.0.0 is not a loopback address" in out.stderr
    assert f"ssh -L {port}:127.0.0.1:{port}" in out.stderr and "--allow-remote" in out.stderr
    # asked explicitly, but not an address of this machine (TEST-NET-1): a clear line too
    out = _run(gpurig_bin, "--host", "192.0.2.1", "--port", str(port), "--allow-remote")
    assert out.returncode == 2, out.stderr
    assert "192.0.2.1 is not an address of this machine" in out.stderr
    assert "Traceback" not in out.stderr


def test_loopback_forms_are_loopback() -> None:
    from mcp_server.mcp_http import is_loopback, url_for

    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.org", ""):
        assert not is_loopback(host), host
    assert url_for("::1", 8765) == "http://[::1]:8765/mcp"
