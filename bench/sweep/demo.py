"""`gpurig demo`: the whole product on an embedded default, in about two minutes on a CPU.

The engine always, beside whichever peers this machine has:
- a vLLM interpreter (`vllm_python`, or GPURIG_PYTHON when it has vLLM);
- a llama-server (`llama_server`, else GPURIG_LLAMA_SERVER, gpurig's own build from
  `.ci/llama-cpp-build`, or PATH) with llama.cpp's converter beside it (the build's source tree).

With a peer, they all serve the same `tiny` weights, one after the other, and the sweep compares
them: llama.cpp a GGUF exported from the checkpoint (16-bit: its converter reads no W4A16), so
then the checkpoint is bf16; with vLLM alone, W4A16 where vLLM can run it (a GPU, or a CPU with
AVX-512) and bf16 elsewhere. Without a peer: two engine presets (`tiny` and `small`, two
"builds"). `missing_peers` says how to add the ones that are absent.

Identical prompts, input 32 and 128 tokens, concurrency 1 and 2, two repeats, 8 output tokens.
Returns the sweep's result (report path and main table).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from bench.sweep.models import SweepResult
from bench.sweep.run import Progress, run_sweep
from engine import env
from tools.errors import GpurigError, InvalidInputError
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
                remedy="pass --vllm-python the interpreter of a vLLM venv (docs/serving.md: 'vLLM's CPU "
                "build'), or leave it out for the two-engine demo",
            )
        return dist
    if not env.read("GPURIG_PYTHON"):
        return None
    dist = discover_vllm(None)
    return dist if dist.found else None


def demo_llama(llama_server: str | None) -> Path | None:
    """The llama-server the demo adds: `llama_server` (which must be one), else the one gpurig
    finds when llama.cpp's converter is there too, else None."""
    from tools import llamacpp

    if llama_server is not None:
        found = llamacpp.find_binary("llama-server", llama_server)
        llamacpp.find_converter()  # raises with the build hint: the demo exports the GGUF
        return found
    try:
        found = llamacpp.find_binary("llama-server")
        llamacpp.find_converter()
    except GpurigError:
        return None
    return found


def missing_peers(dist: VllmDistribution | None, llama: Path | None) -> list[str]:
    """How to add each peer the demo runs without."""
    out = []
    if dist is None:
        out.append("vLLM: --vllm-python PY (or GPURIG_PYTHON), the python of a venv with vLLM; "
                   "docs/serving.md's 'vLLM's CPU build' makes one")  # fmt: skip
    if llama is None:
        out.append("llama.cpp: " + _llama_hint())
    return out


def _llama_hint() -> str:
    """Why llama.cpp is not in the demo: no build, or a build whose converter cannot run here."""
    from tools import llamacpp

    try:
        llamacpp.find_binary("llama-server")
        llamacpp.find_converter()
    except GpurigError as exc:
        if "converter needs" in exc.message:
            return f"{exc.message}: {exc.remedy}"
    return ("--llama-server PATH, or build it once: .ci/llama-cpp-build "
            "(about 6 minutes on 2 cores)")  # fmt: skip


def _gguf_of(checkpoint: Path) -> Path:
    """The checkpoint's f16 GGUF beside it, exported once (llama.cpp's converter writes it
    beside its final name and it is moved into place: a killed demo leaves no half file)."""
    from tools import llamacpp

    gguf = checkpoint.with_suffix(".gguf")
    if not llamacpp.is_gguf(gguf):
        gguf.unlink(missing_ok=True)
        llamacpp.export_gguf(checkpoint, gguf, outtype="f16")
    return gguf


def peer_demo_targets(
    root: Path, dist: VllmDistribution | None, llama: Path | None, device: str | None
) -> list[dict]:
    """The engine, vLLM and llama.cpp (those present) on one checkpoint's weights, each started
    by the sweep in turn."""
    quantized = llama is None and dist is not None and (not dist.is_cpu or cpu_has_avx512())
    path = demo_checkpoints(root, ("tiny",), quantized=quantized)["tiny"]
    engine = {"model": str(path), "backend": "engine", "timeout_s": 300}
    if device:
        engine["device"] = device
    targets = [{"label": "engine", "server": engine}]
    if dist is not None:
        vllm = {"model": str(path), "backend": "vllm", "python_bin": dist.python,
                "timeout_s": 900, "max_model_len": 1024}  # fmt: skip
        if dist.is_cpu:
            vllm["cpu_kv_cache_gib"] = 1
        label = f"vllm-{dist.version}" + ("-cpu" if dist.is_cpu else "")
        targets.append({"label": label, "server": vllm})
    if llama is not None:
        server = {"model": str(_gguf_of(path)), "backend": "llamacpp", "server_bin": str(llama),
                  "max_model_len": 1024, "max_num_seqs": 2, "timeout_s": 300}  # fmt: skip
        targets.append({"label": "llama.cpp", "server": server, "model_dir": str(path)})
    return targets


def run_demo(
    work_dir: str | None = None,
    progress: Progress | None = None,
    device: str | None = None,
    out_dir: str | None = None,
    vllm_python: str | None = None,
    llama_server: str | None = None,
) -> SweepResult:
    """Checkpoints in `work_dir` (default: the state directory's demo/), the sweep in
    `out_dir` (default: a new directory under the state directory's sweeps/). The engine against
    the peers present (see the module docstring); without any, two engine presets."""
    root = Path(work_dir).expanduser() if work_dir else state_dir() / "demo"
    dist = demo_vllm(vllm_python)
    llama = demo_llama(llama_server)
    if dist is not None or llama is not None:
        targets = peer_demo_targets(root / "checkpoints", dist, llama, device)
        return run_sweep(targets=targets, out_dir=out_dir, progress=progress, **DEMO_PLAN)
    checkpoints = demo_checkpoints(root / "checkpoints")
    targets = []
    for preset, path in checkpoints.items():
        server = {"model": str(path), "backend": "engine", "timeout_s": 300}
        if device:
            server["device"] = device
        targets.append({"label": f"engine-{preset}", "server": server})
    return run_sweep(targets=targets, out_dir=out_dir, progress=progress, **DEMO_PLAN)
