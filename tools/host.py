"""check_host_capacity: will the weights fit on this host's disks and in its memory?

A single `df /` gives the wrong answer on a real cloud VM: on a T4 VM we served from, / had 8.1 GiB free,
/tmp was its own 3.9 GB filesystem, and ~/.cache was a symlink onto a 245 GiB /opt1. So every
target path is measured on its own: symlinks followed, the filesystem that really holds it
found (a path that does not exist yet is measured at its nearest existing parent), and paths
that share a filesystem grouped, since they share its free space.

The advice rules are written down below (`RULES`), each a pure function over the measurements,
so a reader finds why an advice fired and a test can replay that VM.

Fast by design (well under a second): statvfs, /proc/mounts, psutil counters, and NVML's GPU
count only if it answers within half a second.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, Field

from tools.errors import InvalidInputError
from tools.settings import hf_cache_dir

GIB = 2**30

# ---------------------------------------------------------------------------------------------
# The numbers behind the rules (Gemma 4 E2B, measured on the T4 VM described above)

# The bf16 Gemma 4 E2B checkpoint is one 10,246,621,918-byte model.safetensors (9.54 GiB); the
# QAT w4a16 build is smaller. When need_gib is not given, this is what must fit in the HF cache.
DEFAULT_WEIGHTS_GIB = 10.0
# vLLM stages weights through host memory. A 7.26 GiB host (no swap) was OOM-killed
# loading those 9.54 GiB; with a 16 GiB swapfile, swap peaked at 6.6 GiB (bf16), so staging used
# about 7.26 + 6.6 = 13.9 GiB of RAM + swap: 1.46x the weights. We ask for 1.5x.
STAGING_FACTOR = 1.5
# Head-room added to a swapfile's size, then rounded up to a multiple of SWAP_STEP_GIB (that
# host gets 12 GiB; it used 6.6 GiB of the 16 GiB it had).
SWAP_MARGIN_GIB = 4.0
SWAP_STEP_GIB = 4
# /tmp on its own filesystem smaller than this fills up with pip builds, wheels being unpacked
# and compiler caches (that VM's /tmp: 3.9 GB).
TMP_SMALL_GIB = 8.0
# Filesystems a swapfile cannot live on.
NO_SWAPFILE_FSTYPES = {"tmpfs", "ramfs", "devtmpfs", "overlay", "squashfs", "nfs", "nfs4", "cifs"}


def default_paths() -> list[str]:
    """/, /tmp, ~/.cache and the Hugging Face hub cache (HF_HUB_CACHE / HF_HOME aware)."""
    return ["/", "/tmp", "~/.cache", str(hf_cache_dir())]


# ---------------------------------------------------------------------------------------------
# Models


class PathReport(BaseModel):
    path: str = Field(description="the path as given")
    real_path: str = Field(description="absolute, with every symlink followed")
    is_symlink: bool = Field(description="the given path (or a parent) is a symlink")
    exists: bool
    measured_at: str = Field(description="real_path, or its nearest existing parent")
    mount_point: str
    device: str = Field(description="the filesystem's source, e.g. /dev/vda1 or tmpfs")
    fstype: str
    st_dev: int = Field(description="the filesystem's device number: equal means shared space")
    total_bytes: int
    free_bytes: int = Field(description="free for an unprivileged user (statvfs f_bavail)")
    note: str | None = None


class FilesystemReport(BaseModel):
    """One filesystem and the measured paths it holds: they share its free space."""

    st_dev: int
    mount_point: str
    device: str
    fstype: str
    total_bytes: int
    free_bytes: int
    total_gib: float
    free_gib: float
    paths: list[str]


class MemoryReport(BaseModel):
    ram_total_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    swap_free_bytes: int


class CpuReport(BaseModel):
    count: int | None = Field(description="logical CPUs")
    usable: int | None = Field(description="CPUs this process may run on (affinity)")
    load_avg: tuple[float, float, float] | None = Field(description="1, 5, 15 minutes")


class Advice(BaseModel):
    rule: Literal["memory_staging", "disk_space", "tmp_small"]
    status: Literal["ok", "warn", "fail"] = Field(description="ok: nothing to do")
    reason: str
    commands: list[str] = Field(default_factory=list, description="exact shell commands, in order")


class HostCapacity(BaseModel):
    """check_host_capacity's answer."""

    verdict: Literal["ok", "warn", "fail"]
    paths: list[PathReport]
    filesystems: list[FilesystemReport]
    memory: MemoryReport
    cpu: CpuReport
    nvidia_gpu_count: int | None = Field(description="from NVML; None when NVML does not answer")
    need_gib: float | None = Field(description="the caller's need; None: the Gemma 4 E2B default")
    staging_need_gib: float = Field(description="RAM + swap needed to stage the weights")
    advice: list[Advice] = Field(description="every rule's outcome; status ok needs no action")
    seconds: float


