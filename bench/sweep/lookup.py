"""Finding a sweep and reading its state back: where sweeps live, a sweep from its id or path,
the requests it plans, and sweep_status (cells done, the current cell, the time left), from the
sweep's directory alone, so it works while a detached worker runs it, after it finished, or
after it was killed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from bench.sweep.models import CellKey, SweepConfig, SweepStatus
from bench.sweep.store import SweepStore
from tools.errors import NotFoundError
from tools.settings import state_dir


def sweeps_dir() -> Path:
    return state_dir() / "sweeps"


def cell_requests(config: SweepConfig, key: CellKey) -> int:
    return config.requests_in_cell(key.concurrency, key.rate)


def planned_requests(config: SweepConfig) -> int:
    """Requests the sweep will send: the grid's, or a search's estimate (its doubling steps
    plus three bisection steps per target and input length)."""
    if config.search is None:
        return sum(cell_requests(config, k) for k in config.cell_keys())
    spec = config.search
    steps = 1 + max(0, math.ceil(math.log2(spec.max / spec.start))) + 3
    per = config.requests_in_cell(int(spec.start)) * config.repeats * steps
    return per * len(config.targets) * len(config.input_lens)


def find_sweep_dir(ref: str) -> Path:
    """A sweep directory from a path or a sweep id (under the state directory)."""
    path = Path(ref).expanduser()
    if (path / "sweep.json").is_file():
        return path.resolve()
    by_id = sweeps_dir() / ref
    if (by_id / "sweep.json").is_file():
        return by_id
    raise NotFoundError(
        f"no sweep at {ref}",
        f"pass a sweep's directory or its id (sweeps live in {sweeps_dir()})",
    )


def sweep_status(sweep: str) -> SweepStatus:
    """Cells done, the current cell and the time left, read from the sweep's files."""
    store = SweepStore(find_sweep_dir(sweep))
    config = store.load_config()
    cells = store.load_cells()
    keys = config.cell_keys()
    status = store.read_status()
    runner = store.runner_pid()
    per_req = [(c.duration_s, c.n_requests) for c in cells if c.completed > 0]
    sec_per_req = sum(d for d, _ in per_req) / max(1, sum(n for _, n in per_req))
    done_keys = {c.key() for c in cells}
    if config.search is not None:  # a search's cells are known as it goes
        finished = status.get("state") == "done" and runner is None
        keys = [c.key() for c in cells]
        total = sum(cell_requests(config, k) for k in keys)
        left = 0 if finished else max(0, planned_requests(config) - total)
        total += left
    else:
        finished = len(done_keys) >= len(keys)
        left = sum(cell_requests(config, k) for k in keys if k not in done_keys)
        total = sum(cell_requests(config, k) for k in keys)
    if finished:
        state, message = "done", "finished"
    elif runner is not None:
        state, message = "running", f"running in process {runner}"
    elif cells or status:
        state = "stopped"
        message = f"not running; continue it with resume={store.dir}"
    else:
        state, message = "pending", "planned, not started"
    report = store.dir / "REPORT.md"
    return SweepStatus(
        sweep_id=config.sweep_id,
        out_dir=str(store.dir),
        state=state,
        worker_pid=runner if runner and runner > 0 else None,
        cells_total=max(len(keys), len(done_keys)),
        cells_done=len(done_keys),
        cells_failed=sum(1 for c in cells if c.status == "failed"),
        current=status.get("current") if state == "running" else None,
        requests_done=int(status.get("requests_done") or (total - left)),
        requests_total=total,
        elapsed_s=round(time.time() - status["run_started"], 1)
        if status.get("run_started") and state == "running"
        else None,
        eta_s=round(left * sec_per_req, 1) if per_req and state == "running" else None,
        message=message,
        report=str(report) if report.is_file() else None,
    )
