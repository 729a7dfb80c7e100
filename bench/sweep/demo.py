"""`gpurig demo`: the whole product on an embedded default, in about two minutes on a CPU.

Writes two random-weight checkpoints (the engine's `tiny` and `small` presets: two "builds" to
compare), then runs a small sweep in which the sweep itself starts each as an engine server on
a free loopback port through the lifecycle tools, measures it, and stops it: identical prompts,
input 32 and 128 tokens, concurrency 1 and 2, two repeats, 8 output tokens. Returns the sweep's
result (report path and main table).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from bench.sweep.models import SweepResult
from bench.sweep.run import Progress, run_sweep
from tools.settings import state_dir

PRESETS = ("tiny", "small")
DEMO_PLAN = {
    "input_lens": [32, 128],
    "output_len": 8,
    "concurrency": [1, 2],
    "repeats": 2,
}


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def demo_checkpoints(root: Path) -> dict[str, Path]:
    """The demo's checkpoints under `root`, written once (a few seconds) and reused. Each is
    written beside its final name and renamed into place, so a demo killed mid-write (or two
    at once) never leaves a half checkpoint that the next one would serve."""
    from engine.checkpoint_maker import make_checkpoint

    out = {}
    root.mkdir(parents=True, exist_ok=True)
    for preset in PRESETS:
        path = root / preset
        if not _complete(path):
            tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
            try:
                make_checkpoint(tmp / "ckpt", preset=preset, seed=0)
                if path.is_dir() and not _complete(path):
                    shutil.rmtree(path)  # a leftover of an interrupted demo, ours
                with contextlib.suppress(OSError):  # another demo may have won the race
                    os.rename(tmp / "ckpt", path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        out[preset] = path
    return out


def run_demo(
    work_dir: str | None = None,
    progress: Progress | None = None,
    device: str | None = None,
    out_dir: str | None = None,
) -> SweepResult:
    """Checkpoints in `work_dir` (default: the state directory's demo/), the sweep in
    `out_dir` (default: a new directory under the state directory's sweeps/)."""
    root = Path(work_dir).expanduser() if work_dir else state_dir() / "demo"
    checkpoints = demo_checkpoints(root / "checkpoints")
    targets = []
    for preset, path in checkpoints.items():
        server = {"model": str(path), "backend": "engine", "timeout_s": 300}
        if device:
            server["device"] = device
        targets.append({"label": f"engine-{preset}", "server": server})
    return run_sweep(targets=targets, out_dir=out_dir, progress=progress, **DEMO_PLAN)
