"""The `gpurig` command line: one subcommand per tool, each calling the same function as MCP.

Each area registers its own subcommands from a small module (cli_host, cli_patch, cli_engine,
...), so this file stays a table of contents. Those modules must not import torch at import
time: `gpurig --help` has to be instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

from tools.errors import GpurigError


def _subcommand_modules() -> tuple[list[ModuleType], list[ModuleType]]:
    """The modules with `register(subparsers)`: the top-level ones and those under `gpurig
    engine ...`. Imported when the parser is built, not with this module: the engine process
    (spawned) imports the server's main module again, and needs none of them."""
    from mcp_server import (
        cli_compare,
        cli_demo,
        cli_engine,
        cli_engine_serve,
        cli_eval,
        cli_host,
        cli_patch,
        cli_serve,
        cli_sweep,
        cli_up,
    )

    top = [cli_host, cli_patch, cli_serve, cli_up, cli_sweep, cli_demo, cli_compare, cli_eval]
    return top, [cli_engine, cli_engine_serve]


def _register_mcp(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mcp", help="serve the MCP tools (stdio by default)")
    p.add_argument("--transport", choices=["stdio", "streamable-http"], default="stdio")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address for streamable-http (loopback only unless --allow-remote)",
    )
    p.add_argument("--port", type=_port, default=8765, help="port for streamable-http")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host beyond loopback (no authentication: prefer an ssh -L tunnel)",
    )
    p.set_defaults(func=_run_mcp)


def _port(text: str) -> int:
    """A TCP port, checked here: the server would otherwise die in bind() with a traceback."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def _run_mcp(args: argparse.Namespace) -> int:
    sock = None
    if args.transport == "streamable-http":  # a bad host or a taken port fails at once,
        from mcp_server.mcp_http import bind, check_host  # before seconds of importing tools

        check_host(args.host, args.port, args.allow_remote)
        sock = bind(args.host, args.port)
    from mcp_server.server import serve

    serve(
        transport=args.transport,
        host=args.host,
        port=args.port,
        allow_remote=args.allow_remote,
        sock=sock,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpurig",
        description="Get a small LLM served, fast and verified, on the GPU you have.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output to stderr")
    parser.add_argument("--version", action="version", version=f"gpurig {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_mcp(sub)
    top_level, engine_modules = _subcommand_modules()
    for module in top_level:
        module.register(sub)
    engine = sub.add_parser("engine", help="the in-process 4-bit Gemma 4 engine")
    engine_sub = engine.add_subparsers(dest="engine_command", metavar="ENGINE_COMMAND")
    engine.set_defaults(func=lambda _a: (engine.print_help(), 2)[1])
    for module in engine_modules:
        module.register(engine_sub)
    _mark_parsers(parser)
    return parser


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), without importing anything big."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpurig")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def _mark_parsers(parser: argparse.ArgumentParser) -> None:
    """Record in every (sub)parser's defaults which parser it is. The deepest subcommand's
    defaults win, so after parsing `args._parser` is the parser that should report a stray
    argument: `gpurig doctor --bogus` then shows doctor's usage, not the top-level one."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _mark_parsers(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand that was given them (exit 2, its usage)
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except GpurigError as err:
        from mcp_server.output import report_error

        return report_error(err)
    except KeyboardInterrupt:  # Ctrl-C: the shell's convention, 128 + SIGINT, no traceback
        sys.stderr.write("gpurig: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
