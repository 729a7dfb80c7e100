"""The Turing patch on the real vLLM wheels from PyPI: install, locate, apply, verify, revert.

One release per distinct version of the target file (0.29.0 = 0.26.0-0.29.0, 0.31.0 = 0.30.0-
0.31.0, 0.32.0, 0.33.0), plus 0.22.0, whose different layout must be refused. Each wheel is
installed with `pip install --no-deps` into a throwaway venv (0.29.0 also into a PYTHONUSERBASE
user site, as on the seeds' host), then the tools run against it through that interpreter,
exactly as for a user.

The wheels (260-340 MB each) are downloaded once per machine with `pip download --no-deps` into
$GPURIG_TEST_WHEELS (default ~/.cache/gpurig-tests/vllm-wheels), outside the clone, and reused.
Offline: `pytest -m "not network"`.
"""

from __future__ import annotations

import fcntl
import os
import py_compile
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from patch_support import BUDGET, SPEC, run_tile_path, smem_need, user_site

from patches.engine import record_hash
from tools.errors import RefusedError
from tools.turing import (
    apply_turing_patch,
    require_turing_patch,
    revert_turing_patch,
    verify_turing_patch,
)

pytestmark = [pytest.mark.network, pytest.mark.slow]

# One release per distinct version of the file; the same list the refusal's remedy names.
SUPPORTED = list(SPEC.tested_versions)
UNSUPPORTED_LAYOUT = "0.22.0"
WHEEL_CACHE = Path(
    os.environ.get("GPURIG_TEST_WHEELS", "~/.cache/gpurig-tests/vllm-wheels")
).expanduser()


def wheel(version: str) -> Path:
    """The cached wheel of vllm==version, downloaded on first use (one process at a time)."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    with open(WHEEL_CACHE / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(WHEEL_CACHE.glob(f"vllm-{version}-*.whl"))
        if not found:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--disable-pip-version-check", "--quiet", f"vllm=={version}",
                 "-d", str(WHEEL_CACHE)],
                capture_output=True, text=True, timeout=1200,
            )  # fmt: skip
            found = sorted(WHEEL_CACHE.glob(f"vllm-{version}-*.whl"))
            if proc.returncode != 0 or not found:
                pytest.fail(
                    f"could not download vllm=={version} into {WHEEL_CACHE} "
                    f"({proc.stderr.strip()[-300:]}); run offline with -m 'not network'"
                )
    return found[-1]


def record_entry(whl: Path) -> tuple[str, int]:
    """The target file's (sha256, size) as the wheel's own RECORD lists it, read from the zip."""
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        for line in z.read(name).decode().splitlines():
            path, digest, size = line.rsplit(",", 2)
            if path == SPEC.target:
                return digest.removeprefix("sha256="), int(size)
    raise AssertionError(f"{SPEC.target} not in {whl.name}'s RECORD")


def pip_install(python: str, whl: Path, *extra: str, env: dict | None = None) -> None:
    """`pip install --no-deps WHEEL` for `python` (pip's --python option: no pip in the venv)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-compile",
         "--quiet", "--disable-pip-version-check", *extra, str(whl)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(autouse=True)
def gpurig_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "gpurig-home"))
    monkeypatch.delenv("GPURIG_PYTHON", raising=False)
    return tmp_path / "gpurig-home"


@pytest.fixture
def venv_with(tmp_path: Path) -> Iterator:
    """install(version) -> the python of a fresh venv holding that vLLM wheel (removed after)."""
    made: list[Path] = []

    def install(version: str) -> str:
        root = tmp_path / f"venv-{version}"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
        )
        made.append(root)
        python = str(root / "bin" / "python")
        pip_install(python, wheel(version))
        return python

    yield install
    for root in made:  # ~800 MB each: do not leave them in the pytest temp folders
        shutil.rmtree(root, ignore_errors=True)


def test_every_distinct_file_is_proven() -> None:
    """0.26.0-0.29.0 share one file, 0.30.0-0.31.0 another; 0.32.0 and 0.33.0 each differ."""
    assert {"0.29.0", "0.31.0", "0.32.0", "0.33.0"} <= set(SUPPORTED)


