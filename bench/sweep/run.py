"""run_sweep, sweep_status and sweep_report: the one function behind the MCP tool and the CLI.

run_sweep writes the plan (sweep.json) first, then runs it: in this process (wait=True, with a
progress callback per request) or in a detached worker process (wait=False: `python -m
bench.sweep.run DIR`, its own session, so the caller, an MCP server or a CLI, may exit). Both run
`execute(dir)`, which is also what resume=DIR runs: cells already in cells.jsonl are skipped.
Targets run one after the other; a `server` target is started before its cells and stopped
after them.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bench.sweep import cellrun, targets
from bench.sweep.models import (
    CellKey,
    Roofline,
    SweepConfig,
    SweepResult,
    SweepStatus,
    Target,
)
from bench.sweep.prompts import common_pool, pool_ids
from bench.sweep.report import build_report
from bench.sweep.roofline import bytes_per_token, run_bandwidth_probe
from bench.sweep.store import SweepStore
from tools.errors import InvalidInputError, NotFoundError
from tools.serving.process import reap_when_done
from tools.settings import serving_python, state_dir

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
REPO = Path(__file__).resolve().parents[2]


def sweeps_dir() -> Path:
    return state_dir() / "sweeps"


def _new_id() -> str:
    return f"sweep-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _bad_input(exc: ValidationError) -> InvalidInputError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "arguments"
    return InvalidInputError(
        f"invalid sweep: {where}: {first['msg']}",
        "fix that argument (targets are {'label', 'base_url'} or {'label', 'server': {...}})",
    )


def plan(
    targets_in: list[dict[str, Any] | Target],
    input_lens: list[int],
    output_len: int,
    concurrency: list[int],
    repeats: int,
    prompts_per_cell: int | None,
    seed: int,
    driver: str,
    out_dir: str | None,
    request_timeout_s: float = 600.0,
) -> SweepConfig:
    """Validate the arguments and fix the prompt pool: the plan a (resumed) sweep runs."""
    sweep_id = _new_id()
    out = Path(out_dir).expanduser().resolve() if out_dir else sweeps_dir() / sweep_id
    if (out / "sweep.json").exists():
        raise InvalidInputError(
            f"{out} already holds a sweep", f"resume it with resume={out}, or pick another out_dir"
        )
    try:
        config = SweepConfig(
            sweep_id=sweep_id,
            out_dir=str(out),
            created=cellrun.now_iso(),
            targets=[t if isinstance(t, Target) else Target.model_validate(t) for t in targets_in],
            input_lens=input_lens,
            output_len=output_len,
            concurrency=concurrency,
            repeats=repeats,
            prompts_per_cell=prompts_per_cell,
            seed=seed,
            driver=driver,
            request_timeout_s=request_timeout_s,
        )
    except ValidationError as exc:
        raise _bad_input(exc) from None
    if config.driver == "builtin":
        vocabs = [v for v in (targets.vocab_of(t) for t in config.targets) if v is not None]
        if not vocabs:
            raise NotFoundError(
                "no target's vocabulary is known, so no valid prompt token ids can be drawn",
                "give at least one target a model_dir (a checkpoint directory with "
                "tokenizer.json or config.json), or start it through the sweep ('server')",
            )
        config.pool_size, config.pool_exclude = common_pool(vocabs)
    return config


def _measure_roofline(config: SweepConfig) -> list[Roofline]:
    """Bytes per token per target (headers) and one bandwidth probe per serving interpreter,
    run before any server the sweep starts holds the GPU."""
    probes: dict[str, dict] = {}
    out = []
    for t in config.targets:
        r = Roofline(target=t.label, model_dir=targets.static_model_dir(t))
        python_bin = t.python_bin or (t.server or {}).get("python_bin") or serving_python()
        if r.model_dir is None and t.base_url:
            try:
                r.model_dir = targets.resolve(t).model_dir
            except Exception:
                r.model_dir = None
        missing = []
        if r.model_dir:
            try:
                r.bytes_per_token, r.parts, r.tensors = bytes_per_token(r.model_dir)
            except (OSError, ValueError) as exc:
                missing.append(f"no bytes per token: {exc}")
        else:
            missing.append("no bytes per token: the checkpoint directory is not known")
        if python_bin not in probes:
            probes[python_bin] = _no_gpu() or run_bandwidth_probe(python_bin)
        probe = probes[python_bin]
        if probe.get("available"):
            r.bandwidth_gb_s, r.device = probe.get("gb_s"), probe.get("device")
        else:
            missing.append(f"no bandwidth: {probe.get('reason')}")
        if r.bytes_per_token and r.bandwidth_gb_s:
            r.ceiling_tok_s = round(r.bandwidth_gb_s * 1e9 / r.bytes_per_token, 1)
        r.missing = "; ".join(missing) or None
        out.append(r)
    return out


def _no_gpu() -> dict | None:
    """The probe's answer without running it when NVML sees no GPU at all (no driver): the
    probe would only import torch to say the same, seconds later."""
    from tools.gpu_nvml import nvml_gpu_count, read_nvml

    if nvml_gpu_count(timeout_s=2.0):
        return None
    error = read_nvml().error or "NVML lists no GPU"
    return {"available": False, "reason": f"no NVIDIA GPU visible ({error})"}


class _Tracker:
    """Counts requests for progress callbacks and keeps status.json current (at most twice a
    second, and at every cell boundary)."""

    def __init__(self, store: SweepStore, config: SweepConfig, progress: Progress | None) -> None:
        self.store, self.config, self.progress = store, config, progress
        self.total = sum(config.requests_in_cell(k.concurrency) for k in config.cell_keys())
        self.done = 0
        self.current: str | None = None
        self.started = time.time()
        self._last = 0.0

    def add(self, n: int, message: str, force: bool = False) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total, message)
        now = time.monotonic()
        if force or now - self._last > 0.5:
            self._last = now
            self.store.write_status(
                {
                    "state": "running",
                    "pid": os.getpid(),
                    "current": self.current,
                    "requests_done": self.done,
                    "requests_total": self.total,
                    "run_started": self.started,
                    "updated": time.time(),
                }
            )


def execute(out_dir: str | Path, progress: Progress | None = None) -> SweepResult:
    """Run (or continue) the sweep in `out_dir` to the end and write its report."""
    store = SweepStore(out_dir)
    config = store.load_config()
    with store.running():
        done = {c.key() for c in store.load_cells(repair=True)}
        tracker = _Tracker(store, config, progress)
        already = sum(config.requests_in_cell(k.concurrency) for k in done)
        tracker.add(already, f"resumed: {len(done)} cells done" if done else "starting", True)
        if store.load_roofline() is None:
            store.save_roofline(_measure_roofline(config))
        pool = pool_ids(config.pool_size or 1, config.pool_exclude) if config.pool_size else None
        for target in config.targets:
            keys = [k for k in config.cell_keys() if k.target == target.label and k not in done]
            if keys:
                _run_target(store, config, target, keys, pool, tracker)
        tracker.current = None
        store.write_status({"state": "done", "pid": os.getpid(), "updated": time.time()})
    return _result(store, "done")


def _run_target(
    store: SweepStore,
    config: SweepConfig,
    target: Target,
    keys: list[CellKey],
    pool: Any,
    tracker: _Tracker,
) -> None:
    record, reason = None, None
    if target.server is not None:
        tracker.current = f"{target.label}: starting its server"
        tracker.add(0, tracker.current, True)
        record, reason = targets.start_server(target, config.sweep_id)
    live = None
    if reason is None:
        try:
            live = targets.resolve(target, record)
        except Exception:
            reason = targets.check_alive(record.base_url if record else target.base_url or "")
            reason = reason or "target did not answer /v1/models"
    try:
        warmed: set[tuple[int, int]] = set()
        for key in keys:
            tracker.current = key.name()
            tracker.add(0, f"cell {key.name()}", True)
            before = tracker.done
            if reason is not None or live is None:
                cell = cellrun.failed_cell(config, key, reason or "target unavailable")
            else:
                group = (key.input_len, key.concurrency)
                if config.warmup and config.driver == "builtin" and group not in warmed:
                    cellrun.warm_up(config, key, pool, live)
                    warmed.add(group)

                def on_request(r: Any, name: str = key.name()) -> None:
                    tracker.add(1, name)

                cell = cellrun.run_cell(
                    config, key, pool, live, store.dir / "vllm-bench", on_request
                )
            store.append_cell(cell)
            # every cell moves progress by its planned requests, however it ended
            counted = tracker.done - before
            tracker.add(
                config.requests_in_cell(key.concurrency) - counted,
                f"{key.name()}: {cell.status}",
                True,
            )
    finally:
        if record is not None:
            targets.stop_server(record)


def _result(store: SweepStore, state: str) -> SweepResult:
    config = store.load_config()
    pieces = build_report(store)
    return SweepResult(sweep_id=config.sweep_id, out_dir=str(store.dir), state=state, **pieces)


# ---- the public functions ----------------------------------------------------------------------


def run_sweep(
    targets: list[dict[str, Any] | Target] | None = None,
    input_lens: list[int] | None = None,
    output_len: int = 128,
    concurrency: list[int] | None = None,
    repeats: int = 3,
    prompts_per_cell: int | None = None,
    seed: int = 0,
    driver: str = "builtin",
    out_dir: str | None = None,
    resume: str | None = None,
    wait: bool = True,
    progress: Progress | None = None,
    request_timeout_s: float = 600.0,
) -> SweepResult:
    """Measure every target on the same prompts over input lengths x concurrency x repeats.

    wait=False starts a detached worker and returns at once (state "running"); sweep_status
    follows it. resume=DIR continues a sweep from its files (the other arguments are ignored).
    """
    if resume:
        store = SweepStore(_find_dir(resume))
        store.load_config()
    else:
        if not targets:
            raise InvalidInputError("no targets", "give at least one {'label', 'base_url'} target")
        config = plan(
            targets,
            input_lens or [512, 4096],
            output_len,
            concurrency or [1, 4, 8, 16],
            repeats,
            prompts_per_cell,
            seed,
            driver,
            out_dir,
            request_timeout_s,
        )
        store = SweepStore(config.out_dir)
        store.save_config(config)
    if wait:
        return execute(store.dir, progress)
    pid = _spawn_worker(store)
    status = sweep_status(str(store.dir))
    status.worker_pid = pid
    config = store.load_config()
    return SweepResult(
        sweep_id=config.sweep_id, out_dir=str(store.dir), state="running", status=status
    )


def _spawn_worker(store: SweepStore) -> int:
    """A detached process (its own session) that runs the sweep; output to worker.log."""
    store.dir.mkdir(parents=True, exist_ok=True)
    with open(store.log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.sweep.run", str(store.dir)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    reap_when_done(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and store.runner_pid() is None and proc.returncode is None:
        time.sleep(0.05)
    return proc.pid


def _find_dir(ref: str) -> Path:
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
    store = SweepStore(_find_dir(sweep))
    config = store.load_config()
    cells = store.load_cells()
    keys = config.cell_keys()
    status = store.read_status()
    runner = store.runner_pid()
    per_req = [(c.duration_s, c.n_requests) for c in cells if c.completed > 0]
    sec_per_req = sum(d for d, _ in per_req) / max(1, sum(n for _, n in per_req))
    done_keys = {c.key() for c in cells}
    left = sum(config.requests_in_cell(k.concurrency) for k in keys if k not in done_keys)
    total = sum(config.requests_in_cell(k.concurrency) for k in keys)
    if len(done_keys) >= len(keys):
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
        cells_total=len(keys),
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


def sweep_report(sweep: str) -> SweepResult:
    """Rebuild REPORT.md, results.json, results.csv and the plots from a sweep's files."""
    store = SweepStore(_find_dir(sweep))
    return _result(store, sweep_status(str(store.dir)).state)


def _worker_main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if len(argv) != 1:
        sys.stderr.write("usage: python -m bench.sweep.run SWEEP_DIR\n")
        return 2

    def _terminate(signum: int, _frame: object) -> None:
        # unwind through the finally blocks: a server this sweep started gets stopped
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    result = execute(argv[0])
    sys.stderr.write(f"sweep done: {result.report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
