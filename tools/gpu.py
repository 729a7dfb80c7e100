"""verify_gpu_arch: can the serving interpreter actually run on this GPU?

Three parts, kept apart so the last one can be tested without a GPU:

1. `run_probe(python_bin)`: tools/gpu_probe.py runs as a subprocess of the serving interpreter
   (by file path, since that Python may lack gpurig) and returns a `ProbeReport`.
2. `read_nvml()`: the driver's view from this process through pynvml, as an `NvmlReport`.
3. `diagnose(probe, nvml)`: a PURE function from those two reports to `Diagnosis` entries, each
   with a remedy. The failure modes it knows come from real installs (docs/vllm.md, the seeds):
   a `+cpu` torch under a CUDA vLLM, the GPU's capability missing from torch's arch list,
   `libcudnn.so.9` missing after `pip install --no-deps torch`, `import vllm` failing on
   libcudart, and Turing (sm_7x): no bf16 -> `--dtype float16`, 64 KiB of shared memory per
   block -> the Turing patch for Gemma 4's 512-wide attention.

No NVML, no driver or no GPU is a verdict ("no NVIDIA GPU visible"), never an exception.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.errors import InvalidInputError, arg, either
from tools.settings import resolve_python

log = logging.getLogger(__name__)

PROBE_SCRIPT = Path(__file__).with_name("gpu_probe.py")
START_MARKER = "GPURIG_PROBE_START "
RESULT_MARKER = "GPURIG_PROBE_RESULT "
DEFAULT_TIMEOUT_S = 120.0

# Shared memory one block of vLLM's Triton unified attention asks for at Gemma 4's head size 512
# (fp16, BLOCK_M 16, tile 32): (16 + 2*32) * 512 * 2 = 81,920 B; 98,304 B is also seen.
# A GPU whose opt-in limit is below this needs the Turing clamp (docs/vllm.md).
GEMMA4_ATTENTION_SMEM_BYTES = 81_920
TURING_PATCH_HINT = (
    "apply the Turing patch to the serving interpreter's vLLM ("
    + either(cli="`gpurig patch apply`", mcp="the apply_turing_patch tool")
    + "), and check it with "
    + either(cli="`gpurig patch verify`", mcp="verify_turing_patch")
    + " after every vLLM reinstall"
)

Severity = Literal["ok", "info", "warn", "fail"]
SEVERITY_ORDER: dict[str, int] = {"ok": 0, "info": 1, "warn": 2, "fail": 3}


# ---------------------------------------------------------------------------------------------
# The probe's JSON, as models (field names mirror tools/gpu_probe.py)


class _Probe(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ProbePython(_Probe):
    version: str
    executable: str
    implementation: str | None = None
    prefix: str | None = None
    user_base: str | None = Field(None, description="PYTHONUSERBASE in the probe's environment")


class ProbeDevice(_Probe):
    index: int
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    shared_memory_per_block_optin: int | None = None
    multi_processor_count: int | None = None
    bf16_supported: bool | None = None


class ProbeMatmul(_Probe):
    ok: bool
    max_abs_err: float | None = None
    error: str | None = None


class ProbeTorch(_Probe):
    dist_version: str | None = Field(None, description="from package metadata, without import")
    location: str | None = None
    imported: bool = False
    import_error: str | None = None
    version: str | None = None
    cuda: str | None = Field(None, description="torch.version.cuda; None for a CPU build")
    cuda_available: bool = False
    cuda_error: str | None = None
    device_count: int = 0
    arch_list: list[str] = Field(default_factory=list)
    devices: list[ProbeDevice] = Field(default_factory=list)
    fp16_matmul: ProbeMatmul | None = None


class ProbeVllm(_Probe):
    dist_version: str | None = Field(None, description="from package metadata, without import")
    location: str | None = None
    torch_requirement: str | None = Field(None, description="the torch vLLM pins, e.g. ==2.13.0")
    import_attempted: bool = False
    import_ok: bool | None = None
    import_seconds: float | None = None
    import_timed_out: bool = False
    import_error: str | None = None
    import_error_tail: str | None = None


class ProbeReport(_Probe):
    """What the serving interpreter reported about itself (tools/gpu_probe.py)."""

    probe_version: int
    python: ProbePython
    torch: ProbeTorch
    triton_version: str | None = None
    vllm: ProbeVllm
    seconds: float | None = None


# ---------------------------------------------------------------------------------------------
# NVML


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
        return NvmlReport(available=False, error=_nvml_error_text(exc))
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


def _nvml_error_text(exc: Exception) -> str:
    name = type(exc).__name__
    if "LibraryNotFound" in name:
        return "no NVIDIA driver: libnvidia-ml.so (NVML) not found"
    if "DriverNotLoaded" in name:
        return "the NVIDIA kernel driver is not loaded"
    if "NoPermission" in name:
        return "no permission to talk to the NVIDIA driver"
    return f"NVML failed: {name}: {exc}"


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


# ---------------------------------------------------------------------------------------------
# Running the probe


class ProbeRun(BaseModel):
    """How the probe subprocess went: the report, or why there is none."""

    report: ProbeReport | None = None
    seconds: float
    timed_out: bool = False
    crashed: str | None = Field(None, description="the probe started but died without a report")
    stderr_tail: str | None = None


def run_probe(
    python_bin: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    vllm_import_timeout_s: float | None = None,
) -> ProbeRun:
    """Run tools/gpu_probe.py under `python_bin` (already resolved) and parse its report."""
    if vllm_import_timeout_s is None:
        vllm_import_timeout_s = max(1.0, timeout_s * 0.75)
    cmd = [python_bin, str(PROBE_SCRIPT), "--vllm-import-timeout", str(vllm_import_timeout_s)]
    started = time.monotonic()
    try:
        # Own session: on timeout we kill the probe and its `import vllm` child, nothing else.
        # cwd "/": the `python -c "import vllm"` child puts its cwd on sys.path, and gpurig run
        # inside a vLLM source checkout must not test the checkout instead of the install.
        proc = subprocess.Popen(
            cmd,
            cwd="/",
            # no script dir or cwd on sys.path (3.11+); env and user site kept: gpu_probe.py
            env={**os.environ, "PYTHONSAFEPATH": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        raise InvalidInputError(
            f"{python_bin} cannot be run as a program: {exc.strerror or exc}",
            remedy="pass the path of a Python interpreter (e.g. /usr/bin/python3.13)",
        ) from exc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have exited just now
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return ProbeRun(
            seconds=round(time.monotonic() - started, 3),
            timed_out=True,
            stderr_tail=(err or "")[-2000:] or None,
        )
    seconds = round(time.monotonic() - started, 3)
    started_line = _marked(out, START_MARKER)
    result_line = _marked(out, RESULT_MARKER)
    if result_line is not None:
        return ProbeRun(report=ProbeReport.model_validate(result_line), seconds=seconds)
    if started_line is None:
        hint = (err or out or "").strip().splitlines()
        raise InvalidInputError(
            f"{python_bin} did not run the probe: not a Python 3.8+ interpreter"
            + (f" ({hint[-1][:200]})" if hint else ""),
            remedy="pass the path of the Python that runs vLLM (e.g. /usr/bin/python3.13)",
        )
    return ProbeRun(
        seconds=seconds,
        crashed=f"exit status {proc.returncode}" + _signal_name(proc.returncode),
        stderr_tail=(err or "")[-2000:] or None,
    )


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f" (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            return ""
    return ""


def _marked(stdout: str, marker: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            try:
                return json.loads(line[len(marker) :])
            except json.JSONDecodeError:
                return None
    return None


# ---------------------------------------------------------------------------------------------
# Diagnosis: pure functions over (probe, nvml)


Component = Literal["probe", "driver", "gpu", "torch", "vllm"]


class Diagnosis(BaseModel):
    code: str = Field(description="stable identifier, e.g. torch_cpu_build, turing_shared_memory")
    component: Component
    severity: Severity
    message: str
    remedy: str | None = None


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


def torch_index_url(cuda_driver_version: str | None) -> str:
    """The PyTorch wheel index whose CUDA this driver can run (newest first).

    CUDA's minor-version compatibility lets any 12.x driver run the cu126 wheels; cu128 and
    cu130 need drivers that report 12.8 and 13.0. Unknown driver: the newest index.
    """
    driver = _version_tuple(cuda_driver_version) if cuda_driver_version else (13, 0)
    for cuda, tag in (((13, 0), "cu130"), ((12, 8), "cu128"), ((12, 0), "cu126")):
        if driver >= cuda:
            return f"https://download.pytorch.org/whl/{tag}"
    return "https://download.pytorch.org/whl/cu118"


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _arch_covers(arch_list: list[str], major: int, minor: int) -> tuple[bool, bool]:
    """(native SASS for sm_XY present, PTX that can JIT to it present)."""
    want = major * 10 + minor
    native = f"sm_{want}" in arch_list
    ptx = any(
        a.startswith("compute_") and a[8:].isdigit() and int(a[8:]) <= want for a in arch_list
    )
    return native, ptx


def diagnose(
    probe: ProbeReport | None,
    nvml: NvmlReport,
    python_bin: str = "python3",
    *,
    timed_out: bool = False,
    crashed: str | None = None,
    stderr_tail: str | None = None,
) -> list[Diagnosis]:
    """Everything wrong (or notable) about this interpreter on this GPU, each with a remedy.

    Pure: depends only on its arguments, so recorded probe reports replay real failures.
    """
    out: list[Diagnosis] = []
    add = out.append
    py = python_bin
    index_url = torch_index_url(nvml.cuda_driver_version)

    if timed_out:
        add(
            Diagnosis(
                code="probe_timeout",
                component="probe",
                severity="fail",
                message=f"the probe under {py} did not finish in time (a hung CUDA init or import)",
                remedy=f"run `{py} -c 'import torch; print(torch.cuda.is_available())'` by hand "
                "to see where it hangs; check `nvidia-smi` answers",
            )
        )
    if crashed:
        tail = (stderr_tail or "").strip().splitlines()
        add(
            Diagnosis(
                code="probe_crashed",
                component="probe",
                severity="fail",
                message=f"the probe under {py} died ({crashed})"
                + (f": {tail[-1][:300]}" if tail else ""),
                remedy=f"run `{py} -c 'import torch'` by hand; reinstall torch if it crashes",
            )
        )

    # The driver's view.
    gpus = nvml.gpus
    if not nvml.available:
        torch_sees = bool(probe and probe.torch.devices)
        if not torch_sees:
            add(
                Diagnosis(
                    code="no_gpu",
                    component="driver",
                    severity="fail",
                    message=f"no NVIDIA GPU visible ({nvml.error or 'NVML unavailable'})",
                    remedy="run on a machine with an NVIDIA GPU and its driver installed "
                    "(`nvidia-smi` must list the GPU)",
                )
            )
    elif not gpus:
        add(
            Diagnosis(
                code="no_gpu",
                component="driver",
                severity="fail",
                message="no NVIDIA GPU visible: the driver is loaded but lists no devices",
                remedy="check `nvidia-smi`; in a container pass the GPU through (--gpus all)",
            )
        )

    if probe is None:
        return out

    t = probe.torch
    v = probe.vllm
    cpu_build = t.imported and (t.cuda is None or (t.version or "").endswith("+cpu"))
    # The fix for a wrong torch under vLLM: the CUDA build of the exact version vLLM pins.
    pin = (
        v.torch_requirement if v.torch_requirement and v.torch_requirement.startswith("==") else ""
    )
    cuda_torch = f"{py} -m pip install --force-reinstall torch{pin} --index-url {index_url}"

    # torch itself.
    if t.dist_version is None and not t.imported:
        add(
            Diagnosis(
                code="torch_missing",
                component="torch",
                severity="fail",
                message=f"torch is not installed for {py} (Python {probe.python.version})",
                remedy=f"{py} -m pip install torch{pin} --index-url {index_url}"
                + (f" (the torch vLLM {v.dist_version} pins)" if pin else ""),
            )
        )
    elif not t.imported:
        err = t.import_error or "unknown error"
        if "libcudnn" in err:
            add(
                Diagnosis(
                    code="cudnn_missing",
                    component="torch",
                    severity="fail",
                    message=f"import torch fails: {err} (a CUDA torch installed with --no-deps "
                    "lacks the cuDNN and NVIDIA runtime wheels)",
                    remedy=f"{py} -m pip install --force-reinstall torch=={t.dist_version} "
                    f"--index-url {index_url}   (with its dependencies: no --no-deps)",
                )
            )
        else:
            add(
                Diagnosis(
                    code="torch_import_failed",
                    component="torch",
                    severity="fail",
                    message=f"import torch fails under {py}: {err}",
                    remedy=f"{py} -m pip install --force-reinstall torch=={t.dist_version} "
                    f"--index-url {index_url}",
                )
            )
    elif cpu_build:
        under_vllm = v.dist_version is not None
        add(
            Diagnosis(
                code="torch_cpu_build",
                component="torch",
                severity="fail" if (under_vllm or gpus) else "warn",
                message=f"torch {t.version} is a CPU build (torch.version.cuda is None, arch list "
                f"{t.arch_list or 'empty'})"
                + (f" under a CUDA build of vLLM {v.dist_version}" if under_vllm else ""),
                remedy=f"{cuda_torch} (the CUDA build from the PyTorch index, with its "
                "dependencies: no --no-deps)",
            )
        )
    elif t.cuda_error:
        add(
            Diagnosis(
                code="cuda_init_failed",
                component="torch",
                severity="fail",
                message=f"torch could not initialise CUDA: {t.cuda_error}",
                remedy="check `nvidia-smi`, CUDA_VISIBLE_DEVICES and the driver version",
            )
        )
    elif not t.cuda_available and gpus:
        driver = nvml.cuda_driver_version
        too_old = bool(
            driver and t.cuda and _version_tuple(driver)[:2] < _version_tuple(t.cuda)[:2]
        )
        add(
            Diagnosis(
                code="cuda_unavailable",
                component="torch",
                severity="fail",
                message=f"torch {t.version} (CUDA {t.cuda}) cannot use the {len(gpus)} GPU(s) the "
                "driver lists" + (f": the driver supports CUDA {driver} only" if too_old else ""),
                remedy=(
                    f"{py} -m pip install --force-reinstall torch --index-url {index_url} "
                    "(a build for the driver's CUDA), or update the NVIDIA driver"
                    if too_old
                    else "check CUDA_VISIBLE_DEVICES is not empty and the user may open "
                    "/dev/nvidia*"
                ),
            )
        )
    elif not t.cuda_available:
        add(
            Diagnosis(
                code="cuda_unavailable",
                component="torch",
                severity="info",
                message=f"torch {t.version} (CUDA {t.cuda}) is a CUDA build; CUDA is not "
                "available because no GPU is visible",
            )
        )

    # Each GPU torch sees.
    for dev in t.devices:
        major, minor = dev.capability
        sm = f"sm_{major}{minor}"
        native, ptx = _arch_covers(t.arch_list, major, minor)
        if not native:
            add(
                Diagnosis(
                    code="arch_missing",
                    component="gpu",
                    severity="warn" if ptx else "fail",
                    message=f"{dev.name} is {sm} (capability {major}.{minor}) but torch "
                    f"{t.version} was built for {', '.join(t.arch_list) or 'no GPU'}"
                    + (" (only PTX JIT covers it: slow first start)" if ptx else ""),
                    remedy=f"install a torch build that includes {sm}: {py} -m pip install "
                    f"--force-reinstall torch --index-url "
                    + (
                        "https://download.pytorch.org/whl/cu126 (CUDA 12.8+ wheels dropped "
                        "pre-Turing GPUs)"
                        if (major, minor) < (7, 5)
                        else index_url
                    ),
                )
            )
        if major < 8:
            add(
                Diagnosis(
                    code="no_native_bf16",
                    component="gpu",
                    severity="warn",
                    message=f"{dev.name} ({sm}) has no bf16 datapath: bf16 checkpoints must run "
                    "as fp16",
                    remedy="serve with --dtype float16 (vLLM casts the bf16 weights)",
                )
            )
        optin = dev.shared_memory_per_block_optin
        if optin is not None and optin < GEMMA4_ATTENTION_SMEM_BYTES:
            add(
                Diagnosis(
                    code="turing_shared_memory",
                    component="gpu",
                    severity="warn",
                    message=f"{dev.name} allows {optin:,} B of shared memory per block; vLLM's "
                    f"Triton attention at Gemma 4's head size 512 asks for "
                    f"{GEMMA4_ATTENTION_SMEM_BYTES:,}-98,304 B (OutOfResources at start-up)",
                    remedy=TURING_PATCH_HINT,
                )
            )
    if t.fp16_matmul is not None and not t.fp16_matmul.ok:
        detail = t.fp16_matmul.error or f"max abs error {t.fp16_matmul.max_abs_err}"
        add(
            Diagnosis(
                code="fp16_matmul_wrong",
                component="gpu",
                severity="fail",
                message=f"an fp16 matmul on GPU 0 disagrees with the CPU: {detail}",
                remedy="check the driver and torch build match; run `nvidia-smi -q` for ECC errors",
            )
        )
    if t.devices and t.fp16_matmul is not None and t.fp16_matmul.ok:
        d0 = t.devices[0]
        add(
            Diagnosis(
                code="gpu_ok",
                component="gpu",
                severity="ok",
                message=f"{d0.name} sm_{d0.capability[0]}{d0.capability[1]}, "
                f"{d0.total_memory_bytes / 2**30:.1f} GiB: fp16 matmul matches the CPU "
                f"(max abs err {t.fp16_matmul.max_abs_err:.3g})",
            )
        )

    # vLLM.
    if v.dist_version is None:
        add(
            Diagnosis(
                code="vllm_missing",
                component="vllm",
                severity="warn" if t.devices else "info",
                message=f"vLLM is not installed for {py}",
                remedy=f"{py} -m pip install vllm (vLLM pins its torch), or set GPURIG_PYTHON "
                "to the interpreter that has vLLM",
            )
        )
    elif v.import_timed_out:
        add(
            Diagnosis(
                code="vllm_import_timeout",
                component="vllm",
                severity="warn",
                message=f"import vllm {v.dist_version} did not finish within the probe's timeout",
                remedy=f"run it again with a larger {arg('timeout_s')}; a first import "
                "compiles bytecode and can take a minute",
            )
        )
    elif v.import_ok is False:
        err = v.import_error or "unknown error"
        if "libcudart" in err:
            cause = (
                f"the CPU build torch {t.version} under a CUDA build of vLLM"
                if cpu_build
                else f"torch {t.version} (CUDA {t.cuda}) does not match the CUDA vLLM "
                f"{v.dist_version} was built for"
            )
            add(
                Diagnosis(
                    code="vllm_libcudart",
                    component="vllm",
                    severity="fail",
                    message=f"import vllm fails: {err}: {cause}",
                    remedy=f"{cuda_torch} (the CUDA torch vLLM {v.dist_version} pins"
                    + (f": {v.torch_requirement}" if v.torch_requirement else "")
                    + ", with its dependencies)",
                )
            )
        else:
            add(
                Diagnosis(
                    code="vllm_import_failed",
                    component="vllm",
                    severity="fail",
                    message=f"import vllm {v.dist_version} fails: {err}",
                    remedy=f"{py} -m pip install --force-reinstall vllm=={v.dist_version}; "
                    "read the traceback in probe.vllm.import_error_tail",
                )
            )
    elif v.import_ok:
        add(
            Diagnosis(
                code="vllm_ok",
                component="vllm",
                severity="ok",
                message=f"import vllm {v.dist_version} works ({v.import_seconds:.1f} s)",
            )
        )
    return out


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
}


def summarize(probe: ProbeReport | None, diagnoses: list[Diagnosis]) -> str:
    fails = [d for d in diagnoses if d.severity == "fail"]
    if fails:
        return "; ".join(dict.fromkeys(SUMMARY_TITLES.get(d.code, d.code) for d in fails))
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
