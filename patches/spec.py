"""What a source patch is, as data: the file it targets, the lines it anchors on, the block it adds.

A patch is a plain value so that the engine (patches/engine.py) stays generic and a reviewer can
read the whole change in one place. Anchors are whole lines: each must occur exactly once in the
target file, in the listed order; that is how the engine recognises a layout it knows and refuses
any other (a file it would otherwise patch in the wrong place).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Anchor(BaseModel):
    """One whole line (without its newline) that must appear exactly once in the target file."""

    model_config = ConfigDict(frozen=True)

    line: str
    why: str = Field(description="what the patched code relies on this line for")


class PatchSpec(BaseModel):
    """A patch: an id and version, a target file, ordered anchors and a marked block to insert.

    The block is inserted on its own lines directly before the anchor line `insert_before`. Its
    first and last lines are the begin and end markers, which name the patch and its version, so
    a patched file says what changed it and the block can be found and removed exactly.
    """

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="stable name, e.g. 'turing-smem-clamp'")
    version: int = Field(ge=1, description="bumped whenever `body` changes")
    summary: str
    target: str = Field(description="path of the file inside the distribution, '/'-separated")
    distribution: str = Field(description="the installed distribution that owns `target`")
    tested_versions: tuple[str, ...] = Field(description="releases proven by the test suite")
    anchors: tuple[Anchor, ...]
    insert_before: str = Field(description="the anchor line the block goes in front of")
    indent: str = Field(description="indentation of the marker lines")
    body: str = Field(description="the inserted code between the markers, newline-terminated")

    @model_validator(mode="after")
    def _consistent(self) -> PatchSpec:
        lines = [a.line for a in self.anchors]
        if self.insert_before not in lines:
            raise ValueError("insert_before must be one of the anchors")
        if not self.body.endswith("\n"):
            raise ValueError("body must end with a newline")
        return self

    @property
    def begin_marker(self) -> str:
        return f"{self.indent}# >>> gpurig patch {self.id} v{self.version}: {self.summary}"

    @property
    def end_marker(self) -> str:
        return f"{self.indent}# <<< gpurig patch {self.id} v{self.version}"

    @property
    def block(self) -> str:
        """The exact text inserted: begin marker, body, end marker, then one blank line."""
        return f"{self.begin_marker}\n{self.body}{self.end_marker}\n\n"

    @property
    def upstream_block(self) -> str:
        """The body alone (no gpurig markers), with the same blank line: the form for upstream."""
        return f"{self.body}\n"

    @property
    def marker_pattern(self) -> re.Pattern[str]:
        """Matches the begin marker of ANY version of this patch (to spot an older one)."""
        return re.compile(rf"^[ \t]*# >>> gpurig patch {re.escape(self.id)} v(\d+)\b", re.M)
