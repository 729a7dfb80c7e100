"""Atomic file writes: a reader sees the old bytes or the new ones, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it,
    which races with other threads creating files); /proc has it on Linux >= 4.7."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_atomic(path: str | os.PathLike[str], data: bytes | str, mode: int | None = None) -> None:
    """Write to a temp file in the same directory, fsync, rename over `path`, fsync the directory.

    `mode` sets the permission bits; when None, an existing file's mode is kept and a new file
    gets the umask's usual 0o666 & ~umask (not mkstemp's private 0o600). An existing file keeps
    its owner when root rewrites it (sudo gpurig patch apply on a user's venv).
    """
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    existing = target.stat() if target.exists() else None
    if mode is None:
        mode = existing.st_mode & 0o7777 if existing else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        if existing and os.geteuid() == 0:  # root rewriting a user's file: it stays theirs
            os.chown(tmp, existing.st_uid, existing.st_gid)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename itself must survive a crash too.
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
