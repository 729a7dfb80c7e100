"""Shared fixtures: the installed `gpurig` console script, and bare Python interpreters.

Keep this file small and generic; area-specific helpers belong in their own test modules.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from venv_support import make_venv


@pytest.fixture(scope="session")
def gpurig_bin() -> str:
    """The `gpurig` console script that `pip install -e .` put on PATH."""
    found = shutil.which("gpurig") or str(Path(sys.executable).with_name("gpurig"))
    if not os.access(found, os.X_OK):
        pytest.fail("the gpurig console script is not installed: run `pip install -e .`")
    return found


@pytest.fixture
def run_gpurig(gpurig_bin: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `gpurig ARGS...` as a subprocess; returns the CompletedProcess (text, captured)."""

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [gpurig_bin, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
        )

    return run


@pytest.fixture
def bare_venv(tmp_path: Path) -> Path:
    """The python of a fresh venv with nothing installed (no torch, no vllm, no gpurig)."""
    return make_venv(tmp_path / "venv")
