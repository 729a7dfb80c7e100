"""Greedy tokens of the fast path against the reference path, on the GPU, per preset and dtype.

Run on a CUDA machine: `python3 -m bench.engine.greedy_identity --out results.json`. It makes each
random-weight checkpoint itself (tiny, small), loads it with a memory cap (the code path a 4 GB
card uses), and reports the agreeing prefix of fast and reference greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

import engine
from bench.engine.e2e_bench import greedy_pair
from engine.checkpoint_maker import make_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "greedy.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            ckpt = Path(tmp) / preset
            make_checkpoint(ckpt, preset=preset, seed=0)
            for dtype in (torch.float32, torch.bfloat16):
                eng = engine.load(ckpt, device="cuda", max_context=2048, memory_cap_mib=3732,
                                  dtype=dtype)  # fmt: skip
                prompt = [2] + list(range(10, 10 + 300))
                row = greedy_pair(eng, prompt, args.tokens)
                row.update(preset=preset, dtype=str(dtype).removeprefix("torch."))
                rows.append({k: v for k, v in row.items() if k not in ("fast", "reference")})
                print(rows[-1], flush=True)
                del eng
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                         indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