# ---------------------------------------------------------------------------------------------
# Measuring


def _mounts() -> dict[str, tuple[str, str]]:
    """mount point -> (device, fstype); the last mount on a point wins, as the kernel shows it."""
    table: dict[str, tuple[str, str]] = {}
    for part in psutil.disk_partitions(all=True):
        table[part.mountpoint] = (part.device, part.fstype)
    return table


def _mount_point(path: Path, mounts: dict[str, tuple[str, str]]) -> Path:
    """The mount that holds `path` (already real): the longest mount point above it, which
    also names bind mounts right; else walk up until the device number changes."""
    best: str | None = None
    text = str(path)
    for point in mounts:
        inside = text == point or text.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best)):
            best = point
    if best is not None:
        return Path(best)
    dev = path.stat().st_dev
    while path != path.parent:
        if path.parent.stat().st_dev != dev:
            return path
        path = path.parent
    return path


def _probe_exists(path: Path) -> tuple[bool, str | None]:
    """(exists, why not readable): a path we may not stat is measured at a parent, not fatal."""
    try:
        os.stat(path)
        return True, None
    except FileNotFoundError:
        return False, None
    except OSError as exc:  # EACCES, ELOOP, ENOTDIR ...
        return False, exc.strerror or type(exc).__name__


def measure_path(given: str, mounts: dict[str, tuple[str, str]] | None = None) -> PathReport:
    """Measure one path on the filesystem that really holds it."""
    if not given or not given.strip():
        raise InvalidInputError("an empty path was given", remedy="pass absolute paths, e.g. /opt1")
    if "\x00" in given:
        raise InvalidInputError("a path contains a NUL byte", remedy="pass a plain path")
    mounts = _mounts() if mounts is None else mounts
    expanded = Path(os.path.expanduser(given)).absolute()
    real = Path(os.path.realpath(expanded))
    exists, why = _probe_exists(real)
    measured = real
    while measured != measured.parent and not _probe_exists(measured)[0]:
        measured = measured.parent
    note = None
    if why:
        note = f"cannot be read ({why}); measured at its nearest readable parent {measured}"
    elif not exists:
        note = f"does not exist yet; measured at its nearest existing parent {measured}"
    elif not real.is_dir():
        note = "a file; measured on the filesystem that holds it"
    st = os.statvfs(measured)
    mount = _mount_point(measured, mounts)
    device, fstype = mounts.get(str(mount), ("?", "?"))
    return PathReport(
        path=given,
        real_path=str(real),
        is_symlink=str(real) != str(expanded),
        exists=exists,
        measured_at=str(measured),
        mount_point=str(mount),
        device=device,
        fstype=fstype,
        st_dev=measured.stat().st_dev,
        total_bytes=st.f_blocks * st.f_frsize,
        free_bytes=st.f_bavail * st.f_frsize,
        note=note,
    )


def group_filesystems(reports: list[PathReport]) -> list[FilesystemReport]:
    """One entry per filesystem (st_dev), in the order first seen."""
    groups: dict[int, FilesystemReport] = {}
    for rep in reports:
        dev = rep.st_dev
        if dev not in groups:
            groups[dev] = FilesystemReport(
                st_dev=dev,
                mount_point=rep.mount_point,
                device=rep.device,
                fstype=rep.fstype,
                total_bytes=rep.total_bytes,
                free_bytes=rep.free_bytes,
                total_gib=round(rep.total_bytes / GIB, 2),
                free_gib=round(rep.free_bytes / GIB, 2),
                paths=[],
            )
        groups[dev].paths.append(rep.path)
    return list(groups.values())


def measure_memory() -> MemoryReport:
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    return MemoryReport(
        ram_total_bytes=vm.total,
        ram_available_bytes=vm.available,
        swap_total_bytes=sw.total,
        swap_used_bytes=sw.used,
        swap_free_bytes=sw.free,
    )


def measure_cpu() -> CpuReport:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    try:
        load = tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        load = None
    return CpuReport(count=os.cpu_count(), usable=usable, load_avg=load)


# ---------------------------------------------------------------------------------------------
# The rules: pure functions (measurements in, Advice out)


