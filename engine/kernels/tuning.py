"""Per-GPU tile configurations: tuned on the device at first use, then read from a cache file.

A kernel's best tiling depends on the weight shape and on the card, so each (kernel, shape, dtype)
gets its own configuration. The first time a shape is seen on a GPU, the kernel times a short
list of candidates (outside any CUDA-graph capture) and keeps the fastest; the choice is written
to one JSON file per GPU name under the cache directory, so later runs start tuned.

Both settings (first-use tuning on or off, the cache directory) are a frozen `TuningSettings`
that the engine owns (made from EngineOptions.autotune and tuning_cache_dir at load) and puts in
force around its own work with `tuning_settings`: a ContextVar, so two engines in one process
keep their own, and a thread that launches kernels sees the settings of the engine it steps
(the engine's runner sets them in each call that launches kernels, on whatever thread makes
it). Outside an engine (tests, the lab's instruments) the defaults hold: tuning on, the
default directory. The in-process copy of the tables is a memo keyed by directory and card.

Configurations shipped with the package (``engine/kernels/configs/<gpu>.json``, measured on the
lent H200) are used when the cache has no entry, so a known card needs no tuning at all. A card
with none of its own takes those of the shipped card of its architecture (SHIPPED_FOR: every
Hopper the H200's), as every H100 figure in lab/journal.md was measured: tuning each GEMV shape
at the first start costs an H100 about 100 s, which put its first start past a minute.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from engine.kernels.launch import compiling_only

_BUNDLED_DIR = Path(__file__).with_name("configs")
_LOCK = threading.Lock()
# (cache directory, card) -> its merged tables: the shipped ones overlaid by the cache file
_TABLE_CACHE: dict[tuple[Path, str], dict[str, dict[str, Any]]] = {}
# compute capability -> the card whose shipped tables stand in for an unshipped one of it
SHIPPED_FOR: MappingProxyType[tuple[int, int], str] = MappingProxyType({(9, 0): "NVIDIA_H200"})
_STAND_IN_MEMO: dict[str, str] = {}  # a card's name -> the shipped card whose tables it reads


@dataclass(frozen=True)
class TuningSettings:
    """First-use tuning on or off, and where the tuned tables live (None: the default)."""

    autotune: bool = True
    cache_dir: Path | None = None

    @property
    def directory(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        return Path.home() / ".cache" / "gpurig" / "kernels"


DEFAULT_TUNING = TuningSettings()
_IN_FORCE: ContextVar[TuningSettings] = ContextVar("gpurig_tuning", default=DEFAULT_TUNING)


@contextlib.contextmanager
def tuning_settings(settings: TuningSettings) -> Iterator[None]:
    """Inside: the tuning lookups of this thread (and of the context it runs) use `settings`."""
    token = _IN_FORCE.set(settings)
    try:
        yield
    finally:
        _IN_FORCE.reset(token)


def current() -> TuningSettings:
    """The settings in force here (the defaults outside any `tuning_settings`)."""
    return _IN_FORCE.get()


def cache_dir() -> Path:
    """Where tuned configurations live under the settings in force."""
    return current().directory


def autotune_enabled() -> bool:
    """First-use tuning is on unless the settings in force turn it off, and never while launches
    only compile (engine.kernels.launch.compile_ahead: timing kernels that do not run would store
    wrong choices; the real warm-up after it tunes)."""
    return current().autotune and not compiling_only()


@functools.cache
def shipped_table(kernel: str, gpu: str) -> dict[str, dict[str, Any]]:
    """A kernel's table measured on a GPU model and shipped with the package
    (configs/<kernel>_<gpu>.json; empty if there is none or it cannot be read)."""
    try:
        return json.loads((_BUNDLED_DIR / f"{kernel}_{shipped_card(gpu)}.json").read_text())
    except (OSError, ValueError):
        return {}


def gpu_key(device: torch.device | int | None = None) -> str:
    """A file-name-safe name for the card, e.g. 'NVIDIA_H200' (configs are per GPU model).
    Notes which shipped card's tables the card reads (`stand_in`)."""
    name = torch.cuda.get_device_name(device)
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "unknown_gpu"
    if key not in _STAND_IN_MEMO:
        _STAND_IN_MEMO[key] = stand_in(key, torch.cuda.get_device_capability(device))
    return key


