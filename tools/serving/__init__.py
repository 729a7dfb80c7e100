"""Serving lifecycle: start, stop, status, logs, query and spot-check LLM servers (vLLM, or
gpurig's engine), detached from the process that starts them. See lifecycle.py."""

from tools.serving.lifecycle import (
    get_server_logs,
    query_model,
    server_status,
    spot_check,
    start_vllm_server,
    stop_vllm_server,
)
from tools.serving.models import (
    Failure,
    LogsResult,
    QueryResult,
    ServerRecord,
    ServerStatus,
    SpotCheckResult,
    StartupFacts,
    StatusReport,
    StopResult,
)
from tools.serving.preflight import GpuDevice, GpuFacts

__all__ = [
    "Failure",
    "GpuDevice",
    "GpuFacts",
    "LogsResult",
    "QueryResult",
    "ServerRecord",
    "ServerStatus",
    "SpotCheckResult",
    "StartupFacts",
    "StatusReport",
    "StopResult",
    "get_server_logs",
    "query_model",
    "server_status",
    "spot_check",
    "start_vllm_server",
    "stop_vllm_server",
]
