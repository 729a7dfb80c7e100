"""One small error hierarchy for every tool, and the words each front door uses for arguments.

A tool raises a `GpurigError` with a message that says what went wrong and a `remedy` that says
what to do. The front doors turn it into an MCP error result or a CLI message with exit code 2;
nothing else (a traceback) should ever reach a user for a problem they can fix.

Each front door speaks its own words: the CLI's user types `--need-gib`, an MCP caller passes
`need_gib`. A tool does not know which door called it, so text that names an argument (in an
error's message or remedy, or in a report's remedy field) names it through `arg()`:

    remedy=f"pass the size of the weights in GiB, e.g. {arg('need_gib')}=10"

`arg("need_gib")` is the placeholder `{arg:need_gib}`; `render_for("cli", text)` turns it into
`--need-gib` (the flag: the name with dashes, or the flag in `CLI_FLAGS` where they differ, e.g.
python_bin -> --python) and `render_for("mcp", text)` into `need_gib`. Text that must differ by
more than a name uses `either(cli=..., mcp=...)` (e.g. a command: `gpurig patch apply` versus the
tool apply_turing_patch). The CLI renders in `output.report_error` and `output.print_result`; the
MCP server renders every error and every tool result (mcp_server/mcp_errors.py). `str(err)`
renders for the CLI (logs, tests).
"""

from __future__ import annotations

import re
from typing import Literal

Front = Literal["cli", "mcp"]

# An argument whose CLI flag is not its name with dashes. Everything else: --name-with-dashes.
CLI_FLAGS: dict[str, str] = {
    "python_bin": "--python",
    "timeout_s": "--timeout",
}

_ARG = re.compile(r"\{arg:([A-Za-z_][A-Za-z0-9_]*)\}")
_EITHER = re.compile(r"\{cli:([^{}|]*)\|mcp:([^{}|]*)\}")


def arg(name: str) -> str:
    """The placeholder for argument `name` in text that any front door may show."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"not an argument name: {name!r}")
    return "{arg:" + name + "}"


def either(cli: str, mcp: str) -> str:
    """Text that reads `cli` on the command line and `mcp` over MCP (no braces or '|' in them)."""
    for text in (cli, mcp):
        if any(c in text for c in "{}|"):
            raise ValueError(f"either() text may not hold braces or '|': {text!r}")
    return "{cli:" + cli + "|mcp:" + mcp + "}"


def cli_flag(name: str) -> str:
    """The CLI flag for argument `name`: python_bin -> --python, need_gib -> --need-gib."""
    return CLI_FLAGS.get(name, "--" + name.replace("_", "-"))


def render_for(front: Front, text: str | None) -> str | None:
    """`text` with its placeholders in the words of `front` ("cli" or "mcp")."""
    if not text or "{" not in text:
        return text
    if front == "cli":
        text = _ARG.sub(lambda m: cli_flag(m.group(1)), text)
        return _EITHER.sub(lambda m: m.group(1), text)
    text = _ARG.sub(lambda m: m.group(1), text)
    return _EITHER.sub(lambda m: m.group(2), text)


class GpurigError(Exception):
    """Base of all errors a user can act on."""

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def rendered(self, front: Front) -> tuple[str, str | None]:
        """(message, remedy) in the words of `front`."""
        return render_for(front, self.message) or "", render_for(front, self.remedy)

    def __str__(self) -> str:
        message, remedy = self.rendered("cli")
        if remedy:
            return f"{message} -> {remedy}"
        return message


class InvalidInputError(GpurigError):
    """An argument is wrong: a bad path, a bad flag, an impossible value."""


class NotFoundError(GpurigError):
    """Something the tool needs is not there: an interpreter, a package, a file."""


class RefusedError(GpurigError):
    """The tool will not do this because it would fail or destroy something."""
