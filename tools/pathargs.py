"""Paths given by a caller: checked before use, and read only when they are small regular files.

A path argument can hold anything: a NUL byte (Python's os functions raise ValueError, which
reached users as "Error executing tool X" or a traceback), 20 MB of text (ENAMETOOLONG, or an
error message that echoes it), or name /dev/zero, a FIFO or a 30 GB file (read without limit
until MemoryError, or blocked forever). These helpers refuse all of that with an error that
names the argument in the caller's words (tools/errors.py `arg`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from tools.errors import InvalidInputError, NotFoundError, arg

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def _shown(value: str) -> str:
    return repr(value[:60] + ("..." if len(value) > 60 else ""))


def check_path_text(value: str, name: str) -> str:
    """`value` unchanged if it can be a path; else InvalidInputError naming argument `name`."""
    if "\x00" in value:
        raise InvalidInputError(
            f"the path given as {arg(name)} ({_shown(value)}) holds a NUL byte",
            remedy=f"pass a plain file path as {arg(name)}",
        )
    if len(value) > MAX_PATH_CHARS:
        raise InvalidInputError(
            f"the path given as {arg(name)} is {len(value):,} characters long "
            f"(at most {MAX_PATH_CHARS} are accepted): {_shown(value)}",
            remedy=f"pass the file's real path as {arg(name)}",
        )
    return value


def read_small_file(value: str, name: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at `value`, refused before reading when it is not one (a
    device, a FIFO, a directory) or larger than `max_bytes`."""
    path = Path(check_path_text(value, name)).expanduser()
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(
            f"{arg(name)} {_shown(str(path))} does not exist",
            remedy=f"pass the path of an existing file as {arg(name)}",
        ) from None
    except OSError as exc:
        why = "the path is too long" if exc.errno == errno.ENAMETOOLONG else exc.strerror
        raise InvalidInputError(
            f"cannot open {arg(name)} {_shown(str(path))}: {why or exc}",
            remedy=f"pass a readable regular file as {arg(name)}",
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise InvalidInputError(
            f"{arg(name)} {_shown(str(path))} is {kind} (a device, FIFO or socket is never read)",
            remedy=f"pass a regular file as {arg(name)}",
        )
    with os.fdopen(fd, "rb") as fh:
        if info.st_size > max_bytes:
            raise InvalidInputError(
                f"{arg(name)} {_shown(str(path))} is {info.st_size:,} bytes; at most "
                f"{max_bytes:,} are read",
                remedy=f"pass the right file as {arg(name)}",
            )
        data = fh.read(max_bytes + 1)  # a file that grew since fstat is still bounded
    if len(data) > max_bytes:
        raise InvalidInputError(
            f"{arg(name)} {_shown(str(path))} grew past {max_bytes:,} bytes while being read",
            remedy=f"pass the right file as {arg(name)}",
        )
    return data
