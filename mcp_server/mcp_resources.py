"""MCP resources: the logs of the servers gpurig started, readable without a tool call.

A client (Claude Code: `@gpurig:gpurig://servers/NAME/log`) can attach a server's log to a
conversation, e.g. after start_vllm_server reported a failure. Two resources, both read-only and
bounded, over the files the serving tools write under the state directory
(tools/serving/state.py: state_dir()/servers/<name>.log):

- `gpurig://servers`: the servers that have a log, as JSON (name, size, last change, log URI);
- `gpurig://servers/{name}/log`: the last LOG_TAIL_LINES lines of one log (at most
  LOG_TAIL_BYTES read, from the end: a log of gigabytes costs the same as a small one).

Reading creates nothing: a state directory that does not exist yet means no servers.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError

from tools.errors import GpurigError
from tools.serving.state import check_name, servers_dir

LOG_TAIL_LINES = 400
LOG_TAIL_BYTES = 256 * 1024
MAX_LISTED = 64


def _logs() -> list[tuple[Path, os.stat_result]]:
    """Each log with its stat, newest first: one stat per file (a log removed meanwhile is
    left out)."""
    found = []
    try:
        for path in servers_dir(create=False).glob("*.log"):
            try:
                info = path.stat()
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((path, info))
    except OSError:
        return []
    return sorted(found, key=lambda item: item[1].st_mtime, reverse=True)[:MAX_LISTED]


def list_servers() -> str:
    """JSON: each server with a log, newest first."""
    rows = [
        {
            "name": log.stem,
            "log_bytes": info.st_size,
            "modified": datetime.fromtimestamp(info.st_mtime, UTC).isoformat(timespec="seconds"),
            "log": f"gpurig://servers/{log.stem}/log",
        }
        for log, info in _logs()
    ]
    return json.dumps({"state_dir": str(servers_dir(create=False)), "servers": rows}, indent=2)


def tail_log(name: str) -> str:
    """The last lines of server `name`'s log; ResourceError when there is none."""
    try:
        check_name(name)
    except GpurigError as err:
        raise ResourceError(f"{err.message}: {err.remedy}") from None
    path = servers_dir(create=False) / f"{name}.log"
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - LOG_TAIL_BYTES))
            data = fh.read(LOG_TAIL_BYTES)
    except FileNotFoundError:
        known = ", ".join(p.stem for p, _ in _logs()) or "none yet"
        raise ResourceError(
            f"no log for a server named {name!r} (servers with logs: {known})"
        ) from None
    except OSError as exc:
        raise ResourceError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > LOG_TAIL_BYTES and lines:
        lines = lines[1:]  # the first line was cut by the seek
    shown = lines[-LOG_TAIL_LINES:]
    head = f"# {path}: the last {len(shown)} lines ({size:,} bytes in all)\n"
    return head + "\n".join(shown) + ("\n" if shown else "")


def register(mcp: MCPServer) -> None:
    @mcp.resource(
        "gpurig://servers",
        title="Servers gpurig started",
        description="Each server with a log under the state directory: name, size, last change "
        "and the URI of its log",
        mime_type="application/json",
    )
    def servers() -> str:
        return list_servers()

    @mcp.resource(
        "gpurig://servers/{name}/log",
        title="Server log",
        description=f"The last {LOG_TAIL_LINES} lines of a server's log (vLLM or the engine), "
        "as start_vllm_server wrote it",
        mime_type="text/plain",
    )
    def server_log(name: str) -> str:
        return tail_log(name)
