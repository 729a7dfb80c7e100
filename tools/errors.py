"""One small error hierarchy for every tool.

A tool raises a `GpurigError` with a message that says what went wrong and a `remedy` that says
what to do. The front doors turn it into an MCP error result or a CLI message with exit code 2;
nothing else (a traceback) should ever reach a user for a problem they can fix.
"""

from __future__ import annotations


class GpurigError(Exception):
    """Base of all errors a user can act on."""

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        if self.remedy:
            return f"{self.message} -> {self.remedy}"
        return self.message


class InvalidInputError(GpurigError):
    """An argument is wrong: a bad path, a bad flag, an impossible value."""


class NotFoundError(GpurigError):
    """Something the tool needs is not there: an interpreter, a package, a file."""


class RefusedError(GpurigError):
    """The tool will not do this because it would fail or destroy something."""
