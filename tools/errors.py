"""The tools' errors and front-door words: gpurig's one hierarchy, defined in engine/errors.py.

A tool raises a `GpurigError` subclass with a message that says what went wrong and a `remedy`
that says what to do; the front doors turn it into an MCP error result or a CLI message with exit
code 2, and nothing else (a traceback) should reach a user for a problem they can fix. Text that
names an argument uses `arg("need_gib")` (`--need-gib` on the CLI, `need_gib` over MCP) or
`either(cli=..., mcp=...)`; `render_for(front, text)` renders it.

The hierarchy lives in engine/errors.py because the engine may import nothing above it and its
errors (CheckpointError, ContextLengthError, ...) are GpurigErrors like every tool's; this module
is where the tools and the front doors import it from.
"""

from __future__ import annotations

from engine.errors import (
    CLI_FLAGS,
    Category,
    CheckpointError,
    ContextLengthError,
    EngineError,
    Front,
    GenerationError,
    GpurigError,
    InvalidInputError,
    NotFoundError,
    RefusedError,
    arg,
    cli_flag,
    either,
    render_for,
)

__all__ = [
    "CLI_FLAGS",
    "Category",
    "CheckpointError",
    "ContextLengthError",
    "EngineError",
    "Front",
    "GenerationError",
    "GpurigError",
    "InvalidInputError",
    "NotFoundError",
    "RefusedError",
    "arg",
    "cli_flag",
    "either",
    "render_for",
]
