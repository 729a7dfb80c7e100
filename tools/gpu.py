"""verify_gpu_arch: can the serving interpreter actually run on this GPU?

Four parts, each in its own module, so the last two can be tested without a GPU:

1. tools/gpu_probe_run.py: `run_probe(python_bin)` runs tools/gpu_probe.py as a subprocess of the
   serving interpreter (by file path, since that Python may lack gpurig) -> a `ProbeRun`.
2. tools/gpu_nvml.py: `read_nvml()`, the driver's view from this process -> an `NvmlReport`.
3. tools/gpu_rules.py: `diagnose(probe, nvml)`, the list of diagnosis RULES, each a pure
   function over those two reports with a code and a remedy.
4. tools/gpu_report.py: `build_report`, the verdict, summary and vLLM flags -> `GpuArchReport`.

This module runs them (`verify_gpu_arch`) and is where callers import from: the MCP tool, the
CLI, doctor and the tests use `tools.gpu.verify_gpu_arch` and `tools.gpu.GpuArchReport`.

No NVML, no driver or no GPU is a verdict ("no NVIDIA GPU visible"), never an exception.
"""

from __future__ import annotations

import threading

from tools.errors import InvalidInputError, arg
from tools.gpu_facts import SEVERITY_ORDER
from tools.gpu_nvml import (
    NvmlGpu,
    NvmlReport,
    nvml_error_text,
    nvml_gpu_count,
    read_nvml,
    throttle_names,
)
from tools.gpu_probe_run import (
    DEFAULT_TIMEOUT_S,
    PROBE_SCRIPT,
    RESULT_MARKER,
    ProbeReport,
    ProbeRun,
    run_probe,
)
from tools.gpu_report import GpuArchReport, build_report
from tools.gpu_rules import diagnose
from tools.settings import resolve_python

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PROBE_SCRIPT",
    "RESULT_MARKER",
    "SEVERITY_ORDER",
    "GpuArchReport",
    "NvmlGpu",
    "NvmlReport",
    "ProbeReport",
    "ProbeRun",
    "nvml_error_text",
    "build_report",
    "diagnose",
    "nvml_gpu_count",
    "read_nvml",
    "resolve_python",
    "run_probe",
    "throttle_names",
    "verify_gpu_arch",
]


def verify_gpu_arch(
    python_bin: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> GpuArchReport:
    """Probe the serving interpreter (default GPURIG_PYTHON, else ours) and diagnose it."""
    if not timeout_s > 0:
        raise InvalidInputError(
            f"{arg('timeout_s')} must be positive, got {timeout_s}",
            remedy=f"pass e.g. 120 as {arg('timeout_s')}",
        )
    python = resolve_python(python_bin)
    nvml_box: dict[str, NvmlReport] = {}
    # NVML runs while the probe imports torch: the report costs one probe, not probe + NVML.
    nvml_thread = threading.Thread(
        target=lambda: nvml_box.setdefault("nvml", read_nvml()), daemon=True
    )
    nvml_thread.start()
    try:
        run = run_probe(python, timeout_s=timeout_s)
    finally:
        # Also when run_probe raises (python_bin is not a Python): a CLI that exits while this
        # daemon thread is still inside pynvml crashes the interpreter at shutdown (SIGSEGV).
        nvml_thread.join(10)
    nvml = nvml_box.get("nvml") or NvmlReport(available=False, error="NVML did not answer in 10 s")
    return build_report(python, run, nvml)
