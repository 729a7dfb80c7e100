"""Helpers for the serving tests: a real venv holding the stand-in vLLM (tests/data/fake_vllm)
laid out as pip installs a wheel, recorded GPU facts, and a private GPURIG_HOME."""

from __future__ import annotations

import shutil
from pathlib import Path

from patch_support import STOCK_0_33_0, install_fake_wheel
from venv_support import make_venv

from tools.serving import GpuDevice, GpuFacts
from tools.serving.process import free_port as free_port  # the tests import it from here

DATA = Path(__file__).parent / "data"
FAKE = DATA / "fake_vllm"
LOGS = DATA / "vllm_logs"

H200 = GpuFacts(
    source="recorded: one H200",
    devices=[GpuDevice(index=0, name="NVIDIA H200", capability=(9, 0),
                       memory_total_bytes=150_119_759_872)],
)  # fmt: skip
T4 = GpuFacts(
    source="recorded: the seeds' T4",
    devices=[GpuDevice(index=0, name="Tesla T4", capability=(7, 5),
                       memory_total_bytes=15_642_329_088)],
)  # fmt: skip
NO_GPU = GpuFacts(
    source="recorded: no driver", error="no NVIDIA driver: libnvidia-ml.so (NVML) not found"
)


def site_packages(venv_python: Path) -> Path:
    return next((venv_python.parent.parent / "lib").glob("python3*/site-packages"))


def install_fake_vllm(root: Path, version: str = "0.33.0") -> Path:
    """A venv whose vLLM is the stand-in, with the real stock 0.33.0 attention file (so the
    Turing patch tools can verify and apply on it). Returns the venv's python."""
    python = make_venv(root)
    site = site_packages(python)
    source, digest, size = STOCK_0_33_0
    install_fake_wheel(site, version, source, digest, size)
    shutil.copytree(FAKE / "vllm", site / "vllm", dirs_exist_ok=True)
    record = site / f"vllm-{version}.dist-info" / "RECORD"
    extra = [p.relative_to(site).as_posix() for p in (site / "vllm").rglob("*.py")]
    with record.open("a") as fh:
        for rel in extra:
            fh.write(f"{rel},,\n")
    return python


def scenario_env(scenario: str, log: str = "0.29") -> dict[str, str]:
    return {"FAKE_VLLM_SCENARIO": scenario, "FAKE_VLLM_LOGS": str(LOGS), "FAKE_VLLM_LOG": log}
