"""Whether the warm-up's compile pass can be skipped: every kernel it would compile is already in
Triton's disk cache, as a marker left by an earlier warm-up of the same engine says.

Why: with a warm Triton cache the compile pass compiles nothing, yet it still runs every batch
bucket's step and every warm-up prompt eagerly on the host (2.4-6.6 s on the H200: lab/journal.md,
v14), only for the capture and the prompt reads that follow to run them again. After a warm-up,
a marker in the kernel-tuning cache directory records a fingerprint of everything that decides
which kernels compile (Triton, torch, the GPU, the engine's kernel sources, the model's shapes,
the sizes and options) and the Triton cache entries present then. A later start with the same
fingerprint, whose Triton cache still holds every entry, skips the pass. Any doubt runs it: a
changed source, a cleared cache, another GPU. The worst a wrong skip costs is compiles done one
after another during the capture, never a wrong result.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engine.batching import BatchingPlan
    from engine.config import TextConfig
    from engine.options import EngineOptions


class Compiling(Protocol):
    """What decides which kernels an engine compiles (engine/runtime.py's Engine has it): typed
    here, where it is read, so this module needs nothing of the engine that warms up."""

    device: torch.device
    dtype: torch.dtype
    config: TextConfig
    options: EngineOptions
    batching: BatchingPlan
    max_context: int


_SOURCES = ("kernels", "fast")  # engine/ subpackages whose code decides what Triton compiles


def facts(engine: Compiling, lengths: tuple[int, ...]) -> dict[str, Any]:
    """What decides the warm-up's compiles (see the module docstring), as plain values."""
    import dataclasses

    import torch
    import triton

    root = Path(__file__).parent
    h = hashlib.sha256()
    for sub in _SOURCES:
        for path in sorted((root / sub).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    dev = engine.device
    gpu: Any = dev.type
    if dev.type == "cuda":
        gpu = [torch.cuda.get_device_name(dev), list(torch.cuda.get_device_capability(dev))]
    options = dataclasses.replace(engine.options, compile_threads=None)
    plan = engine.batching
    geo = plan.geometry
    return {
        "sources": h.hexdigest(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "gpu": gpu,
        "config": repr(engine.config),
        "dtype": str(engine.dtype),
        "max_context": engine.max_context,
        # the plan's shapes, not its pool size (num_blocks follows the memory left at load;
        # no kernel specialises on it: the pool's row count is no launch argument)
        "batching": [plan.max_num_seqs, plan.prefill_budget, geo.block_size, geo.ring_slots],
        "options": repr(options),
        "lengths": list(lengths),
    }


def fingerprint(engine: Compiling, lengths: tuple[int, ...]) -> str:
    """A hash of `facts`: one engine's marker name."""
    return fingerprint_of(facts(engine, lengths))


def fingerprint_of(values: dict[str, Any]) -> str:
    """The hash of facts already gathered."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def triton_cache_dir() -> Path | None:
    """Triton's disk cache (its knobs: TRITON_CACHE_DIR or ~/.triton/cache); None if unknown."""
    try:
        import triton

        return Path(triton.knobs.cache.dir)
    except (ImportError, AttributeError):
        return None


def _marker(directory: Path, print_: str) -> Path:
    return directory / f"warmup-{print_[:24]}.json"


def kernels_cached(directory: Path, print_: str) -> bool:
    """True when a marker for this fingerprint exists and Triton's cache still holds every
    entry it lists."""
    return not cache_miss(directory, print_)


def cache_miss(directory: Path, print_: str, now: dict[str, Any] | None = None) -> str:
    """Why the compile pass must run ("" when it need not): no marker, Triton's cache moved or
    lost entries. `now` (this engine's `facts`) names what differs from the newest other
    marker when there is none for this fingerprint, so a start that compiles again says why."""
    cache = triton_cache_dir()
    try:
        marker = json.loads(_marker(directory, print_).read_text())
    except (OSError, ValueError):
        return _no_marker(directory, now)
    if cache is None or marker.get("fingerprint") != print_ or str(cache) != marker.get("cache"):
        return f"Triton's cache is not where the marker's was ({marker.get('cache')})"
    entries = marker.get("entries")
    if not isinstance(entries, list) or not entries:
        return "the marker lists no Triton cache entries"
    gone = [name for name in entries if not (cache / str(name)).is_dir()]
    if gone:
        return f"{len(gone)} of {len(entries)} Triton cache entries are gone"
    return ""


def _no_marker(directory: Path, now: dict[str, Any] | None) -> str:
    try:
        others = sorted(directory.glob("warmup-*.json"), key=lambda p: p.stat().st_mtime)
    except OSError:
        others = []
    if not others or now is None:
        return "no earlier warm-up of this engine"
    try:
        then = json.loads(others[-1].read_text()).get("facts") or {}
    except (OSError, ValueError):
        return "no earlier warm-up of this engine"
    differ = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    return f"an earlier warm-up differs in {', '.join(differ) or 'nothing recorded'}"


def record(directory: Path, print_: str, now: dict[str, Any] | None = None) -> None:
    """Leave the marker, with this engine's `facts` when given (atomically; a directory that
    cannot be written is skipped: the next start then runs the pass, as now)."""
    cache = triton_cache_dir()
    if cache is None or not cache.is_dir():
        return
    data: dict[str, Any] = {
        "fingerprint": print_,
        "cache": str(cache),
        "entries": sorted(p.name for p in cache.iterdir() if p.is_dir()),
        "facts": now,
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".warmup-", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, _marker(directory, print_))
    except OSError:
        Path(tmp).unlink(missing_ok=True)
