"""MCP tool bring_up: a thin wrapper around tools.bring_up.bring_up, with the sweep step from
bench (bench.bring_up_sweep.short_sweep) and progress through the tool's context: every step's
start and end, the start's seconds and last log line, and each sweep request. Its arguments are
BringUpRequest's fields, flat (mcp_server/request_params.py)."""

from __future__ import annotations

import contextlib

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer

from bench.bring_up_sweep import short_sweep
from mcp_server.annotations import IDEMPOTENT_WRITE
from mcp_server.request_params import flat_arguments
from tools.bring_up import bring_up as run_bring_up
from tools.bring_up_models import BringUpReport, BringUpRequest


def register(mcp: MCPServer) -> None:
    @mcp.tool(annotations=IDEMPOTENT_WRITE)
    @flat_arguments(BringUpRequest)
    async def bring_up(ctx: Context, request: BringUpRequest) -> BringUpReport:
        """From a bare host to a served, checked (and optionally measured) model in one call,
        stopping at the first failure with its cause and the command that fixes it.

        Steps: inputs (model path, name, port) -> doctor (judged for the backend: the engine
        needs no GPU or vLLM) -> turing patch (below capability 8: verified, applied when vLLM is
        stock, verified again; apply_patch=false stops there instead) -> start_vllm_server ->
        spot_check (391, Canberra, Au plus `checks`; builtin_checks=false and no checks: skipped)
        -> a short sweep when sweep=true (sweep_input_len tokens, concurrency 1 and 4). Each step:
        status (ok, reused, skipped, failed), found, seconds, next. Idempotent: a running server
        of that name, backend, model and port is reused, a patched vLLM is not patched again. A
        server that fails its spot check is kept running (to look at with query_model); one
        this call started is stopped if the call itself breaks. Progress: every step."""

        def progress(done: float, total: float | None, message: str) -> None:
            with contextlib.suppress(Exception):  # a client that went away must not stop it
                anyio.from_thread.run(ctx.report_progress, done, total, message)

        return await anyio.to_thread.run_sync(
            lambda: run_bring_up(request, progress=progress, measure=short_sweep)
        )
