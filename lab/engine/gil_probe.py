"""What a small host op costs the engine thread while another thread of the process runs Python.

    python3 -m lab.engine.gil_probe [--out x.json] [--intervals 0.005,0.0005]

Why: the engine thread prepares and launches each decode step in the server's process, beside
the event loop and the request-parsing threads. PyTorch's Python bindings release the
interpreter lock around every op they dispatch, so each op hands the lock to a thread that is
waiting for it, and must wait to get it back: up to the switch interval (`sys.setswitchinterval`)
while that thread runs Python. numpy's small ops and plain Python keep the lock. This probe times
a few ops of each kind, alone and beside one thread spinning in Python, for each switch
interval given (bench/NOTES.md v24: the admissions' "prepare" phase).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

SMALL = 64


def _ops() -> dict[str, Callable[[], object]]:
    t = torch.zeros(SMALL)
    a = np.zeros(SMALL)
    ints = list(range(SMALL))
    return {
        "torch in-place add": lambda: t.add_(1),
        "torch slice": lambda: t[: SMALL // 2],
        "torch.tensor from a list": lambda: torch.tensor(ints),
        "numpy add": lambda: np.add(a, 1, out=a),
        "numpy array from a list": lambda: np.array(ints),
        "python list comprehension": lambda: [i * 2 for i in ints],
    }


def _mean_us(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _beside_a_busy_thread(fn: Callable[[], object], n: int) -> float:
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    time.sleep(0.05)  # the spinner holds the lock in turns from here
    try:
        return _mean_us(fn, n)
    finally:
        stop.set()
        thread.join()


def probe(intervals: list[float], n_alone: int = 2000, n_busy: int = 100) -> dict[str, object]:
    """Mean microseconds per op, alone and beside a spinning thread, per switch interval."""
    before = sys.getswitchinterval()
    rows = []
    try:
        for interval in intervals:
            sys.setswitchinterval(interval)
            for name, fn in _ops().items():
                rows.append({
                    "switch_interval_ms": interval * 1000,
                    "op": name,
                    "alone_us": round(_mean_us(fn, n_alone), 2),
                    "beside_busy_thread_us": round(_beside_a_busy_thread(fn, n_busy), 2),
                })  # fmt: skip
    finally:
        sys.setswitchinterval(before)
    return {"python": sys.version.split()[0], "torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file for the result")
    ap.add_argument("--intervals", default="0.005,0.0005", help="switch intervals, seconds")
    args = ap.parse_args(argv)
    result = probe([float(x) for x in args.intervals.split(",")])
    for row in result["rows"]:
        print(f"{row['switch_interval_ms']:5.1f} ms  {row['op']:28s} alone {row['alone_us']:8.1f} "
              f"us  beside a busy thread {row['beside_busy_thread_us']:9.1f} us")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
