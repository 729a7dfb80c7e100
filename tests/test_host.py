"""check_host_capacity on real paths (a symlink into /dev/shm, a path that does not exist yet),
its rules replayed on the seed's host, and the doctor's check registry."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tools import doctor as doctor_mod
from tools import host
from tools.doctor import Check, DoctorContext
from tools.errors import InvalidInputError
from tools.host import (
    GIB,
    Facts,
    FilesystemReport,
    MemoryReport,
    PathReport,
    check_host_capacity,
    evaluate_rules,
)

SHM = Path("/dev/shm")


def _separate_fs(a: Path, b: Path) -> bool:
    return a.exists() and b.exists() and a.stat().st_dev != b.stat().st_dev


def test_defaults_answer_fast() -> None:
    check_host_capacity()  # warm imports (pynvml, tools.gpu) the way a server would have
    started = time.monotonic()
    report = check_host_capacity()
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"took {elapsed:.2f} s"  # a hang guard (a stuck mount), not a speed claim
    assert [p.path for p in report.paths] == host.default_paths()
    assert {r.rule for r in report.advice} == {"memory_staging", "disk_space", "tmp_small"}
    mem = report.memory
    assert 0 < mem.ram_available_bytes <= mem.ram_total_bytes
    assert report.cpu.count and report.cpu.count >= 1
    # every measured path is in exactly one filesystem group
    grouped = [p for fs in report.filesystems for p in fs.paths]
    assert sorted(grouped) == sorted(p.path for p in report.paths)


@pytest.mark.skipif(
    not _separate_fs(SHM, Path(tempfile.gettempdir())), reason="no separate /dev/shm"
)
def test_symlink_into_another_filesystem(tmp_path: Path) -> None:
    """Like the seed's ~/.cache -> /opt1/cache: measured where the link points, not where it is."""
    target = Path(tempfile.mkdtemp(prefix="gpurig-test-", dir=SHM))
    try:
        link = tmp_path / "cache"
        link.symlink_to(target)
        plain = tmp_path / "plain"
        plain.mkdir()
        report = check_host_capacity(paths=[str(link), str(plain), str(tmp_path)])
        by_path = {p.path: p for p in report.paths}
        linked = by_path[str(link)]
        assert linked.is_symlink and linked.exists
        assert linked.real_path == os.path.realpath(target)
        assert linked.mount_point == str(SHM)
        assert linked.fstype == "tmpfs"
        assert linked.st_dev == SHM.stat().st_dev
        assert linked.total_bytes == os.statvfs(SHM).f_blocks * os.statvfs(SHM).f_frsize
        assert by_path[str(plain)].is_symlink is False
        # two filesystems: the link's, and the one holding tmp_path and plain (sharing space)
        assert len(report.filesystems) == 2
        groups = {fs.mount_point: fs.paths for fs in report.filesystems}
        assert groups[str(SHM)] == [str(link)]
        assert sorted(groups[by_path[str(plain)].mount_point]) == sorted(
            [str(plain), str(tmp_path)]
        )
    finally:
        shutil.rmtree(target)


def test_path_that_does_not_exist_yet(tmp_path: Path) -> None:
    future = tmp_path / "models" / "gemma" / "hub"
    report = check_host_capacity(paths=[str(future)])
    (rep,) = report.paths
    assert rep.exists is False
    assert rep.measured_at == str(tmp_path)
    assert "does not exist yet" in rep.note
    st = os.statvfs(tmp_path)
    assert rep.total_bytes == st.f_blocks * st.f_frsize
    # other processes write to the same disk meanwhile: free space agrees to within 1 GiB
    assert abs(rep.free_bytes - st.f_bavail * st.f_frsize) < GIB
    assert not future.exists()  # measuring creates nothing


def test_tilde_and_duplicates(tmp_path: Path) -> None:
    report = check_host_capacity(paths=["~", "~", str(tmp_path)])
    assert [p.path for p in report.paths] == ["~", str(tmp_path)]
    assert report.paths[0].real_path == os.path.realpath(os.path.expanduser("~"))


