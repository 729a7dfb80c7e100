"""gpurig's OpenAI-compatible server for the in-process engine: `create_app(engine)`."""

from engine.server.app import create_app

__all__ = ["create_app"]
