"""`gpurig engine serve`: the CLI's front door to the engine server (engine/server/main.py, also
`python -m engine.server`).

Thin: the same flags (engine/serve_options.py), the same `serve`; what it refuses is an engine
error, which the CLI prints with what to do and exits 2 (mcp_server/cli.py). Nothing heavy at
import time: `gpurig --help` builds this parser.
"""

from __future__ import annotations

import argparse

from engine.server.main import DESCRIPTION, HelpFormatter, add_arguments, serve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        formatter_class=HelpFormatter,
        help="serve a checkpoint over an OpenAI-compatible API (/v1/chat/completions, ...)",
        description=DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(func=serve)
