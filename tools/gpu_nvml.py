"""The NVIDIA driver's view from the tool server's own process, through NVML (pynvml).

verify_gpu_arch reads it next to the probe: the probe says what torch in the serving interpreter
sees, NVML what the driver sees (its version, the highest CUDA it supports, clocks, power and
throttle reasons). No driver, no NVML library or no permission is an `NvmlReport` with
available=False and the reason, never an exception. Imports no torch: check_host_capacity uses
`nvml_gpu_count` and must answer in well under a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field


class NvmlGpu(BaseModel):
    index: int
    name: str | None = None
    capability: tuple[int, int] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    power_limit_w: float | None = None
    power_default_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    throttle_reasons: list[str] = Field(
        default_factory=list, description="active clock throttle reasons, e.g. sw_power_cap"
    )


class NvmlReport(BaseModel):
    """The NVIDIA driver's view from the tool server's own process."""

    available: bool = Field(description="NVML initialised: a driver is loaded")
    error: str | None = Field(None, description="why NVML is not available")
    driver_version: str | None = None
    cuda_driver_version: str | None = Field(None, description="highest CUDA the driver supports")
    gpus: list[NvmlGpu] = Field(default_factory=list)


# Bits of nvmlDeviceGetCurrentClocksThrottleReasons, named the way nvidia-smi names them.
_THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in _THROTTLE_BITS.items() if mask & bit]


def _nvml_call(fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML query; None when the GPU or driver does not support it."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml() -> NvmlReport:
    """Driver, clocks, power and memory of every GPU NVML sees; no driver -> available=False."""
    try:
        import pynvml
    except ImportError as exc:
        return NvmlReport(available=False, error=f"nvidia-ml-py is not installed: {exc}")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return NvmlReport(available=False, error=nvml_error_text(exc))
    try:
        cuda = _nvml_call(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        report = NvmlReport(
            available=True,
            driver_version=_text(_nvml_call(pynvml.nvmlSystemGetDriverVersion)),
            cuda_driver_version=f"{cuda // 1000}.{(cuda % 1000) // 10}" if cuda else None,
        )
        count = _nvml_call(pynvml.nvmlDeviceGetCount) or 0
        for index in range(count):
            handle = _nvml_call(pynvml.nvmlDeviceGetHandleByIndex, index)
            if handle is None:
                continue
            report.gpus.append(_nvml_gpu(pynvml, index, handle))
        return report
    finally:
        _nvml_call(pynvml.nvmlShutdown)


def _nvml_gpu(pynvml: Any, index: int, handle: Any) -> NvmlGpu:
    mem = _nvml_call(pynvml.nvmlDeviceGetMemoryInfo, handle)
    cap = _nvml_call(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    limit = _nvml_call(pynvml.nvmlDeviceGetPowerManagementLimit, handle)
    default = _nvml_call(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
    reasons = _nvml_call(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    return NvmlGpu(
        index=index,
        name=_text(_nvml_call(pynvml.nvmlDeviceGetName, handle)),
        capability=tuple(cap) if cap else None,
        memory_total_bytes=int(mem.total) if mem else None,
        memory_used_bytes=int(mem.used) if mem else None,
        power_limit_w=limit / 1000 if limit else None,
        power_default_limit_w=default / 1000 if default else None,
        sm_clock_mhz=_nvml_call(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
        sm_clock_max_mhz=_nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
        throttle_reasons=throttle_names(int(reasons)) if reasons else [],
    )


def nvml_error_text(exc: Exception) -> str:
    """A person's words for an NVML failure (no driver, driver not loaded, no permission, ...)."""
    name = type(exc).__name__
    if "LibraryNotFound" in name:
        return "no NVIDIA driver: libnvidia-ml.so (NVML) not found"
    if "DriverNotLoaded" in name:
        return "the NVIDIA kernel driver is not loaded"
    if "NoPermission" in name:
        return "no permission to talk to the NVIDIA driver"
    return f"NVML failed: {name}: {exc}"


# the old private name, still imported by bench/sweep/telemetry.py (to be removed with it: the
# architecture test allow-lists that import)


def nvml_gpu_count(timeout_s: float = 0.5) -> int | None:
    """How many GPUs NVML sees, or None when NVML is absent or does not answer in `timeout_s`.

    A wedged driver can make nvmlInit hang; a daemon thread keeps callers (check_host_capacity
    must answer in well under a second) from waiting on it.
    """
    box: dict[str, int | None] = {}

    def work() -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                box["count"] = int(pynvml.nvmlDeviceGetCount())
            finally:
                pynvml.nvmlShutdown()
        except Exception:
            box["count"] = None

    thread = threading.Thread(target=work, name="nvml-count", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box.get("count")
