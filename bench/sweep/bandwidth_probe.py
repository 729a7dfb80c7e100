"""The GPU read-bandwidth probe: a standalone script run BY PATH under the serving interpreter.

Like tools/gpu_probe.py it uses the standard library and torch only (the serving Python usually
lacks gpurig). It reads a large fp16 buffer with `sum` (far larger than any L2), timed with CUDA
events after a warm-up, and prints one line `GPURIG_BANDWIDTH {...}`: the median GB/s, the
device, or why there is no figure (no torch, no CUDA device, out of memory).
"""

from __future__ import annotations

import json
import os
import sys

MARKER = "GPURIG_BANDWIDTH "
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def measure(max_bytes: int = 2 << 30, iters: int = 20) -> dict:
    try:
        import torch
    except Exception as exc:
        return {"available": False, "reason": f"torch does not import: {exc}"}
    if not torch.cuda.is_available():
        return {
            "available": False,
            "reason": f"no CUDA device visible to torch {torch.__version__}",
        }
    dev = torch.device("cuda")
    free, _total = torch.cuda.mem_get_info()
    size = min(max_bytes, free // 4)
    if size < (64 << 20):
        return {"available": False, "reason": f"only {free >> 20} MiB of GPU memory free"}
    n = size // 2
    x = torch.ones(n, dtype=torch.float16, device=dev)
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    times.sort()
    median = times[len(times) // 2]
    return {
        "available": True,
        "gb_s": round(n * 2 / median / 1e9, 1),
        "bytes": n * 2,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    try:
        out = measure()
    except Exception as exc:  # report, never crash without the marker
        out = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(MARKER + json.dumps(out) + "\n")
