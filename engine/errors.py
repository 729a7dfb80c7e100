"""gpurig's one error hierarchy, the engine's errors included, and the neutral argument placeholder.

Every error a user can act on is a `GpurigError(message, remedy)`: a message that says what went
wrong and a remedy that says what to do. It lives here, in engine/, because the engine may import
none of tools/, mcp_server/ or bench/, while the tools and both front doors can import the engine's
(cheap) errors module; tools/errors.py re-exports the hierarchy. Each front door understands every
error alike, so no code translates between hierarchies:

- the CLI prints the message and the remedy and exits 2 (mcp_server/output.py);
- the MCP server returns them as the tool's error result (mcp_server/mcp_errors.py);
- the engine's OpenAI server answers with the HTTP status of the error's `category`
  (engine/server/errors.py: the caller's mistake 400, anything else 500).

The `category` says whose move it is: `invalid_input` (an argument is wrong), `not_found`
(something needed is not there), `refused` (it would fail or destroy something), `failed` (it was
tried and did not work). InvalidInputError, NotFoundError and RefusedError are the categories as
classes; the engine's errors subclass EngineError and the category class that fits them, so a
caller catching NotFoundError also catches a missing checkpoint.

Text that names an argument (in an error's message or remedy, or in a report's remedy field)
names it through `arg()`, because the code raising it does not know which front door will show
it (the CLI's user types `--need-gib`, an MCP caller passes `need_gib`):

    remedy=f"pass the size of the weights in GiB, e.g. {arg('need_gib')}=10"

`arg("need_gib")` is the placeholder `{arg:need_gib}` (`ARG_PATTERN` matches it). The front doors'
words live with the front doors (mcp_server/wording.py: `--need-gib` on the CLI, `need_gib` over
MCP); here `plain(text)` renders the placeholder as the bare name, which is what `str(err)` shows
(logs, tests).

Importing this module is cheap (the standard library only): `gpurig --help` imports it.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

Category = Literal["invalid_input", "not_found", "refused", "failed"]

ARG_PATTERN = re.compile(r"\{arg:([A-Za-z_][A-Za-z0-9_]*)\}")


def arg(name: str) -> str:
    """The placeholder for argument `name` in text that any front door may show."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"not an argument name: {name!r}")
    return "{arg:" + name + "}"


def plain(text: str) -> str:
    """`text` with each argument placeholder as the argument's bare name (no front door's words)."""
    return ARG_PATTERN.sub(lambda m: m.group(1), text) if "{" in text else text


class GpurigError(Exception):
    """Base of all errors a user can act on: a message, and a remedy saying what to do."""

    category: ClassVar[Category] = "failed"

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def __str__(self) -> str:
        if self.remedy:
            return f"{plain(self.message)} -> {plain(self.remedy)}"
        return plain(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields, whatever its subclass's constructor takes (the engine's
        process sends its refusals to the server's: engine/process/core.py)."""
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[GpurigError], args: tuple[Any, ...], fields: dict[str, Any]) -> GpurigError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class InvalidInputError(GpurigError):
    """An argument is wrong: a bad path, a bad flag, an impossible value."""

    category: ClassVar[Category] = "invalid_input"


class NotFoundError(GpurigError):
    """Something the tool needs is not there: an interpreter, a package, a file."""

    category: ClassVar[Category] = "not_found"


class RefusedError(GpurigError):
    """The tool will not do this because it would fail or destroy something."""

    category: ClassVar[Category] = "refused"


# ---------------------------------------------------------------------------------------------
# The engine's errors


class EngineError(GpurigError):
    """Base of every error the engine raises for a problem the caller can act on (as such: the
    engine could not do it, e.g. another generation took its cache)."""

    category: ClassVar[Category] = "failed"


class CheckpointError(EngineError, NotFoundError):
    """The checkpoint directory is unusable: missing files or shards, wrong model type, bad tensors."""

    category: ClassVar[Category] = "not_found"


class ContextLengthError(EngineError, RefusedError):
    """A prompt does not fit in the context the engine was loaded with."""

    category: ClassVar[Category] = "refused"

    def __init__(self, requested: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {requested} tokens but the context holds {limit}",
            "shorten the prompt, or load the engine with a larger max_context "
            "(at most the model's max_position_embeddings)",
        )
        self.requested = requested
        self.limit = limit


class GenerationError(EngineError, InvalidInputError):
    """A generation request is malformed (empty prompt, bad sampling values, token ids out of range)."""

    category: ClassVar[Category] = "invalid_input"
