"""The engine server's composition root: `python -m engine.server --model DIR ...` (and `gpurig
engine serve`, the CLI's front door to the same `serve`).

It checks its arguments, the model path and the bind address (before torch is imported, so
mistakes cost nothing), sets the CPU thread count (engine/threads.py), loads the checkpoint (in
this process, or in a process of its own: engine/process/), and runs `create_app` under
uvicorn. Where the engine gets a process of its own, that process is started before this one
imports torch and the server, so its own imports and load overlap them.

What it refuses is an engine error (engine/errors.py); `main` prints it as the CLI does and
exits 2, and `gpurig engine serve` lets the CLI report it. This module imports only the
standard library and the engine's light modules at import time: the spawned engine process
imports it again, as its parent's main module.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import env, serve_options
from engine.errors import ARG_PATTERN, GpurigError, NotFoundError
from engine.serve_options import API_KEY_ENV, ENGINE_PROCESS_ENV, OPTIONS, ServeOption
from engine.server.bind import check_bind, exposure_warning
from engine.threads import MAX_DEFAULT_THREADS, serve_default, serve_threads

if TYPE_CHECKING:
    from engine.interface import ServedEngine
    from engine.process.core import CoreSpec, StartedCore

# what an NVIDIA driver leaves on a Linux machine (WSL has neither: there torch decides alone)
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")
DESCRIPTION = (
    "Serve a Gemma 4 W4A16 checkpoint: POST /v1/chat/completions and /v1/completions "
    "(streaming, tools), GET /v1/models, /health, /metrics and /openapi.json. "
    "Concurrent requests share each decode step (continuous batching over a KV block "
    "pool); requests beyond --max-num-seqs wait in arrival order."
)


class HelpFormatter(argparse.HelpFormatter):
    """Fills in the --threads default only when the help is shown: it reads the load average
    through psutil, which every start (the parser is built each time) would pay."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action) or ""
        return text.replace("{here}", str(serve_default())) if action.dest == "threads" else text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of engine/serve_options.py as an argparse flag."""
    for option in OPTIONS:
        _add(p, option)


def build_parser(prog: str = "python -m engine.server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(p)
    return p


def _add(p: argparse.ArgumentParser, option: ServeOption) -> None:
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


def _usage_error(parse: Any) -> Any:
    """`parse` whose ValueError argparse reports as a usage error with its words (exit 2)."""
    if parse in (int, float):  # argparse's own words: "invalid int value: 'x'"
        return parse

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.server`: 0 after a clean shutdown, 2 for what it refused (the message
    and what to do on stderr, as the CLI prints them), 130 on Ctrl-C before serving."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        return serve(args)
    except GpurigError as err:
        sys.stderr.write(f"gpurig: error: {_flags(err.message)}\n")
        if err.remedy:
            sys.stderr.write(f"gpurig: what to do: {_flags(err.remedy)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("gpurig: interrupted\n")
        return 130


def _flags(text: str) -> str:
    """An error's argument placeholders (engine/errors.py's `arg`) as this command's flags."""
    return ARG_PATTERN.sub(lambda m: "--" + m.group(1).replace("_", "-"), text)


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


