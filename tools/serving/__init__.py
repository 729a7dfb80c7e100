"""Serving lifecycle: start, stop, status, logs, query and spot-check LLM servers (vLLM, or
gpurig's engine), detached from the process that starts them. See lifecycle.py.

The lifecycle functions are imported on first use: `gpurig`'s parser builds its flags from
tools/serving/models.py, and every `gpurig` start would otherwise pay for the HTTP client."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from tools.serving.lifecycle import (
        get_server_logs,
        query_model,
        server_status,
        spot_check,
        start_vllm_server,
        stop_vllm_server,
    )

_LIFECYCLE = (
    "get_server_logs",
    "query_model",
    "server_status",
    "spot_check",
    "start_vllm_server",
    "stop_vllm_server",
)


def __getattr__(name: str) -> Any:
    if name in _LIFECYCLE:
        from tools.serving import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