def stand_in(gpu: str, capability: tuple[int, int]) -> str:
    """The card whose shipped tables `gpu` reads: its own where the package has them, else the
    shipped card of its compute capability (SHIPPED_FOR), else its own (none: it tunes)."""
    if (_BUNDLED_DIR / f"{gpu}.json").is_file():
        return gpu
    return SHIPPED_FOR.get(tuple(capability), gpu)


def shipped_card(gpu: str) -> str:
    """The shipped card whose tables `gpu` reads (its own name until `gpu_key` saw it)."""
    return _STAND_IN_MEMO.get(gpu, gpu)


def write_atomic(path: Path, data: str | bytes) -> None:
    """temp + fsync + rename: a crash never leaves a half-written cache file (a tile table, a
    built kernel)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _table(gpu: str) -> dict[str, dict[str, Any]]:
    """The merged configs for one GPU: the shipped card's (its own or its stand-in's)
    overlaid by the user's cache file for this card (in the directory in force)."""
    key = (cache_dir(), gpu)
    if key not in _TABLE_CACHE:
        merged = _read_json(_BUNDLED_DIR / f"{shipped_card(gpu)}.json")
        for kernel, entries in _read_json(key[0] / f"{gpu}.json").items():
            merged.setdefault(kernel, {}).update(entries)
        _TABLE_CACHE[key] = merged
    return _TABLE_CACHE[key]


def lookup(kernel: str, key: str, gpu: str) -> dict[str, Any] | None:
    """The stored configuration for (kernel, shape key) on this GPU, or None."""
    with _LOCK:
        return _table(gpu).get(kernel, {}).get(key)


def store(kernel: str, key: str, gpu: str, config: dict[str, Any]) -> None:
    """Remember a tuned configuration in memory and in the cache file (atomically)."""
    with _LOCK:
        _table(gpu).setdefault(kernel, {})[key] = config
        path = cache_dir() / f"{gpu}.json"
        on_disk = _read_json(path)
        on_disk.setdefault(kernel, {})[key] = config
        # a read-only home still runs, tuned for this process only
        with contextlib.suppress(OSError):
            write_atomic(path, json.dumps(on_disk, indent=1, sort_keys=True))


def forget_memory() -> None:
    """Drop the in-process tables (tests rewrite the cache files and read them again)."""
    with _LOCK:
        _TABLE_CACHE.clear()


def time_graph_us(calls: list[Callable[[], Any]], repeats: int = 5) -> float:
    """Median microseconds per call, replaying one CUDA graph of all `calls` `repeats` times.

    Each call should read a different copy of the data (rotate more bytes than the L2 holds), so
    the figure is the cost of a read from device memory, as in a decode step, not from cache.
    Graph replay removes the Python launch cost that would swamp a kernel of a few microseconds.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    times.sort()
    return times[len(times) // 2]


def pick_fastest(
    candidates: Iterable[dict[str, Any]], make_calls: Callable[[dict[str, Any]], list[Callable]]
) -> tuple[dict[str, Any], float, list[tuple[dict[str, Any], float]]]:
    """Time every candidate with `time_graph_us`; a candidate that fails to compile is skipped."""
    results: list[tuple[dict[str, Any], float]] = []
    for cfg in candidates:
        try:
            us = time_graph_us(make_calls(cfg))
        except Exception:  # noqa: BLE001 - an invalid tiling (too much shared memory) just loses
            torch.cuda.synchronize()
            continue
        results.append((cfg, us))
    if not results:
        raise RuntimeError("no kernel configuration ran")
    best, best_us = min(results, key=lambda r: r[1])
    return best, best_us, results
