"""The gpurig MCP server.

`mcp` at module level is what `gpurig mcp` runs. Each area adds its tools from its own module
(`mcp_host`, `mcp_patch`, ...) through `register(mcp)`; a tool there is a thin wrapper that calls
the function in tools/ (or patches/, bench/, engine/) and returns its pydantic model, which
becomes the tool's structured output and outputSchema. Register with the plain decorator,
`@mcp.tool(title="...", annotations=READ_ONLY)`, and let a GpurigError propagate: `mcp` is a
GpurigMCP (mcp_base.py), which checks and bounds every tool's arguments, words argument errors
plainly and turns a GpurigError into its message and remedy, for every module alike.

Logging goes to stderr only: over stdio, stdout is the wire.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by `mcp dev mcp_server/server.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mcp_server import (
    mcp_compare,
    mcp_eval,
    mcp_host,
    mcp_llamacpp,
    mcp_patch,
    mcp_resources,
    mcp_serve,
    mcp_sweep,
    mcp_up,
)
from mcp_server.mcp_base import GpurigMCP

log = logging.getLogger("gpurig.mcp")

INSTRUCTIONS = (
    "gpurig gets a small LLM (Gemma 4 E2B) served on this machine's GPU and verifies it. "
    "Start with `doctor` for a readiness report, then check_host_capacity and verify_gpu_arch. "
    "Every tool returns a structured report; a failure explains what to do."
)

# Modules with `register(mcp)`, in the order their tools appear.
TOOL_MODULES = [
    mcp_host,
    mcp_patch,
    mcp_serve,
    mcp_sweep,
    mcp_compare,
    mcp_eval,
    mcp_llamacpp,
    mcp_up,
    mcp_resources,  # resources (server logs), not tools
]

mcp: GpurigMCP = GpurigMCP("gpurig", instructions=INSTRUCTIONS, log_level="WARNING")

for _module in TOOL_MODULES:
    _module.register(mcp)
mcp.drop_empty_capabilities()  # after every module: advertise prompts/resources only if any


def serve(
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
    allow_remote: bool = False,
    sock: socket.socket | None = None,
) -> None:
    """Run the server on stdio or streamable HTTP (loopback unless allow_remote; `sock`: a
    socket the caller already bound to host:port)."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if transport == "stdio":
        mcp.run("stdio")
    else:
        from mcp_server.mcp_http import serve_http

        serve_http(mcp, host=host, port=port, allow_remote=allow_remote, sock=sock)


if __name__ == "__main__":
    serve()
