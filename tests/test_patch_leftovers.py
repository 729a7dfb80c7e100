"""The Turing patch tools against leftovers and files that are not vLLM's.

kill -9 during apply/revert left `.triton_unified_attention.py.XXXXXXXX.tmp` beside vLLM's file
(20 of 82 kills in the fuzzing of issue 12), which pip uninstall does not remove; and
turing_patch_diff(file="/dev/zero") read until MemoryError. Real files in a real venv with the
vLLM 0.33.0 file installed from its wheel's bytes (patch_support).
"""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest
from patch_support import SPEC, STOCK_0_33_0, install_fake_wheel

from tools.errors import InvalidInputError
from tools.turing import apply_turing_patch, revert_turing_patch, verify_turing_patch


@pytest.fixture(autouse=True)
def gpurig_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "gpurig-home"
    monkeypatch.setenv("GPURIG_HOME", str(home))
    monkeypatch.delenv("GPURIG_PYTHON", raising=False)
    return home


@pytest.fixture
def vllm_033(tmp_path: Path) -> tuple[str, Path]:
    root = tmp_path / "venv"
    venv.create(root, with_pip=False, symlinks=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path, digest, size = STOCK_0_33_0
    return str(python), install_fake_wheel(Path(purelib), "0.33.0", path, digest, size)


# --- leftovers of a killed apply/revert, and files that are not vLLM's ------------------------


def _leave_temp(folder: Path) -> Path:
    """What kill -9 between write_atomic's write and its rename leaves: a real mkstemp file."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix=f".{Path(SPEC.target).name}.", suffix=".tmp", dir=folder)
    os.write(fd, b"half a file")
    os.close(fd)
    return Path(name)


def test_stale_temp_files_are_reported_and_removed(vllm_033, gpurig_home) -> None:
    python, target = vllm_033
    decoys = [
        target.parent / f".{target.name}.notmine.tmp",  # 7 characters: not mkstemp's
        target.parent / f".{target.name}.abcdefgh.tmp.keep",
        target.parent / "other.py.abcdefgh.tmp",
    ]
    for decoy in decoys:
        decoy.write_text("not ours")
    first = _leave_temp(target.parent)
    report = apply_turing_patch(python, dry_run=True)  # a dry run names it, removes nothing
    assert report.stale_temp_files == [str(first)] and first.exists()
    report = apply_turing_patch(python)
    assert report.stale_temp_files == [str(first)] and not first.exists()
    backup = Path(report.backup)
    second, third = _leave_temp(target.parent), _leave_temp(backup.parent)
    report = verify_turing_patch(python)
    assert sorted(report.stale_temp_files) == sorted([str(second), str(third)])
    assert not second.exists() and not third.exists()
    assert report.state_after == "patched"
    fourth = _leave_temp(target.parent)
    report = revert_turing_patch(python)
    assert report.stale_temp_files == [str(fourth)] and not fourth.exists()
    assert report.state_after == "stock"
    assert verify_turing_patch(python).stale_temp_files == []
    assert all(d.read_text() == "not ours" for d in decoys)


def test_diff_refuses_devices_fifos_huge_and_bad_paths(tmp_path, run_gpurig) -> None:
    from tools.turing import MAX_TARGET_BYTES, patch_diff

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.py"
    with open(huge, "wb") as fh:
        fh.truncate(MAX_TARGET_BYTES + 1)  # sparse: no disk used
    cases = [
        ("/dev/zero", "not a regular file"),
        (str(fifo), "not a regular file"),
        (str(tmp_path), "is a directory"),
        (str(huge), "at most 4,194,304 are read"),
        ("a\x00b", "holds a NUL byte"),
        ("x" * 5000, "5,000 characters long"),
        ("/" + "y" * 300, "too long"),  # one component over NAME_MAX
    ]
    for file, text in cases:
        with pytest.raises(InvalidInputError, match=text) as err:
            patch_diff(file=file)
        assert "{arg:file}" in err.value.message  # names the argument, in the caller's words
        assert len(str(err.value)) < 400
    for file, text in [("/dev/zero", "--file '/dev/zero' is not a regular file")] + [
        ("x" * 5000, "the path given as --file is 5,000 characters long")
    ]:
        out = run_gpurig("patch", "diff", "--file", file)
        assert out.returncode == 2, out.stderr
        assert text in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr) < 1000
