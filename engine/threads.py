"""How many CPU threads torch gets in the engine commands and the engine server.

Why not torch's default (one thread per core): its OpenMP threads wait for each other at every
small matmul of a decode step, so as soon as one core is busy with anything else (another
process, the server's own event loop and tokenising threads) every op waits for the descheduled
thread. Batch-1 decode is bound by memory bandwidth and gains little from more threads
(docs/engine-findings.md has the figures). So the default is the cores this process may run on
less the busy ones, at least 1 and at most MAX_DEFAULT_THREADS; the server takes one fewer
(`serve_default`). OMP_NUM_THREADS, when set, is respected; a --threads flag wins over both.
"""

from __future__ import annotations

import os

from engine import env

MAX_DEFAULT_THREADS = 8  # batch-1 decode is bound by memory bandwidth: more threads add barriers


def default_threads() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow; at
    most the physical cores, since hyperthreads share one core's FPUs) less those already busy
    (the 1-minute load average, scaled to our share of the CPUs), in 1..MAX_DEFAULT_THREADS."""
    import psutil

    total = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        usable = total
    cores = max(1, min(usable, psutil.cpu_count(logical=False) or usable))
    try:
        busy = os.getloadavg()[0] * usable / total
    except OSError:
        busy = 0.0
    return max(1, min(MAX_DEFAULT_THREADS, cores, round(cores - busy)))


def serve_default() -> int:
    """The server's default: one fewer than `default_threads`, for its own event loop and
    tokenising threads, at least 1."""
    return max(1, default_threads() - 1)


def serve_threads(threads: int | None) -> int | None:
    """The count the server sets: `threads` (its --threads), else None where OMP_NUM_THREADS
    is set (torch follows it alone), else `serve_default()`."""
    if threads is not None:
        return threads
    return None if env.omp_threads() else serve_default()


def set_threads(threads: int | None) -> int:
    """Set torch's CPU thread count: `threads`, else OMP_NUM_THREADS, else default_threads().
    Returns the number set."""
    import torch

    n = threads or env.omp_threads() or default_threads()
    torch.set_num_threads(n)
    return n
