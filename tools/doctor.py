"""The readiness report: every read-only check for this host, in one list.

Each area adds ONE function to `CHECKS`: it takes the shared `DoctorContext` and returns a
`Check` (or a list of them, for an area whose report has several independent parts). A check
imports its area's module inside the function, so importing doctor stays cheap (the CLI imports
it for `gpurig --help`).

Checks run concurrently (the GPU probe imports torch for ~2 s; nothing else should wait on
it), each in its own guard: a check that raises becomes a `fail` entry, never a crashed report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from tools.errors import GpurigError, InvalidInputError, arg, either

if TYPE_CHECKING:
    from tools.gpu import GpuArchReport
    from tools.host import HostCapacity

log = logging.getLogger(__name__)

Status = Literal["ok", "warn", "fail", "skip"]
_RANK: dict[str, int] = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}


class Check(BaseModel):
    """One line of the readiness report."""

    name: str = Field(description="what was checked, e.g. 'host memory', 'torch'")
    status: Status = Field(description="ok, warn (works but needs attention), fail, skip (n/a)")
    detail: str = Field(description="what was found")
    remedy: str | None = Field(None, description="what to do, with exact commands where known")


class DoctorReport(BaseModel):
    """doctor's answer: the overall status is the worst of the checks (skip counts as ok)."""

    status: Literal["ok", "warn", "fail"]
    checks: list[Check]
    seconds: float


@dataclass
class DoctorContext:
    """What every check may use. The host and GPU reports are computed once and shared, so a
    later check that needs the GPU's capability (the Turing patch, say) does not probe again."""

    python_bin: str | None = None
    need_gib: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)
    _cache: dict[str, BaseModel] = field(default_factory=dict, repr=False)

    def host(self) -> HostCapacity:
        from tools.host import check_host_capacity

        return self._once("host", lambda: check_host_capacity(need_gib=self.need_gib))

    def gpu(self) -> GpuArchReport:
        from tools.gpu import verify_gpu_arch

        return self._once("gpu", lambda: verify_gpu_arch(python_bin=self.python_bin))

    def _once(self, key: str, compute: Callable[[], BaseModel]):
        # Checks run in threads: the first caller of a key computes it, later ones wait for that
        # key only (a lock per key, so the host check never waits on the GPU probe).
        with self._lock:
            key_lock = self._locks.setdefault(key, threading.Lock())
        with key_lock:
            if key not in self._cache:
                self._cache[key] = compute()
            return self._cache[key]


CheckFn = Callable[[DoctorContext], "Check | list[Check]"]


# ---------------------------------------------------------------------------------------------
# Host and GPU


def check_host(ctx: DoctorContext) -> list[Check]:
    """check_host_capacity, one Check per rule (memory for staging, disk space, /tmp)."""
    host = ctx.host()
    names = {"memory_staging": "host memory", "disk_space": "disk space", "tmp_small": "/tmp"}
    checks = [
        Check(
            name=names.get(a.rule, a.rule),
            status=a.status,
            detail=a.reason,
            remedy=" && ".join(a.commands) or None,
        )
        for a in host.advice
    ]
    fs = "; ".join(
        f"{f.mount_point} {f.free_gib:.1f}/{f.total_gib:.1f} GiB free ({', '.join(f.paths)})"
        for f in host.filesystems
    )
    checks.insert(0, Check(name="filesystems", status="ok", detail=fs))
    return checks


def check_gpu(ctx: DoctorContext) -> list[Check]:
    """verify_gpu_arch, one Check per component (driver, gpu, torch, vllm)."""
    from tools.gpu import SEVERITY_ORDER

    report = ctx.gpu()
    checks: list[Check] = []
    for component in ("probe", "driver", "gpu", "torch", "vllm"):
        found = [d for d in report.diagnoses if d.component == component]
        if not found:
            ok = _component_ok(component, report)
            if ok is not None:
                checks.append(ok)
            continue
        worst = max(found, key=lambda d: SEVERITY_ORDER[d.severity])
        status: Status = {"ok": "ok", "info": "ok", "warn": "warn", "fail": "fail"}[worst.severity]
        if worst.code == "vllm_missing" and status == "ok":
            status = "skip"  # nothing to import: the vLLM check could not run
        remedies = [d.remedy for d in found if d.remedy and d.severity in ("warn", "fail")]
        checks.append(
            Check(
                name=component if component != "probe" else "gpu probe",
                status=status,
                detail="; ".join(d.message for d in found),
                remedy="; ".join(remedies) or None,
            )
        )
    return checks


