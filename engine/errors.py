"""The engine's own small error hierarchy.

engine/ must not import tools/, so it cannot raise `tools.errors.GpurigError`; the CLI and the
OpenAI server turn these into clean messages. Each error carries a `remedy` (what to do), like
the tools' errors, so the front doors can show both.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises for a problem the caller can act on."""

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        return f"{self.message} -> {self.remedy}" if self.remedy else self.message


class CheckpointError(EngineError):
    """The checkpoint directory is unusable: missing files or shards, wrong model type, bad tensors."""


class ContextLengthError(EngineError):
    """A prompt does not fit in the context the engine was loaded with."""

    def __init__(self, requested: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {requested} tokens but the context holds {limit}",
            "shorten the prompt, or load the engine with a larger max_context "
            "(at most the model's max_position_embeddings)",
        )
        self.requested = requested
        self.limit = limit


class GenerationError(EngineError):
    """A generation request is malformed (empty prompt, bad sampling values, token ids out of range)."""
