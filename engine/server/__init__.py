"""gpurig's OpenAI-compatible server for the in-process engine: `create_app(engine, options=...)`
with `ServerOptions` (API key, max_tokens cap, body limit)."""

from engine.server.app import create_app
from engine.server.limits import ServerOptions

__all__ = ["ServerOptions", "create_app"]