def test_need_more_than_any_disk_has_fails(tmp_path: Path) -> None:
    need = (os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize) / GIB + 50
    report = check_host_capacity(paths=[str(tmp_path)], need_gib=need)
    advice = {a.rule: a for a in report.advice}
    assert advice["disk_space"].status == "fail"
    assert str(tmp_path) in advice["disk_space"].reason
    assert report.verdict == "fail"
    assert report.staging_need_gib == pytest.approx(need * host.STAGING_FACTOR, abs=0.01)


@pytest.mark.parametrize("bad", [0, -3.0, float("nan")])
def test_bad_need_gib(bad: float) -> None:
    with pytest.raises(InvalidInputError) as err:
        check_host_capacity(need_gib=bad)
    assert err.value.remedy


def test_empty_path_is_refused() -> None:
    with pytest.raises(InvalidInputError):
        check_host_capacity(paths=["/", "  "])


# --- the rules on the seed's host ------------------------------------------------------------


def _fs(mount: str, dev: int, total_gib: float, free_gib: float, fstype: str = "ext4", paths=()):
    return FilesystemReport(
        st_dev=dev,
        mount_point=mount,
        device=f"/dev/sd{dev}",
        fstype=fstype,
        total_bytes=int(total_gib * GIB),
        free_bytes=int(free_gib * GIB),
        total_gib=total_gib,
        free_gib=free_gib,
        paths=list(paths),
    )


def _path(given: str, real: str, fs: FilesystemReport) -> PathReport:
    return PathReport(
        path=given,
        real_path=real,
        is_symlink=given != real,
        exists=True,
        measured_at=real,
        mount_point=fs.mount_point,
        device=fs.device,
        fstype=fs.fstype,
        st_dev=fs.st_dev,
        total_bytes=fs.total_bytes,
        free_bytes=fs.free_bytes,
    )


def seed_host(swap_gib: float = 0.0, hf: str | None = None) -> Facts:
    """The seed's n1-standard-2: MemTotal 7614824 kB, no swap; / 8.1 GiB free, /tmp its own
    3.6 GiB filesystem, ~/.cache a symlink onto /opt1 (187 GiB free)."""
    hf = hf or str(host.hf_cache_dir())
    root = _fs("/", 1, 31.3, 8.1, paths=["/"])
    tmp = _fs("/tmp", 2, 3.63, 3.63, paths=["/tmp"])
    opt1 = _fs("/opt1", 3, 245.0, 187.1, paths=["~/.cache", hf])
    paths = [
        _path("/", "/", root),
        _path("/tmp", "/tmp", tmp),
        _path("~/.cache", "/opt1/cache", opt1),
        _path(hf, "/opt1/cache/huggingface/hub", opt1),
    ]
    return Facts(
        paths=paths,
        filesystems=[root, tmp, opt1],
        memory=MemoryReport(
            ram_total_bytes=7614824 * 1024,
            ram_available_bytes=7_000_000_000,
            swap_total_bytes=int(swap_gib * GIB),
            swap_used_bytes=0,
            swap_free_bytes=int(swap_gib * GIB),
        ),
        need_gib=None,
        root_st_dev=1,
        tmp=paths[1],
        tmp_st_dev=2,
    )


def test_seed_host_needs_a_swapfile_on_the_big_disk() -> None:
    advice = {a.rule: a for a in evaluate_rules(seed_host())}
    swap = advice["memory_staging"]
    assert swap.status == "fail"
    assert "OOM" in swap.reason
    assert swap.commands == [
        "sudo fallocate -l 12G /opt1/swapfile",
        "sudo chmod 600 /opt1/swapfile",
        "sudo mkswap /opt1/swapfile",
        "sudo swapon /opt1/swapfile",
        "echo '/opt1/swapfile none swap sw 0 0' | sudo tee -a /etc/fstab",
    ]
    # the seed's fix: a 16 GiB swapfile; afterwards the rule is satisfied
    fixed = {a.rule: a for a in evaluate_rules(seed_host(swap_gib=16))}
    assert fixed["memory_staging"].status == "ok"


