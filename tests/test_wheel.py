"""The installed distribution is the product only (issue 51, item 1), checked on a built wheel.

The wheel of this checkout is built as a user's `pip install .` builds it (build isolation:
setuptools comes from the index, hence `network`; where the index cannot be reached the test
skips and says so). It is built from a copy of the checkout's files (git's tracked and
untracked-but-not-ignored ones, as a fresh clone has them), so the build's own folders (build/,
*.egg-info) never land in the working tree and stale ones there cannot leak into the wheel.

What it must hold: the five product packages, every one of their modules (setuptools drops a
folder without __init__.py silently, since pyproject turns namespace discovery off), and
beside the code only the files the code reads at run time. What it must not: the lab, the
tests, the journal, results, any Markdown, any JSON but the kernel tuning configs.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "tools", "mcp_server", "bench", "patches")
# Files beside the code that the code opens at run time: the chat templates
# (engine/chat/template.py) and the kernel tuning tables (engine/kernels/tuning.py).
RUNTIME_DATA = ("engine/chat/*.jinja", "engine/kernels/configs/*.json")
MAX_BYTES = 2 * 1024 * 1024
# pip's words when the build environment's setuptools cannot be fetched
OFFLINE = (
    "No matching distribution found for setuptools",
    "Could not find a version that satisfies the requirement setuptools",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Max retries exceeded",
)
NOT_COPIED = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv"}


def _checkout_files() -> list[str]:
    """Repo-relative paths a fresh clone of this checkout would hold (plus new files not yet
    committed): git's view where there is one, else every file but build and cache folders."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        done = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        names = [n for n in done.stdout.split("\0") if n]
    else:
        names = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file()
            and not NOT_COPIED & set(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    return sorted(n for n in names if (ROOT / n).is_file())  # a deleted, still-tracked file: gone


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout to build from."""
    src = tmp_path_factory.mktemp("wheel-src")
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel-out")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(out),
         "--disable-pip-version-check", "--quiet"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        said = done.stdout + done.stderr
        offline = [line.strip() for line in said.splitlines() if any(w in line for w in OFFLINE)]
        if offline:
            pytest.skip(f"the build needs setuptools from the package index: {offline[0]}")
        pytest.fail(f"pip wheel failed ({done.returncode}): {said[-2000:]}")
    (found,) = out.glob("gpurig-*.whl")
    return found


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return [n for n in z.namelist() if not n.endswith("/")]


def _code_and_data(wheel: Path) -> list[str]:
    """The wheel's files but its .dist-info."""
    return [n for n in _names(wheel) if not n.split("/")[0].endswith(".dist-info")]


def test_the_wheel_is_small(wheel: Path) -> None:
    assert wheel.stat().st_size < MAX_BYTES, f"{wheel.name}: {wheel.stat().st_size} bytes"


def test_the_wheel_holds_the_product_packages_and_its_dist_info_only(wheel: Path) -> None:
    tops = {n.split("/")[0] for n in _names(wheel)}
    info = {t for t in tops if t.endswith(".dist-info")}
    assert len(info) == 1 and info.pop().startswith("gpurig-")
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PRODUCT)


def test_no_lab_tests_journal_or_results_in_the_wheel(wheel: Path) -> None:
    """No folder of the lab's or the tests', no results folder, no notes or journal (a module
    that happens to be called journal.py is code, not the lab's journal)."""
    found = [
        n
        for n in _code_and_data(wheel)
        if {"lab", "tests", "results"} & set(n.split("/")[:-1])
        or (PurePosixPath(n).stem.lower() in ("notes", "journal") and not n.endswith(".py"))
    ]
    assert found == []


def test_no_markdown_and_no_json_but_the_tuning_configs(wheel: Path) -> None:
    names = _code_and_data(wheel)
    assert [n for n in names if n.endswith(".md")] == []
    stray = [
        n for n in names if n.endswith(".json") and not n.startswith("engine/kernels/configs/")
    ]
    assert stray == []


def test_every_data_file_is_one_the_code_reads_and_all_of_them_are_there(
    wheel: Path, source: Path
) -> None:
    data = {n for n in _code_and_data(wheel) if not n.endswith(".py")}
    unread = {n for n in data if not any(fnmatch.fnmatch(n, p) for p in RUNTIME_DATA)}
    assert unread == set()
    wanted = {p.relative_to(source).as_posix() for g in RUNTIME_DATA for p in source.glob(g)}
    assert wanted and data == wanted
    # pyproject declares the same files (per package, relative to it)
    declared = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = {f"{pkg}/{p}" for pkg, ps in declared["package-data"].items() for p in ps}
    assert patterns == set(RUNTIME_DATA)


def test_every_product_module_is_in_the_wheel(wheel: Path, source: Path) -> None:
    """A product folder without __init__.py would be left out without a word."""
    modules = {
        p.relative_to(source).as_posix()
        for package in PRODUCT
        for p in (source / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert {n for n in _code_and_data(wheel) if n.endswith(".py")} == modules


def test_the_wheel_installs_the_gpurig_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(name).decode()
    assert "gpurig = mcp_server.cli:main" in entry_points
