"""The tools' errors: gpurig's one hierarchy (defined in engine/errors.py), and `either()`.

A tool raises a `GpurigError` subclass with a message that says what went wrong and a `remedy`
that says what to do; the front doors turn it into an MCP error result or a CLI message with exit
code 2, and nothing else (a traceback) should reach a user for a problem they can fix. Text that
names an argument uses `arg("need_gib")` (`--need-gib` on the CLI, `need_gib` over MCP); text that
must differ by more than a name uses `either(cli=..., mcp=...)` (e.g. a command: `gpurig patch
apply` versus the tool apply_turing_patch). The front doors render both (mcp_server/wording.py);
a tool never knows which door called it.

The hierarchy lives in engine/errors.py because the engine may import nothing above it and its
errors (CheckpointError, ContextLengthError, ...) are GpurigErrors like every tool's; this module
is where the tools import it from.
"""

from __future__ import annotations

import re

from engine.errors import (
    ARG_PATTERN,
    Category,
    CheckpointError,
    ContextLengthError,
    EngineError,
    GenerationError,
    GpurigError,
    InvalidInputError,
    NotFoundError,
    RefusedError,
    arg,
    plain,
)

# either()'s placeholder: group 1 the CLI's text, group 2 MCP's
EITHER_PATTERN = re.compile(r"\{cli:([^{}|]*)\|mcp:([^{}|]*)\}")


def either(cli: str, mcp: str) -> str:
    """Text that reads `cli` on the command line and `mcp` over MCP (no braces or '|' in them)."""
    for text in (cli, mcp):
        if any(c in text for c in "{}|"):
            raise ValueError(f"either() text may not hold braces or '|': {text!r}")
    return "{cli:" + cli + "|mcp:" + mcp + "}"


__all__ = [
    "ARG_PATTERN",
    "EITHER_PATTERN",
    "Category",
    "CheckpointError",
    "ContextLengthError",
    "EngineError",
    "GenerationError",
    "GpurigError",
    "InvalidInputError",
    "NotFoundError",
    "RefusedError",
    "arg",
    "either",
    "plain",
]
