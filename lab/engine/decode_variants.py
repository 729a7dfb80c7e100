"""Decode speed of one engine under variants of its options, in one process.

    python3 -m lab.engine.decode_variants --ckpt /tmp/gpurig_e2b_emb4 --out $OUT/variants.json

The same weights, cache and tuned tiles; each variant is a ModelRunner over the engine's model and
pool with some EngineOptions changed (its own decoder and captured CUDA graphs), so the
differences are what those options buy. Also reports whether each variant's logits are
bit-identical to the first variant's. The launch switches this script once compared (PDL, L2
prefetch, GEMV epilogue and prologue arrangements, q/k/v work in the attention) measured no
gain and are gone from the engine; bench/NOTES.md cites their results (git history keeps
the files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lab.engine.e2e_bench import E2B_DIR, decode_rate, greedy_pair, make, with_options
from lab.engine.rows import fill_rows, held_rows, step_fn

VARIANTS: dict[str, dict[str, Any]] = {  # option changes against the engine's own
    "default": {},
    "no_graph": {"cuda_graph": False},  # the fused step launched eagerly
}


def logits_of(runner, eng, depth: int = 100) -> torch.Tensor:
    with held_rows(eng, 1) as slots, torch.no_grad():
        fill_rows(eng, slots, depth)
        dec = step_fn(eng, slots, runner)
        dev = eng.device
        return dec(torch.tensor([7], device=dev), torch.tensor([depth], device=dev)).clone()


def run(ckpt: Path, depths: list[int], names: list[str], greedy: int = 0) -> dict[str, Any]:
    import engine

    make(ckpt)
    t0 = time.time()
    eng = engine.load(ckpt, device="cuda")
    res: dict[str, Any] = {"load_s": round(time.time() - t0, 1), "rows": []}
    runners = {name: with_options(eng, **VARIANTS[name]) for name in names}
    base = logits_of(runners[names[0]], eng)
    for name in names:
        logits = logits_of(runners[name], eng)
        same = torch.equal(base, logits)
        for depth in depths:
            r = decode_rate(eng, depth, runner=runners[name])
            r.update(variant=name, logits_identical_to_plain=same,
                     logits_max_abs_diff=float((base - logits).abs().max()))  # fmt: skip
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
    if greedy:  # the default arrangement's greedy tokens against the reference path's
        res["e2b_greedy"] = greedy_pair(eng, [2] + list(range(100, 131)), greedy)
        print(json.dumps({k: v for k, v in res["e2b_greedy"].items()
                          if k not in ("fast", "reference")}), flush=True)  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--depths", default="0,4096,32768")
    ap.add_argument("--variants", default="default,no_graph",
                    help=f"comma-separated, the first is the baseline: {', '.join(VARIANTS)}")  # fmt: skip
    ap.add_argument("--greedy", type=int, default=0, help="also N greedy tokens, fast vs reference")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "variants.json"))
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    try:
        depths = [int(d) for d in args.depths.split(",") if d]
    except ValueError:
        depths = []
    if not depths or min(depths) < 0:
        ap.error(f"--depths takes comma-separated integers >= 0, not {args.depths!r}")
    if args.greedy < 0:
        ap.error(f"--greedy takes a count >= 0, not {args.greedy}")
    if not torch.cuda.is_available():
        print(f"{ap.prog} needs an NVIDIA GPU (none is visible to torch here)", file=sys.stderr)
        return 2
    res = run(Path(args.ckpt), depths, names, args.greedy)
    res["card"] = torch.cuda.get_device_name(0)
    res["torch"] = torch.__version__
    Path(args.out).write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        print(f"{r['variant']:>14} depth {r['depth']:>6}: {r['tok_per_s_gpu']:7.1f} tok/s "
              f"({r['ms_per_token_gpu']:.3f} ms), same logits as {names[0]}: "
              f"{r['logits_identical_to_plain']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
