"""How the CLI shows a tool's pydantic result: a readable table by default, JSON with --json."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pydantic import BaseModel
from tabulate import tabulate

from mcp_server.wording import render_for, rendered
from tools.errors import GpurigError


def print_result(result: BaseModel, as_json: bool, render: Callable[[BaseModel], str]) -> None:
    """Print `result` as JSON (for scripts) or through `render` (for people).

    Argument names in the text (a remedy's `{arg:need_gib}`) come out as flags (`--need-gib`):
    the front doors' words (mcp_server/wording.py)."""
    text = result.model_dump_json(indent=2) if as_json else render(result).rstrip("\n")
    sys.stdout.write((render_for("cli", text) or "") + "\n")


def kv_table(rows: list[tuple[str, object]]) -> str:
    """A two-column table of names and values, the common shape of a report."""
    return tabulate([(k, "" if v is None else v) for k, v in rows], tablefmt="plain")


def grid(rows: list[list[object]], headers: list[str]) -> str:
    """A table with headers. Cells are shown as given: without numparse, tabulate would
    reformat an all-number column ("252.0" -> "252") next to one that keeps its decimals."""
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def report_error(err: GpurigError) -> int:
    """Print a tool's or the engine's error for a person, in the CLI's words (`--need-gib`, not
    `need_gib`), and return the CLI's exit code for it: 2 whatever its category (README, Exit
    codes: 2 is input the user can fix, with what to do, which is what every GpurigError is)."""
    message, remedy = rendered(err, "cli")
    sys.stderr.write(f"gpurig: error: {message}\n")
    if remedy:
        sys.stderr.write(f"gpurig: what to do: {remedy}\n")
    return 2
