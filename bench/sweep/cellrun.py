"""Running one cell against one live target, with either driver, under telemetry.

A cell never raises for a problem of the target: a server that is down, refuses the prompts or
dies mid-cell gives a CellRecord with status "failed" (or "partial") and the reasons, so the
sweep goes on with the others.

Around the measured requests: the target's prefix cache emptied first (bench/sweep/
cache_reset.py), NVML's energy counter read at both ends (bench/sweep/energy.py), stall probes
beside the load (bench/sweep/probes.py); after them, the warm-up requests left out of the
figures (bench/sweep/steady.py) and a rate cell's over-saturation check (saturation.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from bench.sweep import cellstats, driver_builtin, driver_vllm, saturation, slo, steady
from bench.sweep.arrivals import arrival_times, rate_of
from bench.sweep.cache_reset import reset_cache
from bench.sweep.energy import per_token
from bench.sweep.models import CellKey, CellRecord, RequestResult, SweepConfig
from bench.sweep.probes import PROBE_LEN, ProbePlan, probe_stats
from bench.sweep.prompts import MEASURED, WARMUP, load_tokenizer, prompt_seed, token_prompt
from bench.sweep.targets import Live, check_alive
from bench.sweep.telemetry import CellWatch
from bench.sweep.vocab import Codec, LocalCodec, ServerCodec
from bench.sweep.workload import Job, cell_jobs
from tools.errors import GpurigError
from tools.serving.state import now_iso
from tools.settings import serving_python

OnRequest = Callable[[RequestResult], None]
WARMUP_TOKENS = 8
ARRIVALS, ANSWER, PROBES = 5, 6, 7  # seed kinds: arrival schedule, stand-in answers, probes


def vllm_seed(seed: int, key: CellKey) -> int:
    """vllm bench serve's --seed for a cell: from (input length, repeat) and the concurrency,
    so its random dataset gives each concurrency level fresh prompts (no prefix-cache reuse)."""
    parts = [seed, key.input_len, key.repeat, key.concurrency]
    parts += [int(key.rate * 1000)] if key.rate is not None else []
    return int(np.random.SeedSequence(parts).generate_state(1)[0])


def failed_cell(config: SweepConfig, key: CellKey, reason: str) -> CellRecord:
    n = config.requests_in_cell(key.concurrency, key.rate)
    return CellRecord(
        **key.model_dump(),
        seed=prompt_seed(config.seed, key.input_len, key.repeat),
        driver=config.driver,
        status="failed",
        reason=reason,
        started_at=now_iso(),
        n_requests=n,
        failed=n,
        failure_reasons={reason: n},
    )


def prompt_codec(config: SweepConfig, live: Live) -> Codec | None:
    """The tokenizer text prompts are made exact with: the checkpoint's, else the server's."""
    if live.model_dir and (Path(live.model_dir) / "tokenizer.json").is_file():
        return LocalCodec(load_tokenizer(live.model_dir))
    if config.prompt_source == "server":
        return ServerCodec(live.root_url, live.model)
    return None


def jobs_of(
    config: SweepConfig, key: CellKey, pool: np.ndarray | None, live: Live, kind: int = MEASURED
) -> list[Job]:
    """The cell's jobs for this target: token ids, or text (exact where a tokenizer is known)."""
    target = next(t for t in config.targets if t.label == key.target)
    as_text = target.prompt_format == "text"
    needs_codec = (as_text and pool is not None) or bool(config.workload.dataset)
    codec = prompt_codec(config, live) if needs_codec else None
    return cell_jobs(config, key, pool, codec, as_text, kind)


def warm_up(config: SweepConfig, key: CellKey, pool: np.ndarray | None, live: Live) -> None:
    """Uncounted requests before a (target, input length, load) group's first cell:
    first-use costs (allocations, compiled shapes) stay out of the numbers."""
    jobs = jobs_of(config, key, pool, live, kind=WARMUP)
    for job in jobs:
        job.parts, job.output_len = job.parts[:1], min(job.output_len, WARMUP_TOKENS)
    driver_builtin.run_jobs(live.base_url, live.model, jobs, len(jobs), config.request_timeout_s)


def run_cell(
    config: SweepConfig,
    key: CellKey,
    pool: np.ndarray,
    live: Live,
    work_dir: Path,
    on_request: OnRequest | None = None,
) -> CellRecord:
    """Measure one cell; a dead or refusing target gives a failed cell, never an exception."""
    reason = check_alive(live.base_url)
    if reason is not None:
        return failed_cell(config, key, reason)
    reset = reset_cache(live.root_url) if config.cache_reset else None
    started = now_iso()
    with CellWatch(live.root_url, live.pid) as watch:
        if config.driver == "builtin":
            fields, reason = _builtin(config, key, pool, live, on_request)
        else:
            fields, reason = _vllm(config, key, live, work_dir)
    if fields is None:
        cell = failed_cell(config, key, reason or "failed")
        cell.telemetry, cell.cache_reset = watch.result, reset
        return cell
    per_token(watch.result.energy, fields["output_tokens"])
    status, why = cellstats.status_of(fields["completed"], fields["failed"])
    if status == "failed" and fields["failure_reasons"]:
        why = next(iter(fields["failure_reasons"]))
        if check_alive(live.base_url) is not None:
            why = f"target died during the cell: {why}"
    seed = (
        prompt_seed(config.seed, key.input_len, key.repeat)
        if config.driver == "builtin"
        else vllm_seed(config.seed, key)
    )
    counted, _ = steady.measured(fields["requests"])
    fields.update(slo.evaluate(counted, fields["duration_s"], config.slo))
    return CellRecord(
        **key.model_dump(),
        seed=seed,
        driver=config.driver,
        status=status,
        reason=why,
        started_at=started,
        telemetry=watch.result,
        cache_reset=reset,
        **fields,
    )


