"""Every Triton kernel of the engine is launched through `run_kernel`, so a warm-up can compile them
all at once instead of one after another.

Why: a cold start spends most of its time compiling kernels (one per kernel and specialisation:
each GEMV and mma tiling, each batch bucket, each prompt-path kernel), and the model's code
launches them in order, so each compile waits for the one before. Triton compiles mostly outside
the GIL (its MLIR passes and ptxas), and its `AsyncCompileMode` hands each compile to an
executor. Inside `compile_ahead`, `run_kernel` asks Triton for the kernel (`warmup`: compile, do not
run) and returns at once; the warm-up walks the decode step of every bucket and the prompt reads
that way, then leaves the block once every compile has finished, and the real warm-up that
follows (graph capture, prompt reads) finds every kernel compiled.

Nothing runs on the device from a Triton kernel inside the block, so what the step computes
there is garbage: only the warm-up may use it, and tuning is off inside it (`compiling_only`:
`engine.kernels.tuning.autotune_enabled` says no), because timing kernels that do not run would
store wrong choices.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

_COMPILE_ONLY: ContextVar[bool] = ContextVar("gpurig_compile_only", default=False)
_PDL: ContextVar[bool] = ContextVar("gpurig_pdl", default=False)


@contextlib.contextmanager
def pdl_launches(on: bool = True) -> Iterator[None]:
    """Inside: the kernels that declare `PDL` launch with programmatic dependent launch
    (engine/kernels/pdl.py; the decode graphs of few rows are captured so, where
    `pdl_supported`)."""
    token = _PDL.set(on)
    try:
        yield
    finally:
        _PDL.reset(token)


def pdl_enabled() -> bool:
    return _PDL.get()


@functools.cache
def _declares_pdl(kernel: Any) -> bool:
    return "PDL" in getattr(kernel, "arg_names", ())


def run_kernel(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, or inside `compile_ahead` only its compile (queued)."""
    if _PDL.get() and _declares_pdl(kernel):
        kwargs = {**kwargs, "PDL": True, "launch_pdl": True}
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
        return
    kernel[grid](*args, **kwargs)


def compiling_only() -> bool:
    """True inside `compile_ahead`: launches compile and do not run."""
    return _COMPILE_ONLY.get()


def default_threads() -> int:
    """Compile threads for a warm-up: the host's cores (at most 32); 1 compiles serially."""
    return max(1, min(32, os.cpu_count() or 1))


@contextlib.contextmanager
def compile_ahead(threads: int) -> Iterator[bool]:
    """Inside: every `run_kernel` queues its kernel's compile on `threads` threads and runs nothing.
    On leaving, every queued compile has finished (kept in Triton's in-process cache and its
    disk cache). Yields False, and launches run as usual, where it cannot help: one thread, or
    a Triton without AsyncCompileMode (added in Triton 3.4)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None  # noqa: N806
    if threads <= 1 or AsyncCompileMode is None:
        yield False
        return
    token = _COMPILE_ONLY.set(True)
    try:
        # a compile that fails is left to fail again in the real launch that follows, with
        # Triton's own error there (ignore_errors), not here with a warm-up's
        with (
            ThreadPoolExecutor(threads, thread_name_prefix="gpurig-compile") as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            yield True
    finally:
        _COMPILE_ONLY.reset(token)
