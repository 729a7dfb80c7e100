"""Is this file a Python interpreter? Decided from the file alone, without running it.

gpurig runs the serving interpreter (the GPU probe, the vLLM lookup) with arguments of its own;
handed any executable, it ran it: a shell script passed as python_bin ran, and /bin/sh read
gpu_probe.py as a shell script. So an interpreter must be, by its file:

- a regular executable file (a symlink is followed: a venv's bin/python -> /usr/bin/python3.12),
- whose real name looks like an interpreter: python, python3, python3.12, python3.13t, pypy3,
  pypy3.10 (optionally a build suffix such as 'd', 't', 'm'),
- and that is an ELF executable (the first four bytes are 0x7f 'E' 'L' 'F').

A script such as a pyenv shim (`~/.pyenv/shims/python3`, a bash script) is refused: the remedy
says how to get the interpreter behind it. gpurig serves on Linux only, where interpreters are
ELF files.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from tools.errors import InvalidInputError, arg

NAME_RE = re.compile(r"^(python|pypy)(\d+(\.\d+)?)?[dmtu]*$")
ELF_MAGIC = b"\x7fELF"


def looks_like_interpreter_name(name: str) -> bool:
    """python, python3, python3.12, python3.13t, pypy3.10: yes; sh, ls, python3-config: no."""
    return bool(NAME_RE.match(name))


def _head(path: Path) -> bytes:
    # O_NONBLOCK: a FIFO posing as python must not block the open
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return os.read(fd, 128)
    finally:
        os.close(fd)


def check_interpreter_file(path: Path, shown: str | None = None) -> Path:
    """The real file behind `path` if it is a Python interpreter by its file; else
    InvalidInputError saying what it is instead and what to pass."""
    shown = shown or str(path)
    real = Path(os.path.realpath(path))
    how = f" (a link to {real})" if real != Path(os.path.abspath(path)) else ""
    try:
        info = real.stat()
        head = _head(real) if stat.S_ISREG(info.st_mode) else b""
    except OSError as exc:
        raise InvalidInputError(
            f"cannot read the serving interpreter {shown}{how}: {exc.strerror or exc}",
            remedy=f"pass the path of a Python interpreter you can read as {arg('python_bin')}",
        ) from None
    find_it = (
        "python3 -c 'import sys; print(sys.executable)' prints an interpreter's real path "
        "(in the venv or environment that runs vLLM)"
    )
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(
            f"{shown}{how} is not a regular file, so not a Python interpreter",
            remedy=f"pass a Python interpreter as {arg('python_bin')}; {find_it}",
        )
    if head.startswith(b"#!"):
        shim = "shims" in real.parts
        raise InvalidInputError(
            f"{shown}{how} is a script ({head.splitlines()[0][:60].decode('latin-1')}), not a "
            "Python interpreter; gpurig does not run it",
            remedy=(
                "it is a pyenv shim: pass the interpreter behind it, $(pyenv which python3)"
                if shim
                else f"pass the interpreter itself as {arg('python_bin')}; {find_it}"
            ),
        )
    if not head.startswith(ELF_MAGIC):
        raise InvalidInputError(
            f"{shown}{how} is not an executable program file (no ELF header), so not a Python "
            "interpreter; gpurig does not run it",
            remedy=f"pass a Python interpreter as {arg('python_bin')}; {find_it}",
        )
    if not looks_like_interpreter_name(real.name):
        raise InvalidInputError(
            f"{shown}{how} is a program named {real.name!r}, not a Python interpreter "
            "(python, python3, python3.X or pypy3); gpurig does not run it",
            remedy=f"pass a Python interpreter as {arg('python_bin')}; {find_it}",
        )
    return real
