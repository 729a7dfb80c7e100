"""MCP tools for benchmark sweeps: thin wrappers around bench.sweep (run_sweep, sweep_status).

run_sweep runs in a worker thread so the server keeps answering while it measures; with
wait=True every finished request becomes a progress notification (when the client asked for
them with a progress token), with wait=False it returns at once and sweep_status follows the
detached worker.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, Literal

import anyio
import anyio.from_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from bench.sweep import run as sweep_run
from bench.sweep.models import SweepResult, SweepStatus
from mcp_server.annotations import READ_ONLY

RUNS_SERVERS = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)


def register(mcp: MCPServer) -> None:
    @mcp.tool(annotations=RUNS_SERVERS)
    async def run_sweep(
        ctx: Context,
        targets: Annotated[
            list[dict[str, Any]] | None,
            Field(
                description="servers to compare, each {'label', 'base_url'} (a running "
                "OpenAI-compatible server, base_url ending in /v1) or {'label', 'server': "
                "{start_vllm_server arguments}} (started and stopped by the sweep, one at a "
                "time); optional 'model_dir' (local checkpoint: tokenizer and roofline), "
                "'model', 'prompt_format' ('token_ids' or 'text'), 'python_bin'"
            ),
        ] = None,
        input_lens: Annotated[list[int] | None, Field(description="default [512, 4096]")] = None,
        output_len: Annotated[int, Field(ge=2, le=65536)] = 128,
        concurrency: Annotated[list[int] | None, Field(description="default [1, 4, 8, 16]")] = None,
        repeats: Annotated[int, Field(ge=1, le=50)] = 3,
        prompts_per_cell: Annotated[
            int | None,
            Field(ge=1, description="requests per cell; default max(8, 4 x concurrency)"),
        ] = None,
        seed: Annotated[int, Field(ge=0, lt=2**32)] = 0,
        driver: Literal["builtin", "vllm-bench"] = "builtin",
        out_dir: Annotated[
            str | None, Field(description="default: GPURIG_HOME/sweeps/<sweep id>")
        ] = None,
        resume: Annotated[
            str | None, Field(description="a sweep's directory or id to continue")
        ] = None,
        wait: Annotated[
            bool, Field(description="false: return at once; follow with sweep_status")
        ] = True,
    ) -> SweepResult:
        """Benchmark servers side by side on identical prompts: a sweep over input lengths x
        concurrency x repeats, with a report.

        Every target gets the same prompt token ids (a seed per input length and repeat) of
        exactly the asked length, ignore_eos so each request makes output_len tokens, warm-up
        requests not counted. Per cell: output tok/s, per-stream tok/s (1000 / median TPOT),
        req/s, TTFT/TPOT/ITL/latency p50 and p99, failures with reasons; medians over repeats,
        repeat-to-repeat variation (flagged above 5%), the winner and its ratio. Also a
        roofline (bytes per decode token from the safetensors headers over the GPU's measured
        read bandwidth) and telemetry (NVML, the server's CPU, its /metrics). A target that is
        down or dies gets its cells failed with the reason; the others go on. Writes REPORT.md,
        results.json, results.csv and PNG plots to out_dir; each cell is saved as it finishes,
        so resume=<dir> continues a killed sweep. Takes minutes to hours: use wait=false for
        long sweeps.
        """

        def progress(done: int, total: int, message: str) -> None:
            # a no-op unless the client sent a progress token
            # a client that went away must not stop the sweep
            with contextlib.suppress(Exception):
                anyio.from_thread.run(ctx.report_progress, float(done), float(total), message)

        def work() -> SweepResult:
            return sweep_run.run_sweep(
                targets=targets,
                input_lens=input_lens,
                output_len=output_len,
                concurrency=concurrency,
                repeats=repeats,
                prompts_per_cell=prompts_per_cell,
                seed=seed,
                driver=driver,
                out_dir=out_dir,
                resume=resume,
                wait=wait,
                progress=progress,
            )

        return await anyio.to_thread.run_sync(work)

    @mcp.tool(annotations=READ_ONLY)
    def sweep_status(
        sweep: Annotated[str, Field(min_length=1, description="a sweep's id or directory")],
    ) -> SweepStatus:
        """Where a sweep stands, read from its files: running / stopped / done, cells done of
        the total, the current cell, requests done, an estimate of the seconds left, and the
        report's path once written. A stopped sweep (its process gone) says how to resume it."""
        return sweep_run.sweep_status(sweep)
