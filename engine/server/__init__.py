"""gpurig's OpenAI-compatible server for the engine: `create_app(engine, options=...)` with
`ServerOptions` (API key, max_tokens cap, body limit); `python -m engine.server --model DIR`
runs it (main.py, the composition root; `gpurig engine serve` calls the same).

Both are imported on first use: the engine process imports engine.server.gc_watch, and with it
this package, and needs nothing of the HTTP side (starlette and the handlers take a third of a
second to import)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.server.app import create_app
    from engine.server.limits import ServerOptions

__all__ = ["ServerOptions", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from engine.server.app import create_app

        return create_app
    if name == "ServerOptions":
        from engine.server.limits import ServerOptions

        return ServerOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
