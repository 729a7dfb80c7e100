"""Where a batched decode step's GPU time goes: the eager step of B rows under torch.profiler,
kernel time summed by kernel name (device time, so launch gaps do not count).

    python3 -m bench.engine.batch_profile --out $OUT/batch_profile.json [--rows 1,2,8,16]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine.batch_bench import E2B_DIR, load, make


def profile_rows(eng, rows: int, steps: int = 5) -> dict:
    runner, pool = eng.scheduler.runner, eng.pool
    dev = eng.device
    tokens = torch.full((rows,), 1000, dtype=torch.int64, device=dev)
    positions = torch.full((rows,), 600, dtype=torch.int64, device=dev)
    slots = torch.full((rows,), pool.pad_slot, dtype=torch.int32, device=dev)
    # padding rows: the padding slot, whose table row points at block 0 for every position
    step = runner._step
    for _ in range(3):
        step(tokens, positions, slots)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(tokens, positions, slots)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[ev.name[:90]]
            entry[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time
            entry[1] += 1
    total = sum(v[0] for v in by_name.values()) / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "rows": rows,
        "kernel_us_per_step": round(total, 1),
        "top": [
            {"kernel": k, "us_per_step": round(v[0] / steps, 1), "calls_per_step": v[1] // steps}
            for k, v in top
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=E2B_DIR)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", default="1,2,8,16")
    args = ap.parse_args(argv)
    make(args.ckpt)
    eng = load(args.ckpt, max_context=4096, max_num_seqs=16, warm_up=False)
    eng.scheduler.close()
    result = {"profiles": [profile_rows(eng, int(r)) for r in args.rows.split(",")]}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
