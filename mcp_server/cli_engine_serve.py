"""`gpurig engine serve`: the engine behind an OpenAI-compatible HTTP API (uvicorn + starlette).

A thin front door: it checks its arguments, the model path and the bind address (before torch is
imported, so mistakes cost nothing), sets the CPU thread count, loads the checkpoint with
`engine.load`, and runs `engine.server.create_app` under uvicorn. Where the engine gets a process
of its own, that process is started before this one imports torch and the server, so its own
imports and load overlap them.

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
from pathlib import Path

from engine import serve_options
from engine.serve_options import (
    API_KEY_ENV,
    DEFAULT_PORT,
    ENGINE_PROCESS_ENV,
    OPTIONS,
    ServeOption,
)
from mcp_server.cli_engine import MAX_DEFAULT_THREADS
from mcp_server.cli_engine import default_threads as engine_default_threads
from tools.errors import GpurigError, InvalidInputError, NotFoundError, RefusedError

# what an NVIDIA driver leaves on a Linux machine (WSL has neither: there torch decides alone)
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


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
    for option in OPTIONS:
        _add(p, option)
    p.set_defaults(func=_serve)


def _add(p: argparse.ArgumentParser, option: ServeOption) -> None:
    """One option of engine/serve_options.py as an argparse flag."""
    text = option.help.replace("{max_threads}", str(MAX_DEFAULT_THREADS))
    if option.switch:
        p.add_argument(*option.flags, dest=option.name, action="store_true", help=text)
        return
    p.add_argument(
        *option.flags,
        dest=option.name,
        type=_usage_error(option.type) if option.type else None,
        default=option.default,
        required=option.required,
        choices=option.choices,
        help=text,
    )


def _usage_error(parse):
    """`parse` whose ValueError argparse reports as a usage error with its words (exit 2)."""
    if parse in (int, float):  # argparse's own words: "invalid int value: 'x'"
        return parse

    def typed(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


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


def _serves_cuda(device: str | None) -> bool:
    """Whether the engine will run on a CUDA device (a device name torch cannot parse: no, and
    `engine.load` says what is wrong with it)."""
    import torch

    if not device:
        return torch.cuda.is_available()
    try:
        return torch.device(device).type == "cuda"
    except RuntimeError:
        return False


def _engine_process_expected(args: argparse.Namespace) -> bool:
    """Whether the engine will run in a process of its own, guessed without torch (which takes
    seconds to import): "on" and "off" say so; "auto" means CUDA, which a --device names, or
    else an NVIDIA driver on this machine suggests. `_serves_cuda` decides "auto" afterwards."""
    if args.engine_process != "auto":
        return args.engine_process == "on"
    if args.device:
        return str(args.device).split(":")[0].strip().lower() == "cuda"
    return any(Path(p).exists() for p in NVIDIA_DRIVER_FILES)


def _threads(args: argparse.Namespace) -> int | None:
    """The thread count to set, or None to leave torch's (OMP_NUM_THREADS, set by the user)."""
    if args.threads is not None:
        return args.threads
    return None if os.environ.get("OMP_NUM_THREADS") else default_threads()


