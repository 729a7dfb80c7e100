"""MCP tools whose arguments are a request model's fields, flat, as clients send them.

A tool such as bring_up takes {"model": ..., "port": ...}, not {"request": {...}}. The SDK builds
a tool's input schema (and the model it validates a call with) from the function's signature, so
`flat_arguments(Model)` gives the tool function a signature made of Model's fields: each one
`Annotated[annotation, FieldInfo]`, the field itself, so type, default, limits and description
come from the one declaration in the request model and the schema a client sees is the model's
(tests/test_front_door_params.py compares them). The tool body then receives the request built
from the validated arguments: `Model(**arguments)`, which also runs the model's own validators;
their refusals reach the client in plain words through GpurigMCP.call_tool (mcp_errors.py).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from mcp.server.mcpserver import Context
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

CONTEXT = "ctx"


def parameters(model: type[BaseModel]) -> list[inspect.Parameter]:
    """One keyword-only parameter per field of `model`, in its order, carrying the FieldInfo.

    No parameter default: the FieldInfo holds it (or its default_factory), which is how the SDK's
    argument model and the request model end up with the same field, default included."""
    return [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[field.annotation, field]
        )
        for name, field in model.model_fields.items()
    ]


def flat_arguments(
    model: type[M],
) -> Callable[[Callable[[Context, M], Awaitable[R]]], Callable[..., Awaitable[R]]]:
    """Decorate `async def tool(ctx: Context, request: Model) -> Result` into the function the
    SDK registers: `tool(ctx, **fields)` with a signature of the model's fields."""

    def wrap(fn: Callable[[Context, M], Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        returns = typing.get_type_hints(fn).get("return", inspect.Signature.empty)

        async def tool(ctx: Context, **arguments: Any) -> R:
            return await fn(ctx, model(**arguments))

        context = inspect.Parameter(CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=Context)
        params = [context, *parameters(model)]
        tool.__signature__ = inspect.Signature(params, return_annotation=returns)  # type: ignore[attr-defined]
        # the SDK finds the Context parameter through the annotations, not the signature
        tool.__annotations__ = {p.name: p.annotation for p in params} | {"return": returns}
        tool.__name__ = fn.__name__
        tool.__qualname__ = fn.__qualname__
        tool.__doc__ = fn.__doc__
        tool.__module__ = fn.__module__
        return tool

    return wrap
