"""A sweep's directory: the plan, the finished cells, the live status, and who runs it.

    sweep.json      the SweepConfig, written once before the first request
    cells.jsonl     one CellRecord per line, appended (one write + fsync) as each cell finishes
    status.json     what runs now (current cell, requests done), rewritten atomically
    roofline.json   bytes per token and the bandwidth probe, measured once per sweep
    .lock           held (flock) by the process running the sweep
    worker.log      a detached worker's stdout and stderr

A killed sweep loses at most the cell in flight: a torn last line of cells.jsonl (the kill came
mid-write) is cut off when the sweep resumes, and every whole line is a finished cell.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from bench.sweep.models import CellRecord, Roofline, SweepConfig
from tools import journal
from tools.errors import NotFoundError
from tools.fileio import write_atomic


class SweepStore:
    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir).expanduser().resolve()
        self.config_path = self.dir / "sweep.json"
        self.cells_path = self.dir / "cells.jsonl"
        self.status_path = self.dir / "status.json"
        self.roofline_path = self.dir / "roofline.json"
        self.lock_path = self.dir / ".lock"
        self.log_path = self.dir / "worker.log"

    # ---- the plan --------------------------------------------------------------------------

    def save_config(self, config: SweepConfig) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config_path, config.model_dump_json(indent=2) + "\n")

    def load_config(self) -> SweepConfig:
        if not self.config_path.is_file():
            raise NotFoundError(
                f"{self.dir} holds no sweep (no sweep.json)",
                "pass the directory a sweep wrote (its out_dir), or a sweep id",
            )
        return SweepConfig.model_validate_json(self.config_path.read_text(encoding="utf-8"))

    # ---- cells -----------------------------------------------------------------------------

    def append_cell(self, cell: CellRecord) -> None:
        journal.append_line(self.cells_path, (cell.model_dump_json() + "\n").encode())

    def load_cells(self, repair: bool = False) -> list[CellRecord]:
        """Every whole cell on disk; with `repair`, a torn last line is cut off the file."""
        return journal.read_whole_lines(self.cells_path, CellRecord.model_validate_json, repair)

    # ---- status and roofline ---------------------------------------------------------------

    def write_status(self, status: dict[str, Any]) -> None:
        write_atomic(self.status_path, json.dumps(status, indent=1) + "\n")

    def read_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def save_roofline(self, items: list[Roofline]) -> None:
        payload = [r.model_dump() for r in items]
        write_atomic(self.roofline_path, json.dumps(payload, indent=2) + "\n")

    def load_roofline(self) -> list[Roofline] | None:
        try:
            raw = json.loads(self.roofline_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return [Roofline.model_validate(r) for r in raw]

    # ---- who runs it -----------------------------------------------------------------------

    def running(self) -> contextlib.AbstractContextManager[None]:
        """Hold the sweep's lock for as long as this process runs it; a second runner is
        refused rather than appending the same cells twice."""
        return journal.run_lock(
            self.lock_path,
            f"the sweep in {self.dir} is being run by another process",
            "wait for it (sweep_status shows its progress), or stop that process first",
        )

    def runner_pid(self) -> int | None:
        """The pid holding the lock now, or None when no process runs the sweep."""
        return journal.lock_holder(self.lock_path)
