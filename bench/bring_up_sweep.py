"""bring_up's sweep step: a short sweep against the server it brought up, summed up.

Here and not in tools/bring_up.py because tools may not import bench (bench imports tools); the
front doors hand `short_sweep` to tools.bring_up.bring_up as its `measure`.

Short means a first look, not a benchmark: one input length, concurrency 1 and 4, one repeat
(no interval; `gpurig sweep run` for repeats and more loads). The files are a normal sweep's
(REPORT.md, results.json) under GPURIG_HOME/sweeps/, so compare_sweeps can read them later.
"""

from __future__ import annotations

import os

from bench.sweep.models import SweepResult
from bench.sweep.run import run_sweep
from tools.bring_up import SweepProgress
from tools.bring_up_models import BringUpRequest, SweepCell, SweepSummary
from tools.serving.models import ServerRecord

CONCURRENCY = [1, 4]


def summarize(result: SweepResult) -> SweepSummary:
    """The sweep's main figures per cell, in bring_up's words."""
    cells = [
        SweepCell(
            input_len=row.input_len,
            concurrency=row.concurrency,
            status=cell.status,
            output_tok_s=cell.output_tok_s,
            per_stream_tok_s=cell.per_stream_tok_s,
            ttft_p50_ms=cell.ttft_p50_ms,
            tpot_p50_ms=cell.tpot_p50_ms,
            reason=cell.reason,
        )
        for row in result.summary
        for cell in row.targets
    ]
    return SweepSummary(
        sweep_id=result.sweep_id,
        out_dir=result.out_dir,
        report=result.report,
        cells=cells,
        failures=list(result.failures),
    )


def short_sweep(
    record: ServerRecord, request: BringUpRequest, progress: SweepProgress | None = None
) -> SweepSummary:
    """Measure the running server at one input length, concurrency 1 and 4, one repeat."""
    target = {
        "label": record.name,
        "base_url": record.base_url,
        "model": record.served_model_name,
        "model_dir": os.path.abspath(record.model) if os.path.isdir(record.model) else None,
        "python_bin": record.python if record.backend == "vllm" else None,
    }
    result = run_sweep(
        targets=[target],
        input_lens=[request.sweep_input_len],
        output_len=request.sweep_output_len,
        concurrency=CONCURRENCY,
        repeats=1,
        prompts_per_cell=request.sweep_prompts,
        progress=progress,
    )
    return summarize(result)
