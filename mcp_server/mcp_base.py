"""GpurigMCP: the SDK's MCPServer with the plumbing every gpurig tool shares.

Every area registers its tools with the plain SDK decorator (`@mcp.tool(title=..., annotations=
...)` inside `register(mcp)`); this class hooks the two places all of them pass through, so a
new tool module gets the same behaviour without any code of its own:

- `add_tool` (which `@mcp.tool` calls): a title when the tool has none, and the input schema
  hardened (`additionalProperties: false`, default string/list bounds: mcp_errors.py);
- `call_tool` (every tools/call): an unknown tool or argument and oversized values are refused
  before validation; pydantic's ValidationError becomes plain words; a GpurigError raised by the
  tool (caught or not) becomes its message and remedy in MCP's words; placeholders such as
  `{arg:need_gib}` in a result are rendered for MCP (tools/errors.py).

serverInfo carries the package version. Prompts and resources are advertised only when some are
registered (`drop_empty_capabilities`): the SDK advertises both, empty, by default.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent
from pydantic import ValidationError

from mcp_server.mcp_errors import (
    ArgumentError,
    check_arguments,
    excerpt,
    harden_schema,
    tool_error,
    validation_message,
)
from mcp_server.wording import render_for
from tools.errors import GpurigError

log = logging.getLogger("gpurig.mcp")

# Words a title spells differently from the tool's name.
_TITLE_WORDS = {"gpu": "GPU", "vllm": "vLLM", "mcp": "MCP", "kv": "KV", "api": "API"}


def package_version() -> str:
    """gpurig's installed version (pyproject.toml), for serverInfo."""
    try:
        return version("gpurig")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def default_title(name: str) -> str:
    """'verify_gpu_arch' -> 'Verify GPU arch': a readable title for a tool registered without one."""
    words = [_TITLE_WORDS.get(w, w) for w in name.split("_") if w]
    if words and words[0] == words[0].lower():
        words[0] = words[0].capitalize()
    return " ".join(words)


def _gpurig_cause(exc: BaseException) -> GpurigError | None:
    """The GpurigError that caused `exc`, through the SDK's wrappers (tool_error, ToolError)."""
    seen = 0
    node: BaseException | None = exc
    while node is not None and seen < 8:
        if isinstance(node, GpurigError):
            return node
        node = node.__cause__
        seen += 1
    return None


def _render_value(value: Any) -> Any:
    if isinstance(value, str):
        return render_for("mcp", value)
    if isinstance(value, list):
        return [_render_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _render_value(v) for k, v in value.items()}
    return value


def render_result(result: Any) -> Any:
    """A tool result with `{arg:...}` placeholders in MCP's words (untouched when it has none)."""
    if not isinstance(result, CallToolResult):
        return result
    texts = [b.text for b in result.content if isinstance(b, TextContent)]
    if not any("{arg:" in t or "{cli:" in t for t in texts):
        return result
    content = [
        b.model_copy(update={"text": render_for("mcp", b.text)})
        if isinstance(b, TextContent)
        else b
        for b in result.content
    ]
    structured = _render_value(result.structured_content)
    return result.model_copy(update={"content": content, "structured_content": structured})


class GpurigMCP(MCPServer):
    """MCPServer with gpurig's shared argument checks, error words, titles and version."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("version", package_version())
        super().__init__(*args, **kwargs)

    def add_tool(self, fn: Any, name: str | None = None, title: str | None = None, **kw: Any):
        """Register as the SDK does, then give the tool a title and a hardened input schema."""
        name = name or fn.__name__
        super().add_tool(fn, name=name, title=title or default_title(name), **kw)
        tool = self._tool_manager.get_tool(name)
        if tool is not None:
            harden_schema(tool.parameters)

    def drop_empty_capabilities(self) -> None:
        """Stop advertising prompts / resources when none are registered.

        The SDK derives capabilities from its request handlers and always installs those for
        prompts and resources, so a client is told to look for lists that are always empty.
        There is no public way to remove a handler; this pops them from the low-level server
        (tests/test_mcp_hardening.py checks the initialize result of a real client).
        """
        handlers = self._lowlevel_server._request_handlers
        if not self._prompt_manager.list_prompts():
            for method in ("prompts/list", "prompts/get"):
                handlers.pop(method, None)
        if not (self._resource_manager.list_resources() or self._resource_manager.list_templates()):
            for method in (
                "resources/list",
                "resources/templates/list",
                "resources/read",
                "resources/subscribe",
                "resources/unsubscribe",
            ):
                handlers.pop(method, None)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        """Check the arguments, call the tool, and say what went wrong in plain words."""
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            names = ", ".join(t.name for t in self._tool_manager.list_tools())
            raise ToolError(f"unknown tool {excerpt(name, 40)}. The tools are: {names}.")
        check_arguments(name, tool.parameters, arguments)
        try:
            result = await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if isinstance(exc.__cause__, ValidationError):
                raise ArgumentError(
                    validation_message(name, tool.parameters, exc.__cause__)
                ) from exc.__cause__
            err = _gpurig_cause(exc)
            if err is not None:
                raise ToolError(f"{name}: {tool_error(err)}") from err
            raise
        return render_result(result)
