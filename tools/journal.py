"""Append-only JSON-lines journals and the lock of the process that writes one: what a sweep's
cells.jsonl and an evaluation's answers.jsonl are built on, so that a kill loses at most the
record in flight.

* `append_line`: one record, one write loop + fsync, so a record counted done is on disk.
* `read_whole_lines`: the records up to the first line that is torn (no newline: the kill came
  mid-write) or does not parse; with `repair` the file is cut back to them, so a resumed run
  appends after whole records only.
* `run_lock`: a non-blocking flock on the directory's `.lock` holding the runner's pid; a second
  runner is refused with the caller's message instead of writing the same records twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from tools.errors import RefusedError

T = TypeVar("T")


def append_line(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_whole_lines(path: Path, parse: Callable[[bytes], T], repair: bool = False) -> list[T]:
    """Every whole, parseable record in order; `parse` raises ValueError on a bad line."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    records: list[T] = []
    good_end = 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            records.append(parse(raw))
        except ValueError:
            break
        good_end += len(raw)
    if repair and good_end < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
            fh.flush()
            os.fsync(fh.fileno())
    return records


@contextlib.contextmanager
def run_lock(lock_path: Path, busy: str, remedy: str) -> Iterator[None]:
    """Hold `lock_path` (created with its directory) for as long as the block runs."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RefusedError(busy, remedy) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)


def lock_holder(lock_path: Path) -> int | None:
    """The pid holding the lock now (-1 when it is held but names none), or None when free."""
    if not lock_path.exists():
        return None
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = lock_path.read_text().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
