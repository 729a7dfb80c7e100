"""The serving tools' pydantic models: what start_vllm_server takes (StartRequest, whose
ServerArgs bring_up shares) and what start/stop/status/logs/query/spot_check return.

Kept apart from the code so that the sweeps (issue 15), the MCP wrappers and the CLI import the
shapes without pulling in process handling. Field names are a public interface: keep them. The
request's fields are the one declaration of the start tool's arguments: the MCP tool's input
schema (mcp_server/request_params.py) and `gpurig serve start`'s flags
(mcp_server/request_flags.py) are generated from them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["vllm", "engine", "llamacpp"]
ServerState = Literal["starting", "ready", "dead", "stopped"]


class ServerArgs(BaseModel):
    """What start_vllm_server and bring_up both take: the model, the backend and the server's
    main settings. Declared once here so the two tools (and their flags) cannot drift apart."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a checkpoint directory or a hub id (org/name)")
    backend: Backend = "vllm"
    name: str | None = Field(
        None, min_length=1, max_length=64, description="the server's name; default BACKEND-PORT"
    )
    python_bin: str | None = Field(
        None,
        min_length=1,
        description="the interpreter that runs vLLM; default: GPURIG_PYTHON, else the server's",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    dtype: str = Field("auto", description="auto: float16 below capability 8")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs to split the model over")
    max_model_len: int | None = Field(None, ge=1, description="context length (engine: max_ctx)")
    max_num_seqs: int | None = Field(None, ge=1, description="most requests served together")
    device: str | None = Field(None, description="engine only: cuda, cuda:1 or cpu")
    cpu_kv_cache_gib: int | None = Field(
        None,
        ge=1,
        description="vLLM's CPU build only: its KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; "
        "default a quarter of free RAM, at most 8), checked against the RAM available",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="flags passed to the server as-is (checked against the installed vLLM's "
        "own flags)",
    )
    env: dict[str, str] = Field(default_factory=dict, description="variables for the server")
    timeout_s: float = Field(900, gt=0, le=7200, description="seconds to wait for ready")


class StartRequest(ServerArgs):
    """start_vllm_server's arguments: ServerArgs and the settings only a plain start takes."""

    kv_cache_dtype: str = "auto"
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM: pipeline stages")
    attention_backend: str | None = Field(None, description="e.g. TRITON_ATTN, FLEX_ATTENTION")
    wait: bool = Field(True, description="false: return once the process started (state starting)")
    server_bin: str | None = Field(
        None,
        description="llamacpp only: the llama-server binary (default: GPURIG_LLAMA_SERVER, "
        "gpurig's build from .ci/llama-cpp-build, or PATH)",
    )
    gpu_layers: int | None = Field(
        None, ge=0, description="llamacpp only: layers on the GPU (-ngl)"
    )


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
