"""verify_gpu_arch's report: the diagnoses, the verdict, a one-line summary and vLLM's flags.

`build_report` is pure (a probe run and NVML's view in, a `GpuArchReport` out), so tests replay
recorded probe runs through it without a GPU.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tools.gpu_facts import SEVERITY_ORDER, Diagnosis
from tools.gpu_nvml import NvmlReport
from tools.gpu_probe_run import ProbeReport, ProbeRun
from tools.gpu_rules import diagnose


class GpuArchReport(BaseModel):
    """verify_gpu_arch's answer: what the serving interpreter can run here, and what to fix."""

    verdict: Literal["ok", "warn", "fail"]
    summary: str = Field(description="one line for a person")
    python_bin: str
    probe: ProbeReport | None = None
    probe_seconds: float | None = None
    nvml: NvmlReport
    diagnoses: list[Diagnosis]
    serve_flags: list[str] = Field(
        default_factory=list, description="vLLM flags this GPU needs, e.g. --dtype float16"
    )


def verdict_of(diagnoses: list[Diagnosis]) -> Literal["ok", "warn", "fail"]:
    worst = max((SEVERITY_ORDER[d.severity] for d in diagnoses), default=0)
    return "fail" if worst >= 3 else "warn" if worst == 2 else "ok"


def serve_flags_for(probe: ProbeReport | None) -> list[str]:
    """vLLM flags this GPU needs: Turing and older have no bf16 and no fp8 KV cache."""
    if probe and probe.torch.devices and min(d.capability for d in probe.torch.devices) < (8, 0):
        return ["--dtype", "float16", "--kv-cache-dtype", "auto"]
    return []


# Short names for the one-line summary of a failing report.
SUMMARY_TITLES: dict[str, str] = {
    "probe_timeout": "the probe timed out",
    "probe_crashed": "the probe crashed",
    "no_gpu": "no NVIDIA GPU visible",
    "torch_missing": "torch is not installed",
    "cudnn_missing": "import torch fails on libcudnn.so.9",
    "torch_import_failed": "import torch fails",
    "torch_cpu_build": "a CPU build of torch",
    "cuda_init_failed": "CUDA initialisation fails",
    "cuda_unavailable": "torch cannot use the GPU",
    "arch_missing": "the GPU's capability is missing from torch's arch list",
    "fp16_matmul_wrong": "an fp16 matmul gives wrong results",
    "vllm_libcudart": "import vllm fails on libcudart",
    "vllm_import_failed": "import vllm fails",
    "torchvision_mismatch": "PyPI's CUDA torchvision beside a +cpu torch",
}


def summarize(probe: ProbeReport | None, diagnoses: list[Diagnosis]) -> str:
    fails = [d for d in diagnoses if d.severity == "fail"]
    if fails:
        return "; ".join(dict.fromkeys(SUMMARY_TITLES.get(d.code, d.code) for d in fails))
    v = probe.vllm if probe else None
    if v is not None and v.dist_version and v.build == "cpu" and not probe.torch.devices:
        return (
            f"vLLM {v.dist_version}, CPU build ({v.distribution}): serves on the CPU, no GPU needed"
        )
    if probe and probe.torch.devices:
        d0 = probe.torch.devices[0]
        warns = [d.code for d in diagnoses if d.severity == "warn"]
        tail = f" (needs: {', '.join(warns)})" if warns else ""
        return f"{d0.name} sm_{d0.capability[0]}{d0.capability[1]} ready{tail}"
    return "ok"


def build_report(python_bin: str, run: ProbeRun | None, nvml: NvmlReport) -> GpuArchReport:
    """Assemble the report from a probe run and NVML: pure, so tests replay recorded runs."""
    probe = run.report if run else None
    diagnoses = diagnose(
        probe,
        nvml,
        python_bin,
        timed_out=bool(run and run.timed_out),
        crashed=run.crashed if run else None,
        stderr_tail=run.stderr_tail if run else None,
    )
    return GpuArchReport(
        verdict=verdict_of(diagnoses),
        summary=summarize(probe, diagnoses),
        python_bin=python_bin,
        probe=probe,
        probe_seconds=run.seconds if run else None,
        nvml=nvml,
        diagnoses=diagnoses,
        serve_flags=serve_flags_for(probe),
    )
