"""Atomic file writes: a reader sees the old bytes or the new ones, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes | str, mode: int | None = None) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`.

    `mode` sets the permission bits; when None, an existing file's mode is kept.
    """
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    if mode is None and target.exists():
        mode = target.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
