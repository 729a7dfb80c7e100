"""run_sweep and sweep_report: the functions behind the MCP tools and the CLI (finding a sweep
and its status, read from its files, are in bench/sweep/lookup.py).

run_sweep writes the plan (sweep.json) first, then runs it: in this process (wait=True, with a
progress callback per request) or in a detached worker process (wait=False: `python -m
bench.sweep.run DIR`, its own session, so the caller, an MCP server or a CLI, may exit). Both run
`execute(dir)`, which is also what resume=DIR runs: cells already in cells.jsonl are skipped.
Targets run one after the other; a `server` target is started before its cells and stopped
after them. An interleaved sweep (running servers only) alternates targets cell by cell.
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

import numpy as np
from pydantic import ValidationError

from bench.sweep import cellrun, saturation, search, targets
from bench.sweep.cell_models import CellOptions
from bench.sweep.gate import Prober
from bench.sweep.lookup import (
    cell_requests,
    find_sweep_dir,
    planned_requests,
    sweep_status,
    sweeps_dir,
)
from bench.sweep.models import (
    CellKey,
    CellRecord,
    SweepConfig,
    SweepResult,
    Target,
)
from bench.sweep.prompts import common_pool, pool_ids
from bench.sweep.report import build_report
from bench.sweep.roofline_measure import measure_roofline
from bench.sweep.store import SweepStore
from bench.sweep.vocab import server_pool
from tools.errors import InvalidInputError
from tools.serving.process import reap_when_done

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
REPO = Path(__file__).resolve().parents[2]


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
    **load: Any,
) -> SweepConfig:
    """Validate the arguments and fix the prompt vocabulary: the plan a (resumed) sweep runs.
    `load`: request_rate, burstiness, max_concurrency, slo, search, workload (SweepConfig's)."""
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
            **{k: v for k, v in load.items() if v is not None},
        )
    except ValidationError as exc:
        raise _bad_input(exc) from None
    w = config.workload
    if config.driver == "vllm-bench" and (w.prefix_len or w.turns > 1 or w.dataset):
        raise InvalidInputError(
            "the vllm-bench driver runs vLLM's random dataset only (fixed or drawn lengths)",
            "use driver='builtin' for shared prefixes, multi-turn or a dataset file",
        )
    if w.dataset:
        config.input_lens = [0]  # one row: the file's own lengths
        config.prompt_source = "dataset"
        config.prompt_source_note = f"text prompts from {w.dataset}"
    elif config.driver == "builtin":
        _choose_vocabulary(config)
    return config


def _choose_vocabulary(config: SweepConfig) -> None:
    """Where the prompt ids come from (bench/sweep/vocab.py says why in this order)."""
    vocabs = [v for v in (targets.vocab_of(t, ask_server=False) for t in config.targets) if v]
    if vocabs:
        config.pool_size, config.pool_exclude = common_pool(vocabs)
        config.prompt_source = "checkpoint"
        config.prompt_source_note = "ids from " + ", ".join(v.source for v in vocabs)
        return
    urls = [t for t in config.targets if t.base_url]
    pools = {t.label: server_pool(t.base_url or "", t.model) for t in urls}
    found = {label: set(p) for label, p in pools.items() if p}
    if found:
        common = sorted(set.intersection(*found.values()))
        if common:
            config.pool_list = common
            config.prompt_source = "server"
            config.prompt_source_note = (
                f"{len(common)} ids the /tokenize of {', '.join(found)} gave a fixed corpus"
            )
            return
    vocabs = [v for v in (targets.vocab_of(t) for t in config.targets) if v]
    if vocabs:
        config.pool_size, config.pool_exclude = common_pool(vocabs)
        config.prompt_source = "hf-cache"
        config.prompt_source_note = "ids from " + ", ".join(v.source for v in vocabs)
        return
    config.prompt_source = "approximate-text"
    config.prompt_source_note = (
        "no target's tokenizer is known (no model_dir, no /tokenize, nothing in the Hugging "
        "Face cache): text prompts of about the asked length in tokens (seeded words); the "
        "server-counted prompt tokens are in each cell"
    )


def prompt_pool(config: SweepConfig) -> np.ndarray | None:
    """The ids prompts are drawn from; None for text-only sweeps."""
    if config.pool_list:
        return np.asarray(config.pool_list, dtype=np.int64)
    if config.pool_size:
        return pool_ids(config.pool_size, config.pool_exclude)
    return None


