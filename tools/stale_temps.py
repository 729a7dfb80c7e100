"""Temp files an interrupted atomic write left behind, found and removed by their exact name.

`tools.fileio.write_atomic(path)` writes `.<name>.XXXXXXXX.tmp` beside `path` (tempfile.mkstemp:
8 characters of [a-z0-9_]) and renames it over `path`. A process killed between the two (kill -9
during `gpurig patch apply`: 20 of 82 kills in the fuzzing of issue 12) leaves that temp file
beside vLLM's file, where `pip uninstall vllm` will not remove it. Only names of exactly that
shape for exactly that target match: nothing else in the folder is ever touched.

Callers must hold the lock that serialises their writers (tools/turing.py `_locked`), or a live
temp file of a concurrent write would look stale.
"""

from __future__ import annotations

import logging
import re
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def temp_name_pattern(target: Path) -> re.Pattern[str]:
    """The names write_atomic's temp files for `target` have (tempfile's 8-character part)."""
    return re.compile(rf"^\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.tmp$")


def find_stale(target: Path) -> list[Path]:
    """write_atomic temp files of `target` in its folder: regular files, not links."""
    pattern = temp_name_pattern(target)
    try:
        entries = list(target.parent.iterdir())
    except OSError:  # no such folder (a backup not made yet), or not readable
        return []
    found = []
    for entry in entries:
        if not pattern.match(entry.name):
            continue
        try:
            if stat.S_ISREG(entry.lstat().st_mode):
                found.append(entry)
        except OSError:
            continue
    return sorted(found)


def remove_stale(paths: list[Path]) -> list[Path]:
    """Remove `paths`; returns those that are gone now (one that cannot be removed is logged)."""
    gone = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the stale temp file %s: %s", path, exc.strerror or exc)
            continue
        gone.append(path)
    return gone