class Facts(BaseModel):
    """Everything a rule may look at."""

    paths: list[PathReport]
    filesystems: list[FilesystemReport]
    memory: MemoryReport
    need_gib: float | None
    root_st_dev: int | None = None
    tmp: PathReport | None = None
    tmp_st_dev: int | None = None


def staging_need_gib(need_gib: float | None) -> float:
    """RAM + swap vLLM needs to stage `need_gib` of weights (default: Gemma 4 E2B bf16)."""
    return round((need_gib or DEFAULT_WEIGHTS_GIB) * STAGING_FACTOR, 2)


def swapfile_commands(size_gib: int, swapfile: str) -> list[str]:
    """The exact commands for a persistent swapfile (what the OOM-killed 7.3 GiB host needed)."""
    return [
        f"sudo fallocate -l {size_gib}G {swapfile}",
        f"sudo chmod 600 {swapfile}",
        f"sudo mkswap {swapfile}",
        f"sudo swapon {swapfile}",
        f"echo '{swapfile} none swap sw 0 0' | sudo tee -a /etc/fstab",
    ]


def _swapfile_home(filesystems: list[FilesystemReport], size_gib: int) -> str | None:
    """Where the swapfile goes: the measured disk filesystem with the most free space, or None
    when none has room for it (a command that fails with ENOSPC is no advice)."""
    fit = [
        fs
        for fs in filesystems
        if fs.fstype not in NO_SWAPFILE_FSTYPES and fs.free_bytes >= size_gib * GIB
    ]
    if not fit:
        return None
    best = max(fit, key=lambda fs: fs.free_bytes)
    return str(Path(best.mount_point) / "swapfile")


def rule_memory_staging(f: Facts) -> Advice:
    """RAM + swap must hold the weights while vLLM stages them, or the kernel OOM-kills it."""
    need = staging_need_gib(f.need_gib)
    ram = f.memory.ram_total_bytes / GIB
    swap = f.memory.swap_total_bytes / GIB
    have = ram + swap
    what = f"{f.need_gib} GiB of weights" if f.need_gib else "Gemma 4 E2B (bf16, 9.5 GiB)"
    if have >= need:
        return Advice(
            rule="memory_staging",
            status="ok",
            reason=f"RAM {ram:.1f} GiB + swap {swap:.1f} GiB covers the {need:.1f} GiB needed to "
            f"stage {what}",
        )
    shortfall = need - have
    size = int(math.ceil((shortfall + SWAP_MARGIN_GIB) / SWAP_STEP_GIB) * SWAP_STEP_GIB)
    swapfile = _swapfile_home(f.filesystems, size)
    why = (
        f"RAM {ram:.1f} GiB + swap {swap:.1f} GiB is less than the {need:.1f} GiB needed to "
        f"stage {what} ({STAGING_FACTOR}x the weights); vLLM gets OOM-killed while loading "
        f"(a 7.3 GiB host without swap was OOM-killed loading it; a swapfile fixed it)"
    )
    if swapfile is None:
        return Advice(
            rule="memory_staging",
            status="fail",
            reason=f"{why}. A {size} GiB swapfile would be needed, but no measured disk "
            "filesystem has that much free space: use a host with more RAM, or attach a disk "
            "(check it with --path) and put the swapfile there",
        )
    return Advice(
        rule="memory_staging",
        status="fail",
        reason=f"{why}. Add a {size} GiB swapfile on the disk with the most room",
        commands=swapfile_commands(size, swapfile),
    )


def rule_disk_space(f: Facts) -> Advice:
    """Each filesystem must have room for the weights: every path when need_gib is given, else
    the Hugging Face cache for the default Gemma 4 E2B checkpoint."""
    need = f.need_gib if f.need_gib is not None else DEFAULT_WEIGHTS_GIB
    severity: Literal["warn", "fail"] = "fail" if f.need_gib is not None else "warn"
    if f.need_gib is not None:
        targets = f.paths
    else:
        hf = str(hf_cache_dir())
        targets = [p for p in f.paths if p.path == hf or p.real_path == os.path.realpath(hf)]
    short = [p for p in targets if p.free_bytes < need * GIB]
    if not short:
        return Advice(
            rule="disk_space",
            status="ok",
            reason=f"every checked path has {need:g} GiB free"
            if targets
            else "no path to check against the weights' size",
        )
    biggest = max(f.filesystems, key=lambda fs: fs.free_bytes)
    lines = ", ".join(
        f"{p.path} ({p.free_bytes / GIB:.1f} GiB free on {p.mount_point})" for p in short
    )
    # one df argument per filesystem: df prints a row per argument, and paths on one
    # filesystem (/, /tmp; ~/.cache and a not-yet-made HF cache) would repeat the same row
    per_fs: dict[str, str] = {}
    for p in short:
        per_fs.setdefault(p.mount_point, p.measured_at)
    commands = [f"df -h {' '.join(per_fs.values())}"]
    if biggest.free_bytes >= need * GIB:
        target = Path(biggest.mount_point) / "huggingface"
        commands += [f"mkdir -p {target}", f"export HF_HOME={target}"]
        where = f"; {biggest.mount_point} has {biggest.free_gib:.1f} GiB free: point HF_HOME there"
    else:
        where = "; no measured filesystem has that much room: free space or attach a disk"
    return Advice(
        rule="disk_space",
        status=severity,
        reason=f"less than {need:g} GiB free at {lines}{where}",
        commands=commands,
    )