def _checked(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The checkpoint directory and the API key, every argument and the address checked
    (nothing heavy imported yet); prints the exposure warning where it is due."""
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise NotFoundError(
            f"{model_dir} is not a directory", "pass a checkpoint directory to --model"
        )
    if args.engine_process is None:
        chosen = (env.read(ENGINE_PROCESS_ENV) or "").strip().lower()
        args.engine_process = chosen or "auto"
    serve_options.check(vars(args), threads_hint=serve_default())
    api_key = args.api_key or env.read(API_KEY_ENV) or None
    if not check_bind(args.host, args.port):
        sys.stderr.write(exposure_warning(args.host, args.port, api_key))
        sys.stderr.flush()
    return model_dir, api_key


def serve(args: argparse.Namespace) -> int:
    """Check, load, serve until stopped (see the module docstring); 0 after a clean shutdown.
    Raises a GpurigError for what it refuses."""
    model_dir, api_key = _checked(args)
    from engine.config import load_config  # light: no torch yet

    # a directory that is no checkpoint fails here (a CheckpointError), before torch is imported
    limit = load_config(model_dir).max_position_embeddings

    import engine  # light too: the options and load's signature, no torch
    from engine.process.core import CoreSpec, start_core

    threads = serve_threads(args.threads)
    max_ctx = min(args.max_context, limit)
    if not args.no_warmup:
        say("loading, then warming up (kernels compiled on every core, graphs captured, a "
            "prompt of each kind read; on a GPU with no tiles shipped for its kind (Hopper has "
            "them) the first run also tunes every GEMV shape, a few minutes once, cached per "
            "GPU name)")  # fmt: skip
    load_kwargs: dict[str, Any] = dict(
        device=args.device,
        max_context=max_ctx,
        memory_cap_mib=args.memory_cap_mib,
        options=engine.EngineOptions.from_env(),
        max_num_seqs=args.max_num_seqs,
        prefill_budget=args.prefill_budget,
        kv_cache_mib=args.kv_cache_mib,
        warm_up=not args.no_warmup,
    )
    gc_freeze = env.flag("GPURIG_GC_FREEZE")  # engine/server/gc_watch.py
    spec = CoreSpec(model_dir, load_kwargs, threads, gc_freeze)
    # the engine process starts loading before this process imports torch and the server: its
    # own imports (torch's again) overlap ours; torch has the last word on "auto" below
    early = start_core(spec) if _engine_process_expected(args) else None
    eng = _load(args, spec, early)
    name = args.model_name or eng.facts.model_name
    return _run(args, eng, name, (str(args.model), str(model_dir), str(model_dir.resolve())),
                api_key, gc_freeze, max_ctx)  # fmt: skip


def _load(args: argparse.Namespace, spec: CoreSpec, early: StartedCore | None) -> ServedEngine:
    """The engine, in a process of its own (taking `early`, the one already loading) or in this
    one; logs its KV cache and warm-up lines."""
    try:
        import torch

        import engine
        from engine.process.core import startup_lines

        if spec.torch_threads is not None:
            torch.set_num_threads(spec.torch_threads)
        if args.engine_process == "auto":  # measured ahead on CUDA (lab/journal.md v25)
            args.engine_process = "on" if _serves_cuda(args.device) else "off"
        if args.engine_process == "on":  # engine/process/core.py: its own process, its own lock
            from engine.process.client import EngineClient

            started, early = early, None  # the client's now: it stops it if loading fails
            client = EngineClient(spec, started=started)
            eng: ServedEngine = client
            line, warm_line = client.kv_cache_line, client.warm_up_line
        else:
            if early is not None:  # a driver, but no CUDA for this torch: load it here
                early.abandon()
                early = None
            local = engine.load(spec.model_dir, **spec.load_kwargs)
            eng = local
            line, warm_line = startup_lines(local)
    finally:
        if early is not None:  # something failed before anyone took the process
            early.abandon()
    say(line)
    if warm_line is not None:  # first-use costs stay out of every request's time
        say(warm_line)
    return eng


def _run(args: argparse.Namespace, eng: ServedEngine, name: str, aliases: tuple[str, ...],
         api_key: str | None, gc_freeze: bool, max_ctx: int) -> int:  # fmt: skip
    """The app for `eng` under uvicorn, until it stops."""
    import torch
    import uvicorn

    from engine.server import create_app
    from engine.server.gc_watch import freeze
    from engine.server.limits import ServerOptions

    options = ServerOptions(
        api_key=api_key,
        max_tokens_limit=args.max_tokens_limit or None,
        max_body_bytes=int(args.max_body_mib * 1024 * 1024),
    )
    first = not args.no_warmup and env.flag("GPURIG_FIRST_REQUESTS")
    app = create_app(
        eng, model_name=name, aliases=aliases, options=options, first_requests=first, say=say
    )
    if gc_freeze:
        say(f"{freeze():,} objects of the loaded engine exempted from garbage collection")
    capped = f" (capped from {args.max_context})" if max_ctx < args.max_context else ""
    cap = args.max_tokens_limit or "none"
    say(f"serving '{name}' on http://{args.host}:{args.port}/v1 (device {eng.facts.device}, "
        f"context {eng.facts.max_context}{capped}, {torch.get_num_threads()} CPU threads, "
        f"engine process {args.engine_process}, max_tokens limit {cap}, "
        f"API key {'on' if api_key else 'off'})")  # fmt: skip
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0


def say(line: str) -> None:
    """One line of the server's log, on stderr."""
    sys.stderr.write(f"gpurig engine: {line}\n")
    sys.stderr.flush()
