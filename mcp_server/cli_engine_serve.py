"""`gpurig engine serve`: the engine behind an OpenAI-compatible HTTP API (uvicorn + starlette).

A thin front door: it checks its arguments, the model path and the bind address (before torch is
imported, so mistakes cost nothing), sets the CPU thread count, loads the checkpoint with
`engine.load`, and runs `engine.server.create_app` under uvicorn.

Threads: torch's default is one thread per core, each spinning at a barrier after every op. A
batch-1 decode runs hundreds of small ops per token, so as soon as one core is busy with anything
else (the server's own event loop, a tokenising request, another process) every op waits for the
descheduled thread: on a shared 2-core machine 5.9 tok/s, against 45 with one thread. The default
is that of the other engine commands (the idle cores this process may run on, at most 8) less one,
which leaves room for the server's own work; decode at batch 1 is bound by memory bandwidth and
gains little from more threads. OMP_NUM_THREADS, when set, is respected; --threads overrides both.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import re
import socket
import sys

from mcp_server.cli_engine import MAX_DEFAULT_THREADS
from mcp_server.cli_engine import default_threads as engine_default_threads
from tools.errors import GpurigError, InvalidInputError, NotFoundError, RefusedError

DEFAULT_PORT = 8100
DEFAULT_MAX_CTX = 131072
# the same defaults as engine/server/limits.py, not imported from there: importing engine.server
# pulls in starlette, and this module stays light until the command runs
DEFAULT_MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_BODY_MIB = 8
API_KEY_ENV = "GPURIG_ENGINE_API_KEY"


def default_threads() -> int:
    """The engine commands' default (the idle cores this process may use, 1..8) less one for
    the server's own event loop and tokenising threads, at least 1 (see the module docstring)."""
    return max(1, engine_default_threads() - 1)


