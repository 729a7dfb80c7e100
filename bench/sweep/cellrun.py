"""Running one cell against one live target, with either driver, under telemetry.

A cell never raises for a problem of the target: a server that is down, refuses the prompts or
dies mid-cell gives a CellRecord with status "failed" (or "partial") and the reasons, so the
sweep goes on with the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.sweep import cellstats, driver_builtin, driver_vllm
from bench.sweep.models import CellKey, CellRecord, RequestResult, SweepConfig
from bench.sweep.prompts import (
    WARMUP,
    load_tokenizer,
    prompt_seed,
    slice_start,
    text_prompt,
    token_prompts,
)
from bench.sweep.targets import Live, check_alive
from bench.sweep.telemetry import CellWatch
from tools.errors import GpurigError
from tools.serving.state import now_iso
from tools.settings import serving_python

OnRequest = Callable[[RequestResult], None]
WARMUP_TOKENS = 8


def vllm_seed(seed: int, key: CellKey) -> int:
    """vllm bench serve's --seed for a cell: from (input length, repeat) and the concurrency,
    so its random dataset gives each concurrency level fresh prompts (no prefix-cache reuse)."""
    return int(
        np.random.SeedSequence([seed, key.input_len, key.repeat, key.concurrency]).generate_state(
            1
        )[0]
    )


def failed_cell(config: SweepConfig, key: CellKey, reason: str) -> CellRecord:
    n = config.requests_in_cell(key.concurrency)
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


def cell_prompts(
    config: SweepConfig, key: CellKey, pool: np.ndarray, live: Live, kind: int = 0
) -> list[tuple[int, list[int] | str]]:
    """The cell's (index, prompt) pairs: token ids, or text of exactly input_len tokens."""
    per_cell = [config.requests_in_cell(c) for c in config.concurrency]
    if kind == WARMUP:
        start, count = 0, min(key.concurrency, 4)
    else:
        start = slice_start(config.concurrency, key.concurrency, per_cell)
        count = config.requests_in_cell(key.concurrency)
    ids = token_prompts(pool, config.seed, key.input_len, key.repeat, start, count, kind)
    target = next(t for t in config.targets if t.label == key.target)
    if target.prompt_format == "token_ids":
        return list(zip(range(start, start + count), ids, strict=True))
    if not live.model_dir:
        raise ValueError(
            "text prompts need the model's tokenizer: give the target a model_dir with "
            "tokenizer.json"
        )
    tok = load_tokenizer(live.model_dir)
    texts = [text_prompt(tok, p, key.input_len) for p in ids]
    return list(zip(range(start, start + count), texts, strict=True))


def warm_up(config: SweepConfig, key: CellKey, pool: np.ndarray, live: Live) -> None:
    """Uncounted requests before a (target, input length, concurrency) group's first cell:
    first-use costs (allocations, compiled shapes) stay out of the numbers."""
    prompts = cell_prompts(config, key, pool, live, kind=WARMUP)
    driver_builtin.run_requests(
        live.base_url,
        live.model,
        prompts,
        min(config.output_len, WARMUP_TOKENS),
        len(prompts),
        config.request_timeout_s,
    )


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
    started = now_iso()
    with CellWatch(live.root_url, live.pid) as watch:
        if config.driver == "builtin":
            fields, reason = _builtin(config, key, pool, live, on_request)
        else:
            fields, reason = _vllm(config, key, live, work_dir)
    if fields is None:
        cell = failed_cell(config, key, reason or "failed")
        cell.telemetry = watch.result
        return cell
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
    return CellRecord(
        **key.model_dump(),
        seed=seed,
        driver=config.driver,
        status=status,
        reason=why,
        started_at=started,
        telemetry=watch.result,
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
        prompts = cell_prompts(config, key, pool, live)
    except (ValueError, OSError) as exc:
        return None, f"cannot make the prompts: {exc}"
    requests, duration = driver_builtin.run_requests(
        live.base_url,
        live.model,
        prompts,
        config.output_len,
        key.concurrency,
        config.request_timeout_s,
        on_request,
    )
    for r in requests:
        if r.input_tokens <= 0:  # text prompts: the length the tokenizer gave them
            r.input_tokens = key.input_len
    return {**cellstats.stats(requests, duration, config.output_len), "requests": requests}, None


def _vllm(
    config: SweepConfig, key: CellKey, live: Live, work_dir: Path
) -> tuple[dict | None, str | None]:
    python_bin = live.python_bin or serving_python()
    name = f"{key.target}_in{key.input_len}_c{key.concurrency}_r{key.repeat + 1}.json"
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
        config.requests_in_cell(key.concurrency),
        key.concurrency,
        vllm_seed(config.seed, key),
        work_dir,
        name,
        key.target,
        num_warmups=min(key.concurrency, 4) if config.warmup else 0,
        launcher=launcher,
    )
    t0 = time.monotonic()
    saved, reason = driver_vllm.run_bench(cmd, work_dir / name, config.request_timeout_s * 4 + 60)
    if saved is None:
        return None, reason
    fields = driver_vllm.fields_of(saved, config.output_len)
    if not fields["duration_s"]:
        fields["duration_s"] = round(time.monotonic() - t0, 4)
    return fields, None
