"""MCP tools for benchmark sweeps: thin wrappers around bench.sweep (run_sweep, sweep_status,
compare_sweeps).

run_sweep runs in a worker thread so the server keeps answering while it measures; with
wait=True every finished request becomes a progress notification (when the client asked for
them with a progress token), with wait=False it returns at once and sweep_status follows the
detached worker. run_sweep's arguments are SweepRequest's fields, flat
(mcp_server/request_params.py).
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import anyio
import anyio.from_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from bench.sweep import compare as sweep_compare
from bench.sweep import lookup as sweep_lookup
from bench.sweep import run as sweep_run
from bench.sweep.compare import CompareResult
from bench.sweep.models import SweepRequest, SweepResult, SweepStatus
from mcp_server.annotations import READ_ONLY
from mcp_server.request_params import flat_arguments

RUNS_SERVERS = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)


def register(mcp: MCPServer) -> None:
    @mcp.tool(annotations=RUNS_SERVERS)
    @flat_arguments(SweepRequest)
    async def run_sweep(ctx: Context, request: SweepRequest) -> SweepResult:
        """Benchmark servers side by side on identical prompts: a sweep over input lengths x
        load (concurrency, or request rate) x repeats, or an SLO search, with a report.

        Targets may be URLs alone: the prompt vocabulary then comes from the server's
        /tokenize and /detokenize, else the model's tokenizer in the Hugging Face cache, else
        text of an approximate length (the report says so).

        Every target gets the same prompt token ids (a seed per input length and repeat) of
        exactly the asked length, ignore_eos so each request makes output_len tokens, warm-up
        requests not counted. Per cell: output tok/s, per-stream tok/s (1000 / median TPOT),
        req/s, TTFT/TPOT/ITL/latency p50 and p99, failures with reasons; medians over repeats,
        repeat-to-repeat variation (flagged above 5%), the winner and its ratio. Also a
        roofline (bytes per decode token from the safetensors headers over the GPU's measured
        read bandwidth) and telemetry (NVML, the server's CPU, its /metrics). A target that is
        down or dies gets its cells failed with the reason; the others go on. Writes REPORT.md,
        results.json, results.csv and PNG plots to out_dir/plots (plots_dir in the result);
        each cell is saved as it finishes,
        so resume=<dir> continues a killed sweep. Takes minutes to hours: use wait=false for
        long sweeps.

        Between and in cells: the targets' prefix caches are reset before each cell
        (cache_reset), NVML energy per cell (J per output token, average W), stall probes
        beside the load (probe_rate), warm-up exclusion, an early stop of a rate axis that
        saturates, a correctness gate (greedy probe answers against a reference target after
        each cell; departures marked), and interleave for ABAB cell order.
        """

        def progress(done: int, total: int, message: str) -> None:
            # a no-op unless the client sent a progress token
            # a client that went away must not stop the sweep
            with contextlib.suppress(Exception):
                anyio.from_thread.run(ctx.report_progress, float(done), float(total), message)

        def work() -> SweepResult:
            return sweep_run.run_sweep(**request.arguments(), progress=progress)

        return await anyio.to_thread.run_sync(work)

    @mcp.tool(annotations=READ_ONLY)
    async def compare_sweeps(
        sweeps: Annotated[
            list[str],
            Field(min_length=2, description="sweep ids or directories; the first is the baseline"),
        ],
        out_dir: Annotated[
            str | None, Field(description="default: GPURIG_HOME/sweeps/compare-<time>")
        ] = None,
    ) -> CompareResult:
        """The same cells (target, input length, load) of two or more sweeps side by side:
        each sweep's mean and 95% interval over its repeats for output tok/s, TTFT and TPOT,
        the ratio to the first sweep, and `*` only where the intervals do not overlap. Writes
        COMPARE.md, compare.json and overlay plots."""
        return await anyio.to_thread.run_sync(lambda: sweep_compare.compare_sweeps(sweeps, out_dir))

    @mcp.tool(annotations=READ_ONLY)
    def sweep_status(
        sweep: Annotated[str, Field(min_length=1, description="a sweep's id or directory")],
    ) -> SweepStatus:
        """Where a sweep stands, read from its files: running / stopped / done, cells done of
        the total, the current cell, requests done, an estimate of the seconds left, and the
        report's path once written. A stopped sweep (its process gone) says how to resume it."""
        return sweep_lookup.sweep_status(sweep)
