"""The front doors' words: how the CLI and the MCP server show the placeholders in a tool's text.

A tool names an argument with `arg("need_gib")` (engine/errors.py) and writes text that differs by
more than a name with `either(cli=..., mcp=...)` (tools/errors.py), because it does not know which
door called it. The doors render that text here: `render_for("cli", text)` turns `{arg:need_gib}`
into `--need-gib` (the flag: the name with dashes, or the flag in `CLI_FLAGS` where they differ,
e.g. python_bin -> --python) and `render_for("mcp", text)` into `need_gib`. The CLI renders in
`output.report_error` and `output.print_result`; the MCP server renders every error and every tool
result (mcp_server/mcp_base.py, mcp_errors.py).
"""

from __future__ import annotations

from typing import Literal

from tools.errors import ARG_PATTERN, EITHER_PATTERN, GpurigError

Front = Literal["cli", "mcp"]

# An argument whose CLI flag is not its name with dashes. Everything else: --name-with-dashes.
CLI_FLAGS: dict[str, str] = {
    "python_bin": "--python",
    "timeout_s": "--timeout",
}


def cli_flag(name: str) -> str:
    """The CLI flag for argument `name`: python_bin -> --python, need_gib -> --need-gib."""
    return CLI_FLAGS.get(name, "--" + name.replace("_", "-"))


def render_for(front: Front, text: str | None) -> str | None:
    """`text` with its placeholders in the words of `front` ("cli" or "mcp")."""
    if not text or "{" not in text:
        return text
    if front == "cli":
        text = ARG_PATTERN.sub(lambda m: cli_flag(m.group(1)), text)
        return EITHER_PATTERN.sub(lambda m: m.group(1), text)
    text = ARG_PATTERN.sub(lambda m: m.group(1), text)
    return EITHER_PATTERN.sub(lambda m: m.group(2), text)


def rendered(err: GpurigError, front: Front) -> tuple[str, str | None]:
    """The error's (message, remedy) in the words of `front`."""
    return render_for(front, err.message) or "", render_for(front, err.remedy)
