"""The tools' settings from the environment: the serving interpreter, the state directory and
the Hugging Face cache, turned into checked values.

Every GPURIG_* variable is declared, with its meaning and default, in engine/env.py (its
VARIABLES table) and read through it; HF_HOME / HF_HUB_CACHE (where Hugging Face keeps
checkpoints, measured by check_host_capacity; default ~/.cache/huggingface/hub) and
XDG_STATE_HOME are the platform's own. Every CLI flag that names one of these (`--python`)
wins over the variable.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from engine import env
from tools.errors import InvalidInputError, NotFoundError, arg
from tools.interpreter import check_interpreter_file
from tools.pathargs import MAX_PATH_CHARS, check_path_text


def serving_python(explicit: str | None = None) -> str:
    """The interpreter that runs (or would run) vLLM: the flag, else GPURIG_PYTHON, else ours.

    An explicit empty string is returned as it is (and refused by `resolve_python`): `--python
    "$UNSET"` must not quietly fall back to another interpreter. An empty GPURIG_PYTHON counts
    as unset.
    """
    if explicit is not None:
        return explicit
    return env.read("GPURIG_PYTHON") or sys.executable


def resolve_python(explicit: str | None = None) -> str:
    """The serving interpreter as an absolute, executable path; a clear error otherwise.

    Every tool that runs the serving interpreter (the GPU probe, the vLLM lookup of the Turing
    patch) goes through here, so a bad --python reads the same everywhere. Nothing is run: a
    file that is not a Python interpreter by its name and ELF header is refused here
    (tools/interpreter.py), before any tool would execute it.
    """
    given = serving_python(explicit)
    if explicit is None and env.read("GPURIG_PYTHON"):
        given_text = f"{given} (GPURIG_PYTHON)"  # say where a path nobody typed came from
    else:
        given_text = given
    if not given.strip():
        raise InvalidInputError(
            "the serving interpreter's path is empty",
            remedy=f"pass a path such as /usr/bin/python3.13 as {arg('python_bin')}, or leave "
            "it out to use GPURIG_PYTHON, else this Python",
        )
    name = "python_bin" if explicit is not None else "GPURIG_PYTHON"
    if name == "python_bin":
        check_path_text(given, name)
    elif "\x00" in given or len(given) > MAX_PATH_CHARS:
        raise InvalidInputError(
            "GPURIG_PYTHON is not a usable path (too long, or holds a NUL byte)",
            remedy="set GPURIG_PYTHON to the interpreter's path, or unset it",
        )
    expanded = os.path.expanduser(given)
    if os.sep not in expanded:
        found = shutil.which(expanded)
        if not found:
            raise NotFoundError(
                f"no interpreter named {given!r} on PATH" + given_text.removeprefix(given),
                remedy="pass the interpreter's full path, e.g. /usr/bin/python3.13, "
                "or set GPURIG_PYTHON",
            )
        expanded = found
    path = Path(expanded)
    try:
        exists = path.exists()
    except OSError as exc:  # ENAMETOOLONG on one component, EACCES on a parent, ...
        raise InvalidInputError(
            f"cannot look at the serving interpreter {given_text[:200]}: {exc.strerror or exc}",
            remedy=f"pass the interpreter's real path as {arg('python_bin')}",
        ) from None
    if not exists:
        raise NotFoundError(
            f"the serving interpreter {given_text} does not exist",
            remedy="pass the full path of the Python that runs vLLM (e.g. /usr/bin/python3.13), "
            f"as {arg('python_bin')} or in GPURIG_PYTHON"
            + (" (or unset GPURIG_PYTHON to use this Python)" if given_text != given else ""),
        )
    if path.is_dir():
        raise InvalidInputError(
            f"{given_text} is a directory, not a Python interpreter",
            remedy=f"pass the interpreter inside it, e.g. {path / 'bin' / 'python3'}",
        )
    if not os.access(path, os.X_OK):
        raise InvalidInputError(
            f"{given_text} is not executable",
            remedy=f"pass an executable Python interpreter (chmod +x {path} if it is one)",
        )
    check_interpreter_file(path, given_text)
    return str(path.absolute())


def state_dir(create: bool = True) -> Path:
    """GPURIG_HOME, else the XDG state directory; created on first use unless `create` is False
    (read-only tools only name paths in it)."""
    home = env.read("GPURIG_HOME")
    if home:
        path = Path(home).expanduser()
    else:
        xdg = os.environ.get("XDG_STATE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
        path = base / "gpurig"
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidInputError(
                f"cannot create the state directory {path}: {exc.strerror or exc}",
                remedy="set GPURIG_HOME to a directory you can write, e.g. "
                "GPURIG_HOME=~/.local/state/gpurig",
            ) from exc
    return path


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub resolves it (without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"
