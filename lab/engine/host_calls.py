"""What the host calls made for each new request cost on the GPU's machine: the driver's memory
query behind `engine.memory.available_bytes` (run once per request with max_tokens, by
`plan_prompt`), with the GPU idle and while it runs a kernel, beside the allocator's own counters
and `torch.cuda.empty_cache` (called there under a memory cap).

    python3 -m lab.engine.host_calls --out $OUT/host_calls.json [--calls 200]

Why: in the engine process, the host's time before the decode steps that came late at c = 8
went to its loop (messages in, outputs out, new requests added), 2.1 ms per late step
(bench/NOTES.md v26); adding a request asks the driver for its free memory. Each figure is the
wall time of one call in microseconds: median, 90th percentile, max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

BUSY_CYCLES = 2_000_000_000  # a kernel that keeps the GPU busy for about a second


def timed(call: Callable[[], object], n: int) -> dict[str, float]:
    walls = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        walls.append((time.perf_counter() - t0) * 1e6)
    walls.sort()
    return {
        "median_us": round(statistics.median(walls), 2),
        "p90_us": round(walls[int(0.9 * (len(walls) - 1))], 2),
        "max_us": round(walls[-1], 2),
        "calls": n,
    }


def measure(n: int) -> dict[str, object]:
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    keep = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # a reserved segment
    del keep
    calls: dict[str, Callable[[], object]] = {
        "mem_get_info": lambda: torch.cuda.mem_get_info(0),
        "memory_allocated+reserved": lambda: (
            torch.cuda.memory_allocated(0),
            torch.cuda.memory_reserved(0),
        ),
        "empty_cache": torch.cuda.empty_cache,
    }
    out: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    for state in ("idle", "busy"):
        for name, call in calls.items():
            if state == "busy":
                torch.cuda._sleep(BUSY_CYCLES)  # queued: the calls below run while it does
            out[f"{name} ({state})"] = timed(call, n if name != "empty_cache" else n // 4)
            if state == "busy":
                t0 = time.perf_counter()
                torch.cuda.synchronize()
                out[f"{name} (busy): kernel still running after the calls, ms"] = round(
                    (time.perf_counter() - t0) * 1e3, 1
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    result = measure(args.calls)
    from tools.fileio import write_atomic

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
