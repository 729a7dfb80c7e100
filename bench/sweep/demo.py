"""`gpurig demo`: the whole product on an embedded default, in about two minutes on a CPU.

Without vLLM: writes two random-weight checkpoints (the engine's `tiny` and `small` presets: two
"builds" to compare), then runs a small sweep in which the sweep itself starts each as an engine
server on a free loopback port through the lifecycle tools, measures it, and stops it.

With a vLLM interpreter (`vllm_python`, or GPURIG_PYTHON when it has vLLM): vLLM and the engine
serve the same `tiny` checkpoint, one after the other, and the sweep compares them. On vLLM's
CPU build the checkpoint is W4A16 where the CPU has AVX-512 (its int4 product exists only in
those kernels) and the same weights unquantized elsewhere.

Either way: identical prompts, input 32 and 128 tokens, concurrency 1 and 2, two repeats, 8
output tokens. Returns the sweep's result (report path and main table).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from bench.sweep.models import SweepResult
from bench.sweep.run import Progress, run_sweep
from tools.errors import InvalidInputError
from tools.settings import state_dir
from tools.vllm_locate import VllmDistribution, discover_vllm

PRESETS = ("tiny", "small")
DEMO_PLAN = {
    "input_lens": [32, 128],
    "output_len": 8,
    "concurrency": [1, 2],
    "repeats": 2,
}


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def demo_checkpoints(
    root: Path, presets: tuple[str, ...] = PRESETS, quantized: bool = True
) -> dict[str, Path]:
    """The demo's checkpoints under `root`, written once (a few seconds) and reused. Each is
    written beside its final name and renamed into place, so a demo killed mid-write (or two
    at once) never leaves a half checkpoint that the next one would serve."""
    from engine.checkpoint_maker import make_checkpoint

    out = {}
    root.mkdir(parents=True, exist_ok=True)
    for preset in presets:
        path = root / (preset if quantized else f"{preset}-bf16")
        if not _complete(path):
            tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
            try:
                make_checkpoint(tmp / "ckpt", preset=preset, seed=0, quantized=quantized)
                if path.is_dir() and not _complete(path):
                    shutil.rmtree(path)  # a leftover of an interrupted demo, ours
                with contextlib.suppress(OSError):  # another demo may have won the race
                    os.rename(tmp / "ckpt", path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        out[preset] = path
    return out


def cpu_has_avx512() -> bool:
    """Whether this x86 CPU has AVX-512 (Linux's flag list; False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags


def demo_vllm(vllm_python: str | None) -> VllmDistribution | None:
    """The vLLM the demo compares with: `vllm_python`'s (which must have one), else
    GPURIG_PYTHON's when it has one, else None (the two-engine demo)."""
    if vllm_python is not None:
        dist = discover_vllm(vllm_python)
        if not dist.found:
            raise InvalidInputError(
                f"{dist.python} has no vLLM, so the demo cannot compare with it",
                remedy="pass --vllm-python the interpreter of a vLLM venv (README: 'vLLM's CPU "
                "build'), or leave it out for the two-engine demo",
            )
        return dist
    if not os.environ.get("GPURIG_PYTHON"):
        return None
    dist = discover_vllm(None)
    return dist if dist.found else None


def vllm_demo_targets(root: Path, dist: VllmDistribution, device: str | None) -> list[dict]:
    """vLLM and the engine on one checkpoint, each started by the sweep in turn."""
    quantized = not dist.is_cpu or cpu_has_avx512()
    path = demo_checkpoints(root, ("tiny",), quantized=quantized)["tiny"]
    vllm = {"model": str(path), "backend": "vllm", "python_bin": dist.python, "timeout_s": 900}
    vllm["max_model_len"] = 1024
    if dist.is_cpu:
        vllm["cpu_kv_cache_gib"] = 1
    engine = {"model": str(path), "backend": "engine", "timeout_s": 300}
    if device:
        engine["device"] = device
    label = f"vllm-{dist.version}" + ("-cpu" if dist.is_cpu else "")
    return [{"label": label, "server": vllm}, {"label": "engine", "server": engine}]


def run_demo(
    work_dir: str | None = None,
    progress: Progress | None = None,
    device: str | None = None,
    out_dir: str | None = None,
    vllm_python: str | None = None,
) -> SweepResult:
    """Checkpoints in `work_dir` (default: the state directory's demo/), the sweep in
    `out_dir` (default: a new directory under the state directory's sweeps/). With a vLLM
    (`vllm_python`, or GPURIG_PYTHON's), vLLM against the engine; else two engine presets."""
    root = Path(work_dir).expanduser() if work_dir else state_dir() / "demo"
    dist = demo_vllm(vllm_python)
    if dist is not None:
        targets = vllm_demo_targets(root / "checkpoints", dist, device)
        return run_sweep(targets=targets, out_dir=out_dir, progress=progress, **DEMO_PLAN)
    checkpoints = demo_checkpoints(root / "checkpoints")
    targets = []
    for preset, path in checkpoints.items():
        server = {"model": str(path), "backend": "engine", "timeout_s": 300}
        if device:
            server["device"] = device
        targets.append({"label": f"engine-{preset}", "server": server})
    return run_sweep(targets=targets, out_dir=out_dir, progress=progress, **DEMO_PLAN)