class _Tracker:
    """Counts requests for progress callbacks and keeps status.json current (at most twice a
    second, and at every cell boundary)."""

    def __init__(self, store: SweepStore, config: SweepConfig, progress: Progress | None) -> None:
        self.store, self.config, self.progress = store, config, progress
        self.total = planned_requests(config)
        self.done = 0
        self.current: str | None = None
        self.started = time.time()
        self._last = 0.0

    def add(self, n: int, message: str, force: bool = False) -> None:
        self.done += n
        self.total = max(self.total, self.done)
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
        cells = store.load_cells(repair=True)
        done = {c.key(): c for c in cells}
        tracker = _Tracker(store, config, progress)
        already = sum(cell_requests(config, k) for k in done)
        tracker.add(already, f"resumed: {len(done)} cells done" if done else "starting", True)
        if store.load_roofline() is None:
            store.save_roofline(measure_roofline(config))
        pool = prompt_pool(config)
        if config.interleave:
            _run_interleaved(store, config, pool, tracker, done)
        for target in [] if config.interleave else config.targets:  # target by target
            if config.search is None:
                keys = [k for k in config.cell_keys() if k.target == target.label and k not in done]
                if not keys:
                    continue
            else:
                keys = []
            _run_target(store, config, target, keys, pool, tracker, done)
        tracker.current = None
        store.write_status({"state": "done", "pid": os.getpid(), "updated": time.time()})
    return sweep_result(store, "done")


class _CellRunner:
    """Runs one target's cells (warm-up once per (input length, load)), appending each to the
    store; a target that is not available fails its cells with the reason."""

    def __init__(self, store, config, target, pool, tracker, live, reason) -> None:
        self.store, self.config, self.target = store, config, target
        self.pool, self.tracker, self.live, self.reason = pool, tracker, live, reason
        self.warmed: set[tuple[int, int, float | None]] = set()
        self.prober = Prober(config, live) if config.gate and live is not None else None

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()

    def run_grid(self, key: CellKey) -> CellRecord | None:
        """A grid cell, unless a lower rate of its axis stopped it (bench/sweep/saturation.py):
        then nothing is run or recorded, and progress moves past its requests."""
        stop = saturation.skipped_by(self.config, key, self.store.load_cells())
        if stop is None:
            return self.run(key)
        self.tracker.add(cell_requests(self.config, key), f"{key.name()}: skipped", True)
        return None

    def run(self, key: CellKey) -> CellRecord:
        config, tracker = self.config, self.tracker
        tracker.current = key.name()
        tracker.add(0, f"cell {key.name()}", True)
        before = tracker.done
        if self.reason is not None or self.live is None:
            cell = cellrun.failed_cell(config, key, self.reason or "target unavailable")
        else:
            group = (key.input_len, key.concurrency, key.rate)
            if config.warmup and config.driver == "builtin" and group not in self.warmed:
                cellrun.warm_up(config, key, self.pool, self.live)
                self.warmed.add(group)

            def on_request(r: Any, name: str = key.name()) -> None:
                tracker.add(1, name)

            cell = cellrun.run_cell(
                config, key, self.pool, self.live, self.store.dir / "vllm-bench", on_request
            )
        if self.prober is not None and cell.status != "failed":
            cell.probes = self.prober.answers()  # after the timed window: bench/sweep/gate.py
        self.store.append_cell(cell)
        # every cell moves progress by its planned requests, however it ended
        counted = tracker.done - before
        tracker.add(cell_requests(config, key) - counted, f"{key.name()}: {cell.status}", True)
        return cell


def _search_key(config: SweepConfig, label: str, n: int, level: float, r: int) -> CellKey:
    spec = config.search
    assert spec is not None
    if spec.axis == "rate":
        return CellKey(target=label, input_len=n, concurrency=config.max_concurrency or 0,
                       rate=level, repeat=r)  # fmt: skip
    return CellKey(target=label, input_len=n, concurrency=int(level), repeat=r)


def _run_search(runner: _CellRunner, done: dict[CellKey, CellRecord]) -> None:
    """The SLO search for one target, input length by input length (cells on disk reused)."""
    config, label = runner.config, runner.target.label
    spec = config.search
    assert spec is not None
    for n in config.input_lens:
        levels: dict[float, bool] = {}
        while (level := search.next_level(spec, levels)) is not None:
            cells = []
            for r in range(config.repeats):
                key = _search_key(config, label, n, level, r)
                cells.append(done[key] if key in done else runner.run(key))
            levels[level] = search.passed(cells)