def _serve(args: argparse.Namespace) -> int:
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise NotFoundError(
            f"{model_dir} is not a directory", "pass a checkpoint directory to --model"
        )
    if args.engine_process is None:
        args.engine_process = os.environ.get(ENGINE_PROCESS_ENV, "").strip().lower() or "auto"
    serve_options.check(vars(args), threads_hint=default_threads())
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not check_bind(args.host, args.port):
        sys.stderr.write(_exposure_warning(args.host, args.port, api_key))
        sys.stderr.flush()

    from engine.config import load_config  # light: no torch yet

    # a directory that is no checkpoint fails here (a CheckpointError: a GpurigError like every
    # tool's, so main() prints it and exits 2), before torch is imported
    limit = load_config(model_dir).max_position_embeddings

    import engine  # light too: the options and load's signature, no torch
    from engine.server.core import CoreSpec, start_core

    threads = _threads(args)
    max_ctx = min(args.max_context, limit)
    if not args.no_warmup:
        sys.stderr.write(
            "gpurig engine: loading, then warming up (kernels compiled on every core, graphs "
            "captured, a prompt of each kind read; on a GPU with no tiles shipped for its kind "
            "(Hopper has them) the first run also tunes every GEMV shape, a few minutes once, "
            "cached per GPU name)\n"
        )
        sys.stderr.flush()
    load_kwargs = dict(
        device=args.device,
        max_context=max_ctx,
        memory_cap_mib=args.memory_cap_mib,
        options=engine.EngineOptions.from_env(),
        max_num_seqs=args.max_num_seqs,
        prefill_budget=args.prefill_budget,
        kv_cache_mib=args.kv_cache_mib,
        warm_up=not args.no_warmup,
    )
    gc_freeze = os.environ.get("GPURIG_GC_FREEZE", "1").strip() != "0"  # gc_watch.py
    spec = CoreSpec(model_dir, load_kwargs, threads, gc_freeze)
    # the engine process starts loading before this process imports torch and the server: its
    # own imports (torch's again) overlap ours; torch has the last word on "auto" below
    early = start_core(spec) if _engine_process_expected(args) else None
    try:
        import torch
        import uvicorn

        from engine.server import create_app
        from engine.server.core import startup_lines
        from engine.server.gc_watch import freeze
        from engine.server.limits import ServerOptions

        if threads is not None:
            torch.set_num_threads(threads)
        if args.engine_process == "auto":  # measured ahead on CUDA (bench/NOTES.md v25)
            args.engine_process = "on" if _serves_cuda(args.device) else "off"
        if args.engine_process == "on":  # engine/server/core.py: its own process, its own lock
            from engine.server.core_client import EngineClient

            started, early = early, None  # the client's now: it stops it if loading fails
            eng = EngineClient(spec, started=started)
            line, warm_line = eng.kv_cache_line, eng.warm_up_line
        else:
            if early is not None:  # a driver, but no CUDA for this torch: load it here
                early.abandon()
                early = None
            eng = engine.load(model_dir, **load_kwargs)
            line, warm_line = startup_lines(eng)
    finally:
        if early is not None:  # something failed before anyone took the process
            early.abandon()
    sys.stderr.write(f"gpurig engine: {line}\n")
    if warm_line is not None:  # first-use costs stay out of every request's time
        sys.stderr.write(f"gpurig engine: {warm_line}\n")
    name = args.model_name or eng.model_name
    aliases = (str(args.model), str(model_dir), str(model_dir.resolve()))
    options = ServerOptions(
        api_key=api_key,
        max_tokens_limit=args.max_tokens_limit or None,
        max_body_bytes=int(args.max_body_mib * 1024 * 1024),
    )
    first = not args.no_warmup and os.environ.get("GPURIG_FIRST_REQUESTS", "1").strip() != "0"

    def say(line: str) -> None:
        sys.stderr.write(f"gpurig engine: {line}\n")
        sys.stderr.flush()

    app = create_app(
        eng, model_name=name, aliases=aliases, options=options, first_requests=first, say=say
    )
    if gc_freeze:
        say(f"{freeze():,} objects of the loaded engine exempted from garbage collection")
    capped = f" (capped from {args.max_context})" if max_ctx < args.max_context else ""
    cap = args.max_tokens_limit or "none"
    sys.stderr.write(
        f"gpurig engine: serving '{name}' on http://{args.host}:{args.port}/v1 "
        f"(device {eng.device}, context {eng.max_context}{capped}, {torch.get_num_threads()} "
        f"CPU threads, engine process {args.engine_process}, max_tokens limit {cap}, "
        f"API key {'on' if api_key else 'off'})\n"
    )
    sys.stderr.flush()
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0