def test_swapfile_too_big_for_every_disk_gives_no_command() -> None:
    """48 GiB of weights on the seed's host: a 72 GiB swapfile fits on /opt1 (187 GiB free);
    900 GiB of weights would need a 1,348 GiB one, which no disk there can hold."""
    fits = {a.rule: a for a in evaluate_rules(seed_host().model_copy(update={"need_gib": 48.0}))}
    assert fits["memory_staging"].commands[0] == "sudo fallocate -l 72G /opt1/swapfile"
    huge = {a.rule: a for a in evaluate_rules(seed_host().model_copy(update={"need_gib": 900.0}))}
    staging = huge["memory_staging"]
    assert staging.status == "fail" and staging.commands == []
    assert "1348 GiB swapfile would be needed" in staging.reason
    assert "no measured disk filesystem has that much free space" in staging.reason


def test_seed_host_tmp_is_small_and_hf_cache_fits() -> None:
    advice = {a.rule: a for a in evaluate_rules(seed_host())}
    tmp = advice["tmp_small"]
    assert tmp.status == "warn"
    assert "3.6 GiB" in tmp.reason
    assert tmp.commands == ["mkdir -p /opt1/tmp", "export TMPDIR=/opt1/tmp"]
    assert advice["disk_space"].status == "ok"  # the HF cache lives on /opt1


def test_hf_cache_on_the_small_root_disk_warns() -> None:
    facts = seed_host()
    root = facts.filesystems[0]
    hf = str(host.hf_cache_dir())
    facts.paths[3] = _path(hf, "/root/.cache/huggingface/hub", root)
    disk = {a.rule: a for a in evaluate_rules(facts)}["disk_space"]
    assert disk.status == "warn"
    assert "8.1 GiB free on /" in disk.reason
    assert "export HF_HOME=/opt1/huggingface" in disk.commands


def test_need_gib_checks_every_path() -> None:
    facts = seed_host().model_copy(update={"need_gib": 9.0})
    disk = {a.rule: a for a in evaluate_rules(facts)}["disk_space"]
    assert disk.status == "fail"
    assert "/tmp" in disk.reason and "/ (8.1 GiB free" in disk.reason
    assert "~/.cache" not in disk.reason


# --- the doctor's registry -------------------------------------------------------------------


def test_doctor_contains_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    def good(ctx: DoctorContext) -> Check:
        return Check(name="good", status="ok", detail=f"need {ctx.need_gib}")

    def check_broken_area(_ctx: DoctorContext) -> Check:
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor_mod, "CHECKS", [good, check_broken_area])
    report = doctor_mod.doctor(need_gib=3)
    assert [c.name for c in report.checks] == ["good", "broken area"]
    assert report.checks[0].detail == "need 3"
    assert report.checks[1].status == "fail" and "boom" in report.checks[1].detail
    assert report.status == "fail"


def test_path_under_a_file_is_measured_not_fatal(tmp_path: Path) -> None:
    afile = tmp_path / "weights.safetensors"
    afile.write_bytes(b"x")
    report = check_host_capacity(paths=[str(afile / "sub"), str(afile)])
    below, itself = report.paths
    assert below.exists is False and "Not a directory" in below.note
    assert below.measured_at == str(afile)
    assert itself.exists and "a file" in itself.note


def test_doctor_context_computes_each_report_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later area's check reuses the host/GPU reports instead of probing again."""
    calls: list[str] = []
    real = host.check_host_capacity

    def counting(**kwargs):
        calls.append("host")
        return real(**kwargs)

    monkeypatch.setattr(host, "check_host_capacity", counting)

    def also_wants_host(ctx: DoctorContext) -> Check:
        return Check(name="reuse", status="ok", detail=ctx.host().verdict)

    monkeypatch.setattr(doctor_mod, "CHECKS", [doctor_mod.check_host, also_wants_host])
    report = doctor_mod.doctor()
    assert calls == ["host"]
    assert report.checks[-1].name == "reuse"
