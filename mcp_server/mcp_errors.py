"""Tool arguments in plain words: bounds checked before validation, errors an LLM can act on.

The SDK validates a call's arguments with a pydantic model built from the tool's signature and
reports a failure as pydantic's own text (type codes, input_value=..., a link to
errors.pydantic.dev), silently drops arguments it does not know and accepts strings and lists of
any size (a 20 MB path came back as a 126 MB error reply). Everything here works from the tool's
advertised input schema, so it applies to every tool of every area without per-tool code:

- `harden_schema` adds the bounds to the schema the client sees: `additionalProperties: false`,
  and `maxLength` DEFAULT_MAX_CHARS / `maxItems` DEFAULT_MAX_ITEMS on every string / array that
  declares none (a tool that needs longer strings declares `Field(max_length=...)` itself);
- `check_arguments` enforces them on the raw arguments before anything else looks at them:
  unknown names, oversized strings or lists, NUL characters, deep nesting; cheap (no copy);
- `validation_message` turns pydantic's ValidationError into: which argument, what was given
  (a short excerpt, never the value itself), what is accepted (read from the schema);
- `tool_error` turns a GpurigError into the error result, in MCP's words (`need_gib`).
"""

from __future__ import annotations

import json
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError
from pydantic import ValidationError

from mcp_server.wording import rendered
from tools.errors import GpurigError

DEFAULT_MAX_CHARS = 4096  # PATH_MAX: a path, a name, a flag value
DEFAULT_MAX_ITEMS = 64
MAX_DEPTH = 8  # nesting of lists/objects inside one argument
MAX_TOTAL_CHARS = 1_000_000  # all strings of one call together
EXCERPT_CHARS = 60