def check_turing_patch(ctx: DoctorContext) -> Check:
    """The vLLM Turing clamp: needed (and must be `patched`) below capability 8, else moot."""
    from tools.errors import NotFoundError
    from tools.turing import MIN_UNPATCHED_MAJOR, verify_turing_patch

    gpu = ctx.gpu()
    caps = [d.capability for d in gpu.nvml.gpus if d.capability]
    if not caps and gpu.probe:
        caps = [d.capability for d in gpu.probe.torch.devices]
    needed = bool(caps) and min(caps) < (MIN_UNPATCHED_MAJOR, 0)
    try:
        report = verify_turing_patch(ctx.python_bin)
    except NotFoundError as err:
        return Check(name="turing patch", status="skip", detail=err.message)
    if not report.needed:
        return Check(
            name="turing patch",
            status="ok",
            detail=f"not needed for {report.vllm_label} (the clamp is for NVIDIA GPUs below "
            "capability 8)",
        )
    detail = f"vLLM {report.vllm_version}: {report.state_after} ({report.path})"
    if report.state_after == "patched":
        return Check(name="turing patch", status="ok", detail=detail)
    if not needed:
        why = "not needed on this GPU" if caps else "no GPU to judge by"
        return Check(name="turing patch", status="ok", detail=f"{detail}; {why}")
    remedy = either(cli="gpurig patch apply", mcp="call apply_turing_patch")
    if report.state_after == "modified":  # apply refuses a file it did not install: reinstall
        remedy = (
            f"{report.python} -m pip install --force-reinstall --no-deps "
            f"{report.distribution}=={report.vllm_version} "
            + either(cli="&& gpurig patch apply", mcp="then call apply_turing_patch")
        )
    return Check(
        name="turing patch",
        status="fail",
        detail=f"{detail}; capability {min(caps)[0]}.{min(caps)[1]} needs the clamp for Gemma 4",
        remedy=remedy,
    )


def _component_ok(component: str, report) -> Check | None:
    """A line for a component with nothing to report, so the table shows what was checked."""
    probe = report.probe
    if component == "driver" and report.nvml.available:
        n = report.nvml
        return Check(
            name="driver",
            status="ok",
            detail=f"NVIDIA driver {n.driver_version} (CUDA {n.cuda_driver_version}), "
            f"{len(n.gpus)} GPU(s)",
        )
    if component == "torch" and probe and probe.torch.imported:
        t = probe.torch
        return Check(
            name="torch",
            status="ok",
            detail=f"torch {t.version} (CUDA {t.cuda}) under Python {probe.python.version} "
            f"({probe.python.executable}), arch {', '.join(t.arch_list)}",
        )
    return None


# ---------------------------------------------------------------------------------------------
# Running

# One function per area, in report order.
CHECKS: list[CheckFn] = [check_host, check_gpu, check_turing_patch]


def _check_name(fn: CheckFn) -> str:
    """A person's name for a check: check_turing_patch -> "turing patch"."""
    return getattr(fn, "__name__", "check").removeprefix("check_").replace("_", " ")


def _run_one(fn: CheckFn, ctx: DoctorContext) -> list[Check]:
    name = _check_name(fn)
    try:
        result = fn(ctx)
    except GpurigError as err:
        return [Check(name=name, status="fail", detail=err.message, remedy=err.remedy)]
    except Exception as exc:  # a broken check must not hide the others
        log.exception("doctor check %s crashed", name)
        return [Check(name=name, status="fail", detail=f"the check crashed: {exc!r}")]
    return result if isinstance(result, list) else [result]


def overall(checks: list[Check]) -> Literal["ok", "warn", "fail"]:
    worst = max((_RANK[c.status] for c in checks), default=1)
    return "fail" if worst == 3 else "warn" if worst == 2 else "ok"


def doctor(python_bin: str | None = None, need_gib: float | None = None) -> DoctorReport:
    """Run every check in CHECKS concurrently and return their lines in that order."""
    started = time.monotonic()
    # Bad arguments are the caller's to fix: raise before running anything.
    if need_gib is not None and not need_gib > 0:
        raise InvalidInputError(
            f"{arg('need_gib')} must be a positive number of GiB, got {need_gib}",
            remedy=f"pass the size of the weights in GiB, e.g. {arg('need_gib')} 10",
        )
    # The serving interpreter too, whether from --python or GPURIG_PYTHON: a wrong one is
    # configuration to fix, not two failed checks.
    from tools.settings import resolve_python

    python_bin = resolve_python(python_bin)
    ctx = DoctorContext(python_bin=python_bin, need_gib=need_gib)
    with ThreadPoolExecutor(max_workers=max(1, len(CHECKS))) as pool:
        futures = [pool.submit(_run_one, fn, ctx) for fn in CHECKS]
        checks = [check for fut in futures for check in fut.result()]
    return DoctorReport(
        status=overall(checks), checks=checks, seconds=round(time.monotonic() - started, 3)
    )
