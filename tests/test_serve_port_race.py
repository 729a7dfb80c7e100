"""A server's port taken by another process between the free-port check and the bind: what
answers there is not the server gpurig started, so the wait must not call it ready (a CI run
once saw a failing vLLM start marked ready because the healthy one had drawn the same port).
Real processes and real HTTP servers on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from serve_support import free_port

from tools.serving import ServerRecord
from tools.serving import state as st
from tools.serving.lifecycle import wait_ready
from tools.serving.process import listens_on

# a tiny OpenAI-shaped server: /health 200, /v1/models listing argv[2], on port argv[1]
SERVER = """
import http.server, json, sys
port, model = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"{}" if self.path == "/health" else json.dumps({"data": [{"id": model}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _serve(port: int, model: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), model])
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
            return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("the stand-in server never answered")


def _record(tmp_path: Path, proc: subprocess.Popen, port: int, name: str) -> ServerRecord:
    return ServerRecord(
        name=name, backend="engine", pid=proc.pid,
        pid_create_time=psutil.Process(proc.pid).create_time(), port=port, host="127.0.0.1",
        base_url=f"http://127.0.0.1:{port}/v1", model="mine", served_model_name="mine",
        state="starting", log_path=str(tmp_path / f"{name}.log"),
        exit_path=str(tmp_path / f"{name}.exit.json"), command=["stand-in"],
        started_at=st.now_iso(),
    )  # fmt: skip


def test_what_answers_on_a_taken_port_is_not_called_ready(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    (tmp_path / "late.log").write_text("")
    port = free_port()
    other = _serve(port, "other")  # took the port: one model, not ours
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert listens_on(other.pid, port) is True
        assert listens_on(ours.pid, port) is False
        record = wait_ready(_record(tmp_path, ours, port, "late"), timeout_s=2.0)
        assert record.state != "ready", record
        assert record.served_model_name == "mine"  # not adopted from the other server
    finally:
        ours.kill()
        other.kill()


def test_a_server_that_holds_its_port_is_ready(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    (tmp_path / "own.log").write_text("")
    port = free_port()
    ours = _serve(port, "mine")
    try:
        record = wait_ready(_record(tmp_path, ours, port, "own"), timeout_s=20.0)
        assert record.state == "ready", record
    finally:
        ours.kill()
