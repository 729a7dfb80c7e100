"""`gpurig engine serve`: the engine behind an OpenAI-compatible HTTP API (uvicorn + starlette).

A thin front door: it checks the port, loads the checkpoint with `engine.load`, and runs
`engine.server.create_app` under uvicorn. Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
import socket
import sys

from tools.errors import GpurigError, InvalidInputError, NotFoundError, RefusedError

DEFAULT_PORT = 8100
DEFAULT_MAX_CTX = 131072


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible API (/v1/chat/completions, ...)",
        description=(
            "Serve a Gemma 4 W4A16 checkpoint: POST /v1/chat/completions and /v1/completions "
            "(streaming, tools), GET /v1/models, /health and /metrics. One generation at a time "
            "behind a FIFO queue."
        ),
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--max-ctx",
        type=int,
        default=DEFAULT_MAX_CTX,
        help=f"context length in tokens (default {DEFAULT_MAX_CTX}, "
        "capped at the model's max_position_embeddings)",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if present)")
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


def _check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise InvalidInputError(f"port {port} is out of range", "use a port between 1 and 65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as uvicorn binds: connections of a server just stopped (TIME_WAIT) do not count,
        # a socket listening on the port does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise RefusedError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                "pick a free port with --port, or stop what is using this one",
            ) from None


def _engine_error(exc: Exception) -> GpurigError:
    from engine.errors import CheckpointError

    cls = NotFoundError if isinstance(exc, CheckpointError) else InvalidInputError
    return cls(getattr(exc, "message", str(exc)), getattr(exc, "remedy", None))


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise NotFoundError(
            f"{model_dir} is not a directory", "pass a checkpoint directory to --model"
        )
    if args.max_ctx < 1:
        raise InvalidInputError(f"--max-ctx {args.max_ctx} must be at least 1", "use e.g. 8192")
    _check_port(args.host, args.port)

    import uvicorn

    import engine
    from engine.config import load_config
    from engine.errors import EngineError
    from engine.server import create_app

    try:
        limit = load_config(model_dir).max_position_embeddings
        max_ctx = min(args.max_ctx, limit)
        eng = engine.load(model_dir, device=args.device, max_context=max_ctx)
    except EngineError as exc:
        raise _engine_error(exc) from None
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
    app = create_app(eng, model_name=name, aliases=aliases)
    capped = f" (capped from {args.max_ctx})" if max_ctx < args.max_ctx else ""
    sys.stderr.write(
        f"gpurig engine: serving '{name}' on http://{args.host}:{args.port}/v1 "
        f"(device {eng.device}, context {eng.max_context}{capped})\n"
    )
    sys.stderr.flush()
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0