MAX_ERROR_CHARS = 2000  # a tool's message may quote its input: never a long reply


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text`, cut to `limit` characters with a note saying how much was left out."""
    if len(text) <= limit:
        return text
    return text[: limit - 40] + f" ... ({len(text) - limit + 40:,} characters left out)"


def tool_error(err: GpurigError) -> ToolError:
    """The error result an MCP caller sees: the message, then what to do, in MCP's words."""
    message, remedy = rendered(err, "mcp")
    message = clip(message, MAX_ERROR_CHARS // 2)
    if remedy:
        message = message.rstrip() + ("" if message.rstrip().endswith((".", "!", "?")) else ".")
        message += f" What to do: {clip(remedy, MAX_ERROR_CHARS // 2)}"
    return ToolError(message)


class ArgumentError(ToolError):
    """The call's arguments are refused before the tool runs."""


# --- the schema ---------------------------------------------------------------------------


def harden_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the default bounds and additionalProperties=false to a tool's input schema, in place."""
    schema["additionalProperties"] = False

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "string" and "enum" not in node and "const" not in node:
                node.setdefault("maxLength", DEFAULT_MAX_CHARS)
            elif kind == "array":
                node.setdefault("maxItems", DEFAULT_MAX_ITEMS)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return schema.get("$defs", {}).get(ref.removeprefix("#/$defs/"), node)
    return node


def _branches(schema: dict[str, Any], node: dict[str, Any]) -> list[dict[str, Any]]:
    node = _resolve(schema, node)
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            return [b for sub in node[key] for b in _branches(schema, sub)]
    return [node]


def _limits(schema: dict[str, Any], prop: dict[str, Any]) -> tuple[int, int]:
    """(longest string, longest list) an argument accepts anywhere inside it."""
    chars, items = [], []

    def walk(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict):
            return
        for branch in _branches(schema, node):
            if "maxLength" in branch:
                chars.append(int(branch["maxLength"]))
            if "maxItems" in branch:
                items.append(int(branch["maxItems"]))
            if isinstance(branch.get("items"), dict):
                walk(branch["items"], depth + 1)

    walk(prop, 0)
    return max(chars, default=DEFAULT_MAX_CHARS), max(items, default=DEFAULT_MAX_ITEMS)


def describe(schema: dict[str, Any], node: dict[str, Any], depth: int = 0) -> str:
    """What a schema node accepts, in words: 'a number greater than 0, at most 100000, or null'."""
    if depth > 4:
        return "a value"
    words = []
    for branch in _branches(schema, node):
        words.append(_describe_one(schema, branch, depth))
    return " or ".join(dict.fromkeys(words)) or "a value"


def _describe_one(schema: dict[str, Any], node: dict[str, Any], depth: int) -> str:
    if "enum" in node:
        return "one of " + ", ".join(json.dumps(v) for v in node["enum"])
    if "const" in node:
        return json.dumps(node["const"])
    kind = node.get("type")
    bounds = []
    for key, word in (
        ("exclusiveMinimum", "greater than"),
        ("minimum", "at least"),
        ("exclusiveMaximum", "less than"),
        ("maximum", "at most"),
    ):
        if key in node:
            bounds.append(f"{word} {node[key]:g}")
    if kind == "string":
        lo, hi = node.get("minLength"), node.get("maxLength")
        if lo and hi:
            return f"a string of {lo} to {hi} characters"
        return f"a string of at most {hi} characters" if hi else "a string"
    if kind in ("number", "integer"):
        noun = "a number" if kind == "number" else "a whole number"
        return noun + (" " + ", ".join(bounds) if bounds else "")
    if kind == "boolean":
        return "true or false"
    if kind == "null":
        return "null"
    if kind == "array":
        inner = describe(schema, node.get("items") or {}, depth + 1)
        most = node.get("maxItems")
        return "a list" + (f" (at most {most} items)" if most else "") + f" of: {inner}"
    if kind == "object":
        return "an object"
    return "a value"


# --- the raw arguments ---------------------------------------------------------------------


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """A short JSON-like excerpt of `value`, whatever its size (never more than ~80 chars)."""

    def shallow(v: Any, depth: int) -> Any:
        if isinstance(v, str):
            return v[:limit] + ("..." if len(v) > limit else "")
        if depth > 2:
            return "..."
        if isinstance(v, list):
            return [shallow(x, depth + 1) for x in v[:4]] + (["..."] if len(v) > 4 else [])
        if isinstance(v, dict):
            keys = list(v)[:4]
            return {str(k)[:limit]: shallow(v[k], depth + 1) for k in keys}
        return v

    text = json.dumps(shallow(value, 0), ensure_ascii=True, default=str)
    if len(text) > limit + 20:
        text = text[: limit + 17] + "..."
    if isinstance(value, str) and len(value) > limit:
        text += f" ({len(value):,} characters)"
    elif isinstance(value, list) and len(value) > 4:
        text += f" ({len(value):,} items)"
    return text


def _accepted_names(schema: dict[str, Any]) -> str:
    names = list(schema.get("properties", {}))
    return ", ".join(names) if names else "none"


def check_arguments(tool: str, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    """Refuse unknown arguments and oversized values before validation; raise ArgumentError."""
    props: dict[str, Any] = schema.get("properties", {})
    unknown = [name for name in arguments if name not in props]
    if unknown:
        shown = ", ".join(excerpt(name, 40) for name in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ArgumentError(
            f"{tool}: unknown argument{'s' if len(unknown) > 1 else ''} {shown}{more}. "
            f"Accepted arguments: {_accepted_names(schema)}."
        )
    total = 0
    for name, value in arguments.items():
        max_chars, max_items = _limits(schema, props[name])
        problem, total = _oversized(value, max_chars, max_items, total)
        if not problem and isinstance(value, str) and value[:1] in ("[", "{"):
            # the SDK parses a JSON string given for a list or object argument (a habit of
            # some clients); bound what it would parse the same way
            kinds = {b.get("type") for b in _branches(schema, props[name])}
            if "string" not in kinds:
                try:
                    parsed = json.loads(value)
                except (ValueError, RecursionError):
                    parsed = None
                problem, _ = _oversized(parsed, max_chars, max_items, 0)
        if problem:
            raise ArgumentError(
                f"{tool}: argument {name} {problem} (given: {excerpt(value)}). "
                f"Accepted: {describe(schema, props[name])}."
            )


def _oversized(value: Any, max_chars: int, max_items: int, total: int) -> tuple[str | None, int]:
    """Why `value` is too big (or holds a NUL), and the running total of string characters."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            total += len(item)
            if len(item) > max_chars:
                return (
                    f"is {len(item):,} characters long; at most {max_chars:,} are accepted",
                    total,
                )
            if "\x00" in item:
                return "holds a NUL character, which no path or name may contain", total
        elif isinstance(item, list | dict):
            if depth >= MAX_DEPTH:
                return f"is nested more than {MAX_DEPTH} levels deep", total
            if len(item) > max_items:
                kind = "items" if isinstance(item, list) else "keys"
                return f"has {len(item):,} {kind}; at most {max_items:,} are accepted", total
            children = item if isinstance(item, list) else [*item.keys(), *item.values()]
            stack.extend((child, depth + 1) for child in children)
        if total > MAX_TOTAL_CHARS:
            return f"is too large (over {MAX_TOTAL_CHARS:,} characters in all)", total
    return None, total


def validation_message(tool: str, schema: dict[str, Any], exc: ValidationError) -> str:
    """pydantic's errors as one plain paragraph per argument: given what, should be what."""
    props: dict[str, Any] = schema.get("properties", {})
    by_arg: dict[str, dict[str, Any]] = {}
    for err in exc.errors(include_url=False):
        loc = list(err.get("loc", ()))
        name = str(loc[0]) if loc else "arguments"
        # the argument, then list positions; pydantic's union tags ('str', 'float') are dropped
        where = name + "".join(f"[{p}]" for p in loc[1:] if isinstance(p, int))
        entry = by_arg.setdefault(name, {"where": where, "reasons": [], "input": err.get("input")})
        reason = str(err.get("msg") or "is not valid").removeprefix("Input ")
        if err.get("type") == "missing":
            reason = "is required"
        if reason not in entry["reasons"]:
            entry["reasons"].append(reason)
    parts = []
    for name, entry in by_arg.items():
        given = "" if "is required" in entry["reasons"] else f" (given: {excerpt(entry['input'])})"
        accepted = describe(schema, props[name]) if name in props else None
        text = f"argument {entry['where']}{given}: " + "; ".join(entry["reasons"][:3])
        if accepted:
            text += f". Accepted: {accepted}"
        parts.append(text + ".")
    return f"{tool}: " + " ".join(parts)
