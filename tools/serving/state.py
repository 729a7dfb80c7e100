"""Server records on disk: state_dir()/servers/<name>.json, written atomically.

A record outlives the process that wrote it (the MCP server may restart; the CLI exits at once),
so everything stop and status need is in it: the pid with its start time (a reused pid is never
mistaken for ours), the port, the log path and the command. Several servers run at once under
different names; one lock file serialises starts so two of them cannot claim one name.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from tools.errors import InvalidInputError
from tools.fileio import write_atomic
from tools.serving.models import ServerRecord
from tools.settings import state_dir

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def servers_dir(create: bool = True) -> Path:
    path = state_dir(create=create) / "servers"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def check_name(name: str) -> str:
    """A name is a file name too: letters, digits, '.', '_' and '-', at most 64."""
    if not NAME_RE.match(name or ""):
        raise InvalidInputError(
            f"server name {name!r} is not allowed",
            remedy="use letters, digits, '.', '_' or '-' (at most 64, starting with a letter or "
            "digit), e.g. gemma-qat",
        )
    return name


def record_path(name: str) -> Path:
    return servers_dir() / f"{check_name(name)}.json"


def log_path(name: str) -> Path:
    return servers_dir() / f"{check_name(name)}.log"


def exit_path(name: str) -> Path:
    return servers_dir() / f"{check_name(name)}.exit.json"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text)


def write_record(record: ServerRecord) -> None:
    write_atomic(record_path(record.name), record.model_dump_json(indent=2) + "\n", mode=0o600)


def read_record(name: str) -> ServerRecord | None:
    """The record of `name`, or None when there is none (or it is unreadable: said in the log)."""
    path = record_path(name)
    try:
        return ServerRecord.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, ValueError):
        return None


def list_records() -> list[ServerRecord]:
    """Every readable record, oldest start first."""
    folder = servers_dir(create=False)
    if not folder.is_dir():
        return []
    out: list[ServerRecord] = []
    for path in folder.glob("*.json"):
        if path.name.endswith(".exit.json"):
            continue
        try:
            out.append(ServerRecord.model_validate_json(path.read_text()))
        except (OSError, ValidationError, ValueError):
            continue
    return sorted(out, key=lambda r: (r.started_at, r.name))


def read_exit(record: ServerRecord) -> dict | None:
    """What the supervisor wrote when the server ended: returncode, signal, ended_at."""
    try:
        data = json.loads(Path(record.exit_path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextmanager
def start_lock() -> Iterator[None]:
    """One start at a time on this host: the name and port checks and the record write must not
    interleave with another start."""
    lock = servers_dir() / ".start.lock"
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