def _builtin(
    config: SweepConfig,
    key: CellKey,
    pool: np.ndarray,
    live: Live,
    on_request: OnRequest | None,
) -> tuple[dict | None, str | None]:
    try:
        jobs = jobs_of(config, key, pool, live)
    except (ValueError, OSError, httpx.HTTPError) as exc:
        return None, f"cannot make the prompts: {exc}"
    arrivals = None
    if key.rate is not None:
        seed_parts = [config.seed, key.input_len, key.repeat, ARRIVALS, int(key.rate * 1000)]
        arrivals = arrival_times(len(jobs), key.rate, config.burstiness, seed_parts)

    def stand_in(index: int, n: int) -> list[int]:
        if pool is None or n <= 0:
            return []
        return token_prompt(pool, config.seed, key.input_len, key.repeat, index, ANSWER, 0, n)

    probe, probed = _probe_plan(config, key, pool, jobs), []
    requests, duration = driver_builtin.run_jobs(
        live.base_url,
        live.model,
        jobs,
        key.concurrency,
        config.request_timeout_s,
        on_request,
        arrivals,
        stand_in,
        probe,
        probed,
    )
    for r in requests:
        if r.input_tokens <= 0:  # text prompts: the length the server (or the ask) gave them
            r.input_tokens = r.prompt_tokens or key.input_len
    excluded = steady.mark_warmup(requests, config.exclude_first, config.exclude_first_s)
    counted, window = steady.measured(requests)
    fields = cellstats.stats(counted, window or duration, config.output_len)
    if arrivals is not None:
        fields["scheduled_rate"] = rate_of(arrivals)
        fields["saturation"] = saturation.check(requests)
    if probe is not None:
        fields["stall_probes"] = probe_stats(probe.rate, probed)
    return {**fields, "requests": requests, "excluded": excluded}, None


def _probe_plan(
    config: SweepConfig, key: CellKey, pool: np.ndarray | None, jobs: list[Job]
) -> ProbePlan | None:
    """The cell's stall probes: seeded ids of PROBE_LEN tokens (text where the load is text)."""
    if not config.probe_rate:
        return None
    as_text = bool(jobs) and bool(jobs[0].parts) and isinstance(jobs[0].parts[0], str)

    def prompt(i: int) -> list[int] | str:
        if pool is None or as_text:
            return f"Probe {i} of repeat {key.repeat + 1}: answer with one word."
        return token_prompt(pool, config.seed, key.input_len, key.repeat, i, PROBES, 0, PROBE_LEN)

    rate = int(config.probe_rate * 1000)
    seed_parts = [config.seed, key.input_len, key.repeat, PROBES, rate]
    return ProbePlan(rate=config.probe_rate, prompt=prompt, seed_parts=seed_parts)


def _vllm(
    config: SweepConfig, key: CellKey, live: Live, work_dir: Path
) -> tuple[dict | None, str | None]:
    python_bin = live.python_bin or serving_python()
    rate = f"_rate{key.rate:g}" if key.rate is not None else ""
    name = f"{key.target}_in{key.input_len}_c{key.concurrency}{rate}_r{key.repeat + 1}.json"
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        launcher = driver_vllm.bench_launcher(python_bin)
    except GpurigError as exc:
        return None, f"{exc.message} ({exc.remedy})"
    cmd = driver_vllm.bench_command(
        python_bin,
        live.base_url,
        live.model,
        live.model_dir,
        key.input_len,
        config.output_len,
        config.requests_in_cell(key.concurrency, key.rate),
        key.concurrency,
        vllm_seed(config.seed, key),
        work_dir,
        name,
        key.target,
        num_warmups=min(key.concurrency or 4, 4) if config.warmup else 0,
        launcher=launcher,
        request_rate=key.rate,
        burstiness=config.burstiness,
        range_ratio=config.workload.range_ratio,
    )
    t0 = time.monotonic()
    saved, reason = driver_vllm.run_bench(cmd, work_dir / name, config.request_timeout_s * 4 + 60)
    if saved is None:
        return None, reason
    fields = driver_vllm.fields_of(saved, config.output_len)
    if not fields["duration_s"]:
        fields["duration_s"] = round(time.monotonic() - t0, 4)
    return fields, None
