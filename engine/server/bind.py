"""The address the engine server listens on, checked before anything loads: refused with a
message that says which part is wrong (an engine error, exit 2 at the front door), and the
warning a server reachable beyond this machine prints."""

from __future__ import annotations

import errno
import ipaddress
import re
import socket

from engine.errors import GpurigError, InvalidInputError, RefusedError
from engine.serve_options import API_KEY_ENV, DEFAULT_PORT

BIND_REMEDY = (
    "use 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or an address of this machine"
)


def check_bind(host: str, port: int) -> bool:
    """Refuse an address or port the server could not listen on, saying which is wrong; True
    when every address `host` stands for is a loopback one."""
    if not 0 < port < 65536:
        raise InvalidInputError(f"port {port} is out of range", "use a port between 1 and 65535")
    if re.fullmatch(r"[0-9.]+", host):  # looks like IPv4: never ask DNS about it
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise InvalidInputError(
                f"--host {host} is not a valid IPv4 address", BIND_REMEDY
            ) from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidInputError(
            f"--host {host}: cannot resolve it ({getattr(exc, 'strerror', None) or exc})",
            f"check the name, or {BIND_REMEDY}",
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as uvicorn binds: connections of a server just stopped (TIME_WAIT) do not count,
        # a socket listening on the port does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise bind_error(host, port, exc) from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def bind_error(host: str, port: int, exc: OSError) -> GpurigError:
    """The error for a failed bind, by its errno."""
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return RefusedError(
            f"{where}: the port is in use",
            "pick a free port with --port, or stop what is using this one",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return InvalidInputError(f"{where}: {host} is not an address of this machine", BIND_REMEDY)
    if exc.errno == errno.EACCES:
        return RefusedError(
            f"{where}: ports below 1024 need root",
            f"use a port of 1024 or more (default {DEFAULT_PORT})",
        )
    return RefusedError(f"{where}: {exc.strerror or exc}", BIND_REMEDY)


def exposure_warning(host: str, port: int, api_key: str | None) -> str:
    """What a server listening beyond loopback prints: a note with a key, a warning without."""
    if api_key:
        return (
            f"gpurig engine: note: listening on {host}:{port}, reachable beyond this machine. "
            "/v1 needs the API key; /health and /metrics are open; traffic is plain HTTP (put "
            "TLS in front, or tunnel over ssh).\n"
        )
    return (
        f"gpurig engine: WARNING: listening on {host}:{port}, reachable beyond this machine, "
        "WITHOUT an API key: anyone who reaches this port can use the model. Pass --api-key KEY "
        f"(or set {API_KEY_ENV}), or keep --host 127.0.0.1 and tunnel "
        f"(ssh -L {port}:127.0.0.1:{port} THIS_HOST).\n"
    )
