"""Apply, recognise and remove a `PatchSpec` on a file's text. Pure functions, no I/O.

The states a target file can be in, decided from its bytes and the wheel's RECORD hash:

- `stock`: the bytes hash to the RECORD entry, i.e. exactly what the wheel installed;
- `patched`: our block (this version, byte for byte) occurs exactly once, and the file with that
  block removed hashes to the RECORD entry, so nothing else was touched;
- `modified`: anything else (another edit, a partial or doubled block, an older patch version,
  a different release's file under a stale RECORD).

The file layer (tools/turing.py) reads and writes; this module only decides, so every rule here
can be tested on real files' text without touching a disk.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
from typing import Literal

from pydantic import BaseModel

from patches.spec import PatchSpec

State = Literal["stock", "patched", "modified"]


class PatchLayoutError(ValueError):
    """The file's layout is not one the patch knows: an anchor is missing, repeated or misplaced."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class AnchorHit(BaseModel):
    line: str
    count: int
    line_numbers: list[int]


class Classification(BaseModel):
    state: State
    occurrences: int  # begin markers of this patch (any version) in the file
    detail: str
    file_sha256: str  # RECORD format: urlsafe base64, no padding


def record_hash(data: bytes) -> str:
    """sha256 as a wheel's RECORD writes it: urlsafe base64 without '=' padding."""
    digest = hashlib.sha256(data).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def find_anchors(spec: PatchSpec, text: str) -> list[AnchorHit]:
    """Where each anchor line occurs (1-based line numbers), compared without the line ending."""
    stripped = [ln.rstrip("\r\n") for ln in _lines(text)]
    hits = []
    for anchor in spec.anchors:
        numbers = [i + 1 for i, ln in enumerate(stripped) if ln == anchor.line]
        hits.append(AnchorHit(line=anchor.line, count=len(numbers), line_numbers=numbers))
    return hits


def check_layout(spec: PatchSpec, text: str) -> list[AnchorHit]:
    """Raise PatchLayoutError unless every anchor occurs exactly once and in the listed order."""
    hits = find_anchors(spec, text)
    problems = [
        f"{'missing' if h.count == 0 else f'found {h.count} times'}: {h.line.strip()!r}"
        for h in hits
        if h.count != 1
    ]
    if not problems:
        positions = [h.line_numbers[0] for h in hits]
        if positions != sorted(positions):
            problems.append(
                "anchors out of order: "
                + ", ".join(f"{h.line.strip()!r}@{p}" for h, p in zip(hits, positions, strict=True))
            )
    if problems:
        raise PatchLayoutError(
            f"{spec.target}: layout not recognised by patch {spec.id} v{spec.version} "
            f"({'; '.join(problems)})",
            problems,
        )
    return hits


def insert_block(spec: PatchSpec, text: str, markers: bool = True) -> str:
    """The text with the block inserted before the `insert_before` anchor; checks the layout first.

    `markers=False` inserts the body alone: the form to propose upstream, where a gpurig marker
    means nothing.
    """
    if count_markers(spec, text):
        raise PatchLayoutError(
            f"{spec.target}: already holds a gpurig {spec.id} block", ["gpurig marker present"]
        )
    hits = check_layout(spec, text)
    target_line = next(h.line_numbers[0] for h in hits if h.line == spec.insert_before)
    lines = _lines(text)
    lines.insert(target_line - 1, spec.block if markers else spec.upstream_block)
    return "".join(lines)


def count_markers(spec: PatchSpec, text: str) -> int:
    """How many begin markers of this patch (any version) the text holds."""
    return len(spec.marker_pattern.findall(text))


def remove_block(spec: PatchSpec, text: str) -> str | None:
    """The text without our block, or None unless the exact block occurs exactly once."""
    if text.count(spec.block) != 1:
        return None
    return text.replace(spec.block, "", 1)


def classify(spec: PatchSpec, data: bytes, expected_hash: str) -> Classification:
    """Decide stock / patched / modified from the file's bytes and its RECORD hash."""
    file_hash = record_hash(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Classification(
            state="modified", occurrences=0, detail="not UTF-8 text", file_sha256=file_hash
        )
    occurrences = count_markers(spec, text)
    if file_hash == expected_hash:
        return Classification(
            state="stock",
            occurrences=occurrences,
            detail="identical to the installed wheel (RECORD hash matches)",
            file_sha256=file_hash,
        )
    if occurrences == 0:
        return Classification(
            state="modified",
            occurrences=0,
            detail="differs from the wheel's RECORD hash and holds no gpurig marker",
            file_sha256=file_hash,
        )
    versions = sorted({int(v) for v in spec.marker_pattern.findall(text)})
    if occurrences > 1:
        detail = f"the gpurig marker occurs {occurrences} times"
    elif versions != [spec.version]:
        detail = f"holds {spec.id} v{versions[0]}, not v{spec.version}"
    else:
        rest = remove_block(spec, text)
        if rest is not None and record_hash(rest.encode("utf-8")) == expected_hash:
            return Classification(
                state="patched",
                occurrences=1,
                detail="our block once; the rest identical to the wheel",
                file_sha256=file_hash,
            )
        detail = "holds the gpurig marker, but the block or the rest of the file was edited"
    return Classification(
        state="modified", occurrences=occurrences, detail=detail, file_sha256=file_hash
    )


def unified_diff(before: str, after: str, path: str) -> str:
    """A `git apply -p1` ready diff of `path` (a/ and b/ prefixes, 3 lines of context)."""
    return "".join(
        difflib.unified_diff(
            _lines(before), _lines(after), fromfile=f"a/{path}", tofile=f"b/{path}"
        )
    )