def _run_target(
    store: SweepStore,
    config: SweepConfig,
    target: Target,
    keys: list[CellKey],
    pool: Any,
    tracker: _Tracker,
    done: dict[CellKey, CellRecord] | None = None,
) -> None:
    record, live, reason = _start(config, target, tracker)
    runner = None
    try:
        runner = _CellRunner(store, config, target, pool, tracker, live, reason)
        if config.search is not None:
            _run_search(runner, done or {})
        for key in keys:
            runner.run_grid(key)
    finally:
        if runner is not None:
            runner.close()
        if record is not None:
            targets.stop_server(record)


def _start(config: SweepConfig, target: Target, tracker: _Tracker) -> tuple[Any, Any, str | None]:
    """(the server record where the sweep starts it, the live target or None, why not)."""
    record, reason = None, None
    if target.server is not None:
        tracker.current = f"{target.label}: starting its server"
        tracker.add(0, tracker.current, True)
        record, reason = targets.start_server(target, config.sweep_id, config.cache_reset)
    live = None
    if reason is None:
        try:
            live = targets.resolve(target, record)
        except Exception:
            reason = targets.check_alive(record.base_url if record else target.base_url or "")
            reason = reason or "target did not answer /v1/models"
    return record, live, reason


def _run_interleaved(store, config, pool, tracker, done: dict[CellKey, CellRecord]) -> None:
    """ABAB: every target's cell before the next cell, on the same prompts (running servers
    only, bench/sweep/order.py), so slow drift of the machine falls on both sides of a pair."""
    runners: dict[str, _CellRunner] = {}
    try:
        for t in config.targets:
            _record, live, reason = _start(config, t, tracker)
            runners[t.label] = _CellRunner(store, config, t, pool, tracker, live, reason)
        for key in config.cell_keys():
            if key not in done:
                runners[key.target].run_grid(key)
    finally:
        for runner in runners.values():
            runner.close()


def sweep_result(store: SweepStore, state: str) -> SweepResult:
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
    request_rate: list[float] | None = None,
    burstiness: float | None = None,
    max_concurrency: int | None = None,
    slo: dict[str, float] | None = None,
    search: dict[str, Any] | None = None,
    workload: dict[str, Any] | None = None,
    gate: bool = True,
    reference: str | None = None,
    interleave: bool = False,
    **options: Any,
) -> SweepResult:
    """Measure every target on the same prompts over input lengths x load x repeats.

    Load: `concurrency` levels (closed loop) and `request_rate` levels (open loop, gamma
    arrivals of shape `burstiness`, capped at `max_concurrency`); `slo` adds goodput and a pass
    per cell; `search` ({axis, start, max}) replaces the grid by a search for the highest load
    meeting the SLO; `workload`: bench.sweep.models.Workload's fields. wait=False starts a
    detached worker and returns at once (state "running"); sweep_status follows it.
    resume=DIR continues a sweep from its files (the other arguments are ignored). `gate`:
    after each cell every target answers fixed probes greedily, compared in the report with the
    `reference` target's (default: the first); `interleave`: cells in ABAB order. `options`:
    what happens in and between cells, CellOptions' fields (bench/sweep/cell_models.py: cache
    reset, stall probes, warm-up exclusion, the rate axis's early stop).
    """
    unknown = sorted(set(options) - set(CellOptions.model_fields))
    if unknown:
        raise TypeError(f"run_sweep() got unexpected keyword arguments: {', '.join(unknown)}")
    if resume:
        store = SweepStore(find_sweep_dir(resume))
        store.load_config()
    else:
        if not targets:
            raise InvalidInputError("no targets", "give at least one {'label', 'base_url'} target")
        default_conc = [] if (request_rate or search) else [1, 4, 8, 16]
        config = plan(
            targets,
            input_lens or [512, 4096],
            output_len,
            concurrency if concurrency is not None else default_conc,
            repeats,
            prompts_per_cell,
            seed,
            driver,
            out_dir,
            request_timeout_s,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            slo=slo,
            search=search,
            workload=workload,
            gate=gate,
            reference=reference,
            interleave=interleave,
            **options,
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


def sweep_report(sweep: str) -> SweepResult:
    """Rebuild REPORT.md, results.json, results.csv and the plots from a sweep's files."""
    store = SweepStore(find_sweep_dir(sweep))
    return sweep_result(store, sweep_status(str(store.dir)).state)


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
