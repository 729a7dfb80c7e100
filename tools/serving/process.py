"""Detached server processes: start one that outlives its starter, know it again, stop it.

A server runs in its own session and process group (start_new_session=True) under
supervise.py, with stdin from /dev/null and stdout/stderr into its log file: never the MCP
server's stdout, which is the protocol wire over stdio. A process is "ours" only while its pid
AND its start time (psutil create_time) match the record, so a pid the kernel has since handed
to another process is never signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

SUPERVISOR = Path(__file__).with_name("supervise.py")
CREATE_TIME_SLACK_S = 0.05


def spawn(
    command: list[str], env: dict[str, str], log_path: Path, exit_path: Path, cwd: str
) -> tuple[int, float]:
    """Start `command` under the supervisor, detached; returns (pid, create_time) of the leader."""
    exit_path.unlink(missing_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        proc = subprocess.Popen(
            [sys.executable, str(SUPERVISOR), str(exit_path), "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd=cwd,
        )
    reap_when_done(proc)
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        created = 0.0  # died at once; the exit file tells why
    return proc.pid, created


def reap_when_done(proc: subprocess.Popen) -> None:
    """Wait for a detached child on a daemon thread: unreaped, it lingers as a zombie for as
    long as this process (a long-lived MCP server) lives."""
    threading.Thread(target=proc.wait, daemon=True, name=f"reap-{proc.pid}").start()


def is_ours(pid: int, create_time: float) -> bool:
    """Alive, not a zombie, and started when the record says: the process gpurig started."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > CREATE_TIME_SLACK_S:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (vLLM's engine-core workers among them)."""
    out: list[int] = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def listens_on(pid: int, port: int) -> bool | None:
    """Whether `pid` or a process under it holds a listening socket on `port`; None when this
    host will not say (no permission to read the sockets). A server started on a port that
    another process took in the meantime fails to bind, and what answers there is not it."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    unknown = False
    for proc in procs:
        try:
            read = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
            conns = read(kind="inet")
        except psutil.AccessDenied:
            unknown = True
            continue
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in conns):  # fmt: skip
            return True
    return None if unknown else False


def server_child(pid: int) -> int | None:
    """The server under the supervisor (its first child), when alive."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return None
    return children[0].pid if children else None


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_group(pid: int, create_time: float, timeout_s: float) -> tuple[str | None, bool, float]:
    """SIGTERM the group led by `pid` (only if it is ours), wait, SIGKILL what is left after
    `timeout_s`. Returns (last signal sent or None, killed after the timeout, seconds)."""
    started = time.monotonic()
    if not is_ours(pid, create_time):
        return None, False, 0.0
    try:
        if os.getpgid(pid) != pid:  # not a group leader: not a process gpurig started
            return None, False, 0.0
    except ProcessLookupError:
        return None, False, 0.0
    sent: str | None = "SIGTERM" if _signal_group(pid, signal.SIGTERM) else None
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if not group_members(pid):
            return sent, False, round(time.monotonic() - started, 2)
        time.sleep(0.1)
    killed = _signal_group(pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return ("SIGKILL" if killed else sent), killed, round(time.monotonic() - started, 2)


def connect_host(host: str) -> str:
    """Where to reach a server bound to `host` from here (a wildcard means loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def port_free(host: str, port: int) -> bool:
    """Could a server listen on host:port now? (as uvicorn binds: SO_REUSEADDR, so sockets in
    TIME_WAIT from a server just stopped do not count, a listener does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free on `host` now (bind to port 0), for a server started next."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_near(host: str, port: int) -> int | None:
    for candidate in range(port + 1, min(port + 50, 65536)):
        if port_free(host, candidate):
            return candidate
    return None
