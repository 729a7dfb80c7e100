"""`gpurig mcp --transport streamable-http`: bind first, say where, then serve.

The SDK's `run("streamable-http")` prints nothing useful at start and dies in uvicorn's bind()
with a raw error when the port is taken. Here the socket is bound before anything else (and
handed to uvicorn, so there is no window for another process to take the port between a check
and the bind): a taken port or a bad address is a GpurigError (CLI exit 2, one line, no
traceback), and the URL is printed on stderr once the port is ours.

Only loopback by default: the tools run programs and rewrite vLLM's files on this host, and
the MCP server has no authentication. Another machine reaches it through an SSH tunnel
(`ssh -L 8765:127.0.0.1:8765 this-host`), or, when asked explicitly (`--allow-remote`), on
another address. On loopback the SDK also checks Host/Origin headers (DNS rebinding).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys

from tools.errors import InvalidInputError, RefusedError, either

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; anything else (0.0.0.0, a LAN address, a name) is not."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, port: int, allow_remote: bool) -> None:
    """Refuse a non-loopback bind address unless the caller asked for it explicitly."""
    if is_loopback(host) or allow_remote:
        return
    raise RefusedError(
        f"{host} is not a loopback address: the MCP tools run programs and rewrite files on "
        "this host, and the server has no authentication",
        remedy=f"keep the default --host 127.0.0.1 and reach it from another machine through "
        f"an SSH tunnel (ssh -L {port}:127.0.0.1:{port} THIS_HOST, then "
        f"http://127.0.0.1:{port}/mcp there); or, on a network you trust, add --allow-remote",
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a clear error saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidInputError(
            f"cannot bind to {host!r}: {exc.strerror or exc}",
            remedy="pass an address of this machine with --host, e.g. 127.0.0.1",
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # as uvicorn binds: a server just stopped (TIME_WAIT) does not block the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RefusedError(
                f"cannot listen on {host}:{port}: the port is already in use",
                remedy="pick a free port with --port, or stop what is using this one "
                f"(ss -ltnp 'sport = :{port}' shows it)",
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise InvalidInputError(
                f"cannot listen on {host}:{port}: {host} is not an address of this machine",
                remedy="pass an address of this machine with --host, e.g. 127.0.0.1",
            ) from None
        if exc.errno == errno.EACCES:
            raise RefusedError(
                f"cannot listen on {host}:{port}: permission denied",
                remedy="use a port above 1023 with --port",
            ) from None
        raise InvalidInputError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            remedy=either(cli="check --host and --port", mcp="check host and port"),
        ) from None
    return sock


def url_for(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/mcp"


def serve_http(
    server, host: str, port: int, allow_remote: bool = False, sock: socket.socket | None = None
) -> None:
    """Serve `server` (an MCPServer) over streamable HTTP on host:port until interrupted;
    `sock` is the listening socket when the caller bound it already (the CLI does, early)."""
    import anyio
    import uvicorn

    check_host(host, port, allow_remote)
    sock = sock or bind(host, port)
    app = server.streamable_http_app(host=host)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    uv = uvicorn.Server(config)
    sys.stderr.write(f"gpurig mcp: serving MCP over streamable HTTP at {url_for(host, port)}\n")
    if not is_loopback(host):
        sys.stderr.write("gpurig mcp: warning: listening beyond loopback with no authentication\n")
    sys.stderr.flush()
    try:
        anyio.run(lambda: uv.serve(sockets=[sock]))
    finally:
        sock.close()