class _HelpFormatter(argparse.HelpFormatter):
    """Fills in the --threads default only when the help is shown: it reads the load average
    through psutil, which every `gpurig` start (the parser is built each time) would pay."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action) or ""
        return text.replace("{here}", str(default_threads())) if action.dest == "threads" else text


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        formatter_class=_HelpFormatter,
        help="serve a checkpoint over an OpenAI-compatible API (/v1/chat/completions, ...)",
        description=(
            "Serve a Gemma 4 W4A16 checkpoint: POST /v1/chat/completions and /v1/completions "
            "(streaming, tools), GET /v1/models, /health, /metrics and /openapi.json. "
            "Concurrent requests share each decode step (continuous batching over a KV block "
            "pool); requests beyond --max-num-seqs wait in arrival order."
        ),
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
        "network, use --api-key then)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--max-context",
        "--max-ctx",
        dest="max_context",
        type=int,
        default=DEFAULT_MAX_CTX,
        help=f"context length in tokens (default {DEFAULT_MAX_CTX}, capped at the model's "
        "max_position_embeddings; --max-ctx is an alias)",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if present)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: OMP_NUM_THREADS if set, else the idle "
        f"cores less one, 1..{MAX_DEFAULT_THREADS}: {{here}} here)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
        "/health and /metrics stay open)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=DEFAULT_MAX_TOKENS_LIMIT,
        help=f"most tokens one request may generate (default {DEFAULT_MAX_TOKENS_LIMIT}; 0: up "
        "to the context); a request asking more, or nothing, is cut to it and its reply says so "
        "(header X-Gpurig-Max-Tokens-Capped, field max_tokens_capped)",
    )
    p.add_argument(
        "--max-body-mib",
        type=float,
        default=DEFAULT_MAX_BODY_MIB,
        help=f"largest request body in MiB (default {DEFAULT_MAX_BODY_MIB}; bodies that cannot "
        "fit the context are refused below it)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_seqs,
        default="auto",
        help="most requests decoded together (1-64; default auto: 16, or fewer when the memory "
        "left after the weights cannot give each 4,096 tokens of KV cache)",
    )
    p.add_argument(
        "--memory-cap-mib",
        type=_positive_int,
        default=None,
        help="cap this process's CUDA memory (MiB), e.g. 3732 to act as a 4 GB card; the KV "
        "pool is sized within it",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=_positive_int,
        default=None,
        help="KV block pool size in MiB (default: what is left after the weights, less room "
        "for reading prompts)",
    )
    p.add_argument(
        "--prefill-budget",
        type=_positive_int,
        default=None,
        help="most prompt tokens read between two decode steps (default 2048 on CUDA): lower "
        "keeps streams smoother while long prompts arrive, higher reads them faster",
    )
    p.add_argument(
        "--model-name", default=None, help="name clients use in 'model' (default: directory name)"
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="skip the 2-token warm-up run before serving"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (info shows one line per request)",
    )
    p.set_defaults(func=_serve)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _seqs(text: str) -> int | str:
    if text == "auto":
        return text
    value = _positive_int(text)
    if value > 64:
        raise argparse.ArgumentTypeError(f"{value} is more than 64; use 1-64 or auto")
    return value


_BIND_REMEDY = (
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
                f"--host {host} is not a valid IPv4 address", _BIND_REMEDY
            ) from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidInputError(
            f"--host {host}: cannot resolve it ({getattr(exc, 'strerror', None) or exc})",
            f"check the name, or {_BIND_REMEDY}",
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as uvicorn binds: connections of a server just stopped (TIME_WAIT) do not count,
        # a socket listening on the port does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise _bind_error(host, port, exc) from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _bind_error(host: str, port: int, exc: OSError) -> GpurigError:
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return RefusedError(
            f"{where}: the port is in use",
            "pick a free port with --port, or stop what is using this one",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return InvalidInputError(f"{where}: {host} is not an address of this machine", _BIND_REMEDY)
    if exc.errno == errno.EACCES:
        return RefusedError(
            f"{where}: ports below 1024 need root",
            f"use a port of 1024 or more (default {DEFAULT_PORT})",
        )
    return RefusedError(f"{where}: {exc.strerror or exc}", _BIND_REMEDY)


def _exposure_warning(host: str, port: int, api_key: str | None) -> str:
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


def _check_args(args: argparse.Namespace) -> None:
    if args.max_context < 1:
        raise InvalidInputError(
            f"--max-context {args.max_context} must be at least 1", "use e.g. 8192"
        )
    if args.threads is not None and args.threads < 1:
        raise InvalidInputError(
            f"--threads {args.threads} must be at least 1", f"use e.g. {default_threads()}"
        )
    if args.max_tokens_limit < 0:
        raise InvalidInputError(
            f"--max-tokens-limit {args.max_tokens_limit} is negative",
            f"use e.g. {DEFAULT_MAX_TOKENS_LIMIT}, or 0 for no limit",
        )
    if not 0 < args.max_body_mib <= 1024:
        raise InvalidInputError(
            f"--max-body-mib {args.max_body_mib} is out of range", "use 1 to 1024 (default 8)"
        )


def _threads(args: argparse.Namespace) -> int | None:
    """The thread count to set, or None to leave torch's (OMP_NUM_THREADS, set by the user)."""
    if args.threads is not None:
        return args.threads
    return None if os.environ.get("OMP_NUM_THREADS") else default_threads()


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise NotFoundError(
            f"{model_dir} is not a directory", "pass a checkpoint directory to --model"
        )
    _check_args(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not check_bind(args.host, args.port):
        sys.stderr.write(_exposure_warning(args.host, args.port, api_key))
        sys.stderr.flush()

    from engine.config import load_config  # light: no torch yet

    # a directory that is no checkpoint fails here (a CheckpointError: a GpurigError like every
    # tool's, so main() prints it and exits 2), before torch is imported
    limit = load_config(model_dir).max_position_embeddings

    import torch
    import uvicorn

    import engine
    from engine.server import create_app
    from engine.server.limits import ServerOptions

    threads = _threads(args)
    if threads is not None:
        torch.set_num_threads(threads)
    max_ctx = min(args.max_context, limit)
    eng = engine.load(
        model_dir,
        device=args.device,
        max_context=max_ctx,
        memory_cap_mib=args.memory_cap_mib,
        options=engine.EngineOptions.from_env(),
        max_num_seqs=args.max_num_seqs,
        prefill_budget=args.prefill_budget,
        kv_cache_mib=args.kv_cache_mib,
        warm_up=not args.no_warmup,
    )
    from engine.batching import kv_cache_line

    line = kv_cache_line(eng.batching, eng.pool.nbytes(), eng.device.type)
    sys.stderr.write(f"gpurig engine: {line}\n")
    if not args.no_warmup:  # first-use costs (kernel builds, allocations) stay out of timings
        import time

        t0 = time.perf_counter()
        if eng.device.type == "cuda":
            sys.stderr.write(
                "gpurig engine: warming up (on a GPU without shipped tiles the first run also "
                "tunes every GEMV shape, a few minutes once; cached per GPU name)\n"
            )
        eng.generate([eng.bos_id if eng.bos_id is not None else 2], 2, stop_ids=[])
        sys.stderr.write(f"gpurig engine: warmed up in {time.perf_counter() - t0:.2f} s\n")
    name = args.model_name or eng.model_name
    aliases = (str(args.model), str(model_dir), str(model_dir.resolve()))
    options = ServerOptions(
        api_key=api_key,
        max_tokens_limit=args.max_tokens_limit or None,
        max_body_bytes=int(args.max_body_mib * 1024 * 1024),
    )
    app = create_app(eng, model_name=name, aliases=aliases, options=options)
    capped = f" (capped from {args.max_context})" if max_ctx < args.max_context else ""
    cap = args.max_tokens_limit or "none"
    sys.stderr.write(
        f"gpurig engine: serving '{name}' on http://{args.host}:{args.port}/v1 "
        f"(device {eng.device}, context {eng.max_context}{capped}, {torch.get_num_threads()} "
        f"CPU threads, max_tokens limit {cap}, API key {'on' if api_key else 'off'})\n"
    )
    sys.stderr.flush()
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0
