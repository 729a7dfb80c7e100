"""Configuration, in one place: environment variables and their defaults.

| variable        | meaning                                                    | default                      |
|-----------------|------------------------------------------------------------|------------------------------|
| GPURIG_PYTHON   | the serving interpreter (the Python that runs vLLM)        | the current interpreter      |
| GPURIG_HOME     | state directory (backups, logs, server records, results)   | $XDG_STATE_HOME/gpurig, else ~/.local/state/gpurig |
| HF_HOME / HF_HUB_CACHE | where Hugging Face keeps checkpoints (measured by check_host_capacity) | ~/.cache/huggingface/hub |
| GPURIG_TEST_WHEELS | tests only: cache of the vLLM wheels the Turing-patch network tests download | ~/.cache/gpurig-tests/vllm-wheels |
| GPURIG_KERNEL_CACHE | per-GPU tuned GEMV tilings (engine/kernels/tuning.py) | ~/.cache/gpurig/kernels |
| GPURIG_KERNEL_AUTOTUNE | "0": no first-use kernel tuning (stored or default tilings) | on |
| GPURIG_FAST / GPURIG_CUDA_GRAPH / GPURIG_DECODE / GPURIG_EPILOGUES | the engine's CUDA fast path and its parts (engine/fast/__init__.py) | on / on / fused / on |

Every CLI flag that names one of these (`--python`) wins over the variable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def serving_python(explicit: str | None = None) -> str:
    """The interpreter that runs (or would run) vLLM: the flag, else GPURIG_PYTHON, else ours."""
    return explicit or os.environ.get("GPURIG_PYTHON") or sys.executable


def state_dir() -> Path:
    """GPURIG_HOME, else the XDG state directory; created on first use."""
    env = os.environ.get("GPURIG_HOME")
    if env:
        path = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_STATE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
        path = base / "gpurig"
    path.mkdir(parents=True, exist_ok=True)
    return path


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub resolves it (without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"