@pytest.mark.parametrize("version", SUPPORTED)
def test_real_wheel_locate_apply_verify_revert(version: str, venv_with, gpurig_home) -> None:
    whl = wheel(version)
    digest, size = record_entry(whl)
    python = venv_with(version)

    before = verify_turing_patch(python)
    assert (before.vllm_version, before.state_after, before.record_sha256) == (
        version,
        "stock",
        digest,
    )
    target = Path(before.path)
    assert target.is_relative_to(Path(python).parent.parent)
    stock = target.read_bytes()
    assert len(stock) == size and record_hash(stock) == digest
    mode = target.stat().st_mode & 0o7777

    applied = apply_turing_patch(python)
    assert (applied.state_before, applied.state_after, applied.occurrences) == (
        "stock",
        "patched",
        1,
    )
    assert applied.clamp_present and applied.verdict == "CLAMP PRESENT"
    py_compile.compile(str(target), cfile=str(gpurig_home / "check.pyc"), doraise=True)
    assert target.stat().st_mode & 0o7777 == mode
    assert Path(applied.backup).read_bytes() == stock
    patched = target.read_bytes()

    twice = apply_turing_patch(python)
    assert (twice.changed, twice.occurrences) == (False, 1) and target.read_bytes() == patched
    assert require_turing_patch(python, (7, 5)).state_after == "patched"

    # the clamp in this release's real file does the right thing
    text = patched.decode()
    r = run_tile_path(text, (7, 5), 512, "float16")
    assert (r["prefill"], r["decode"], r["stages"]) == (16, 16, 1)
    assert max(smem_need(16, t, 512, 2) for t in (r["prefill"], r["decode"])) <= BUDGET
    assert run_tile_path(text, (7, 5), 256)["stages"] is None
    for cap in [(8, 0), (9, 0), None]:
        assert (
            run_tile_path(text, cap, 512)["prefill"],
            run_tile_path(text, cap, 512)["stages"],
        ) == (32, None)

    reverted = revert_turing_patch(python)
    assert (reverted.state_before, reverted.state_after) == ("patched", "stock")
    assert target.read_bytes() == stock and record_hash(target.read_bytes()) == digest
    assert verify_turing_patch(python).state_after == "stock"
    with pytest.raises(RefusedError):
        require_turing_patch(python, (7, 5))


def test_real_wheel_0_22_0_layout_refused(venv_with) -> None:
    python = venv_with(UNSUPPORTED_LAYOUT)
    report = verify_turing_patch(python)
    assert (report.vllm_version, report.state_after) == (UNSUPPORTED_LAYOUT, "stock")
    target = Path(report.path)
    before = target.read_bytes()
    with pytest.raises(RefusedError, match="layout not recognised") as err:
        apply_turing_patch(python)
    assert "launch_kwargs" in err.value.message and "left as it is" in err.value.message
    assert target.read_bytes() == before
    assert verify_turing_patch(python).state_after == "stock"


def test_real_wheel_in_a_pythonuserbase_user_site(tmp_path: Path, monkeypatch) -> None:
    """The seeds' layout: vLLM installed with `pip install --user` under PYTHONUSERBASE."""
    import site

    if not site.ENABLE_USER_SITE:
        pytest.skip("user site disabled for this interpreter (a venv?)")
    userbase = tmp_path / "pyuser"
    monkeypatch.setenv("PYTHONUSERBASE", str(userbase))
    try:
        pip_install(sys.executable, wheel("0.29.0"), "--user", "--no-warn-script-location")
        report = apply_turing_patch(sys.executable)
        assert Path(report.path).is_relative_to(user_site(userbase))
        assert (report.vllm_version, report.state_after, report.occurrences) == (
            "0.29.0",
            "patched",
            1,
        )
        assert revert_turing_patch(sys.executable).state_after == "stock"
    finally:
        shutil.rmtree(userbase, ignore_errors=True)
