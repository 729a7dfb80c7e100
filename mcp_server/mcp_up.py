"""MCP tool bring_up: a thin wrapper around tools.bring_up.bring_up, with the sweep step from
bench (bench.bring_up_sweep.short_sweep) and progress through the tool's context: every step's
start and end, the start's seconds and last log line, and each sweep request."""

from __future__ import annotations

import contextlib
from typing import Annotated, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from pydantic import Field

from bench.bring_up_sweep import short_sweep
from mcp_server.annotations import IDEMPOTENT_WRITE
from mcp_server.mcp_host import PythonBin
from tools.bring_up import bring_up as run_bring_up
from tools.bring_up_models import BringUpReport, BringUpRequest, SpotCheckSpec


def register(mcp: MCPServer) -> None:
    @mcp.tool(annotations=IDEMPOTENT_WRITE)
    async def bring_up(
        model: Annotated[
            str, Field(min_length=1, description="a checkpoint directory or a hub id (org/name)")
        ],
        ctx: Context,
        backend: Literal["vllm", "engine", "llamacpp"] = "vllm",
        name: Annotated[
            str | None, Field(min_length=1, max_length=64, description="default BACKEND-PORT")
        ] = None,
        python_bin: PythonBin = None,
        host: str = "127.0.0.1",
        port: Annotated[int, Field(ge=1, le=65535)] = 8000,
        dtype: str = "auto",
        gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9,
        tensor_parallel_size: Annotated[int, Field(ge=1)] = 1,
        max_model_len: Annotated[int | None, Field(ge=1)] = None,
        max_num_seqs: Annotated[int | None, Field(ge=1)] = None,
        device: Annotated[str | None, Field(description="engine only: cuda, cuda:1 or cpu")] = None,
        cpu_kv_cache_gib: Annotated[
            int | None, Field(ge=1, description="vLLM's CPU build only: its KV cache in GiB")
        ] = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: Annotated[float, Field(gt=0, le=7200)] = 900,
        apply_patch: Annotated[
            bool, Field(description="false: stop at an unpatched vLLM below capability 8")
        ] = True,
        checks: Annotated[
            list[SpotCheckSpec] | None, Field(description="more {prompt, expect} spot checks")
        ] = None,
        builtin_checks: bool = True,
        sweep: Annotated[
            bool, Field(description="end with a short sweep (concurrency 1 and 4, one repeat)")
        ] = False,
        sweep_input_len: Annotated[int, Field(ge=1, le=131072)] = 512,
        sweep_output_len: Annotated[int, Field(ge=2, le=8192)] = 64,
        sweep_prompts: Annotated[
            int, Field(ge=1, le=256, description="requests per concurrency level")
        ] = 8,
    ) -> BringUpReport:
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

        request = BringUpRequest(
            model=model, backend=backend, name=name, python_bin=python_bin, host=host,
            port=port, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, device=device,
            cpu_kv_cache_gib=cpu_kv_cache_gib, extra_args=extra_args or [], env=env or {},
            timeout_s=timeout_s, apply_patch=apply_patch, checks=checks or [],
            builtin_checks=builtin_checks, sweep=sweep, sweep_input_len=sweep_input_len,
            sweep_output_len=sweep_output_len, sweep_prompts=sweep_prompts,
        )  # fmt: skip
        return await anyio.to_thread.run_sync(
            lambda: run_bring_up(request, progress=progress, measure=short_sweep)
        )