def rule_tmp_small(f: Facts) -> Advice:
    """/tmp on its own small filesystem fills up during installs and compiles."""
    tmp = f.tmp
    if tmp is None:
        return Advice(rule="tmp_small", status="ok", reason="/tmp was not measured")
    own = f.tmp_st_dev is not None and f.tmp_st_dev != f.root_st_dev
    total = tmp.total_bytes / GIB
    if not own or total >= TMP_SMALL_GIB:
        where = "its own filesystem" if own else "the root filesystem"
        return Advice(rule="tmp_small", status="ok", reason=f"/tmp is on {where} ({total:.1f} GiB)")
    fs_big = [fs for fs in f.filesystems if fs.st_dev != f.tmp_st_dev and fs.free_gib >= 20]
    base = max(fs_big, key=lambda fs: fs.free_bytes).mount_point if fs_big else "/var"
    newtmp = "/var/tmp/gpurig" if base == "/" else str(Path(base) / "tmp")
    ram_backed = (
        " and RAM-backed (it eats the memory the weights need)" if tmp.fstype == "tmpfs" else ""
    )
    return Advice(
        rule="tmp_small",
        status="warn",
        reason=f"/tmp is its own {total:.1f} GiB filesystem ({tmp.fstype}){ram_backed}: pip "
        f"unpacking a 330 MB vLLM wheel with torch, and Triton/torch.compile caches, can fill it",
        commands=[f"mkdir -p {newtmp}", f"export TMPDIR={newtmp}"],
    )


# The rules, in the order their advice is shown.
RULES: list[Callable[[Facts], Advice]] = [rule_memory_staging, rule_disk_space, rule_tmp_small]


def evaluate_rules(facts: Facts) -> list[Advice]:
    return [rule(facts) for rule in RULES]


def verdict_of(advice: list[Advice]) -> Literal["ok", "warn", "fail"]:
    statuses = {a.status for a in advice}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "ok"


# ---------------------------------------------------------------------------------------------
# The tool


def check_host_capacity(
    paths: list[str] | None = None, need_gib: float | None = None
) -> HostCapacity:
    """Measure disks, memory, CPU and GPU count, and advise with reasons and exact commands."""
    started = time.monotonic()
    if need_gib is not None and not (0 < need_gib < 1_000_000):
        raise InvalidInputError(
            f"need_gib must be a positive number of GiB, got {need_gib}",
            remedy="pass the size of the weights in GiB, e.g. need_gib=10 for Gemma 4 E2B bf16",
        )
    given = default_paths() if not paths else list(dict.fromkeys(paths))
    mounts = _mounts()
    reports = [measure_path(p, mounts) for p in given]
    filesystems = group_filesystems(reports)
    memory = measure_memory()
    real_tmp = os.path.realpath("/tmp")
    tmp = next((r for r in reports if r.real_path == real_tmp), None)
    facts = Facts(
        paths=reports,
        filesystems=filesystems,
        memory=memory,
        need_gib=need_gib,
        root_st_dev=os.stat("/").st_dev,
        tmp=tmp,
        tmp_st_dev=tmp.st_dev if tmp else None,
    )
    advice = evaluate_rules(facts)
    from tools.gpu_nvml import nvml_gpu_count  # NVML only: not the probe and its rules

    return HostCapacity(
        verdict=verdict_of(advice),
        paths=reports,
        filesystems=filesystems,
        memory=memory,
        cpu=measure_cpu(),
        nvidia_gpu_count=nvml_gpu_count(timeout_s=0.5),
        need_gib=need_gib,
        staging_need_gib=staging_need_gib(need_gib),
        advice=advice,
        seconds=round(time.monotonic() - started, 3),
    )
