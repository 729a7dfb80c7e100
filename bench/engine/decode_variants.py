"""Decode speed of one engine under each combination of the launch switches, in one process.

    python3 -m bench.decode_variants --ckpt /tmp/gpurig_e2b_emb4 --out $OUT/variants.json

The same weights, cache and tuned tiles; only the switches of VARIANTS change (by default
GPURIG_PDL, programmatic dependent launch, and GPURIG_PREFETCH, L2 prefetch of each program's
weight slice), so the differences are what those buy. Each variant gets its own captured CUDA
graph. Also reports whether each variant's logits are bit-identical to the first variant's:
PDL and the prefetch may not change a result; the exact GEMV and the other arrangements round
or sum otherwise and may.
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

from bench.e2e_bench import E2B_DIR, _env, decode_rate, fill_cache, greedy_pair, make

VARIANTS = {
    "plain": {"GPURIG_PDL": "0", "GPURIG_PREFETCH": "0"},
    "prefetch": {"GPURIG_PDL": "0", "GPURIG_PREFETCH": "1"},
    "pdl": {"GPURIG_PDL": "1", "GPURIG_PREFETCH": "0"},
    "pdl+prefetch": {"GPURIG_PDL": "1", "GPURIG_PREFETCH": "1"},
    "exact_gemv": {"GPURIG_GEMV_H2": "0"},  # the fp32-unpack GEMV instead of half2
    "no_epilogues": {"GPURIG_EPILOGUES": "0"},
    "residual_kernels": {"GPURIG_EPILOGUES": "glu", "GPURIG_PROLOGUE": "0"},  # v5's default
    "residual_in_gemv": {"GPURIG_EPILOGUES": "all"},  # ... in the GEMV's last program
    "qkv_in_attention": {"GPURIG_FUSE_QKV_ATTN": "1"},  # norms + RoPE + cache write fused
    "no_prologue": {"GPURIG_PROLOGUE": "0"},  # every residual+norm its own kernel
    "prologue": {"GPURIG_PROLOGUE": "1"},  # residual+norm in the next GEMV's prologue (default)
    "prologue_all": {"GPURIG_PROLOGUE": "all"},  # ... and in gate|up's too
}


def logits_of(eng, env: dict[str, str], depth: int = 100) -> torch.Tensor:
    from engine.fast import decoder_for

    with _env(**env):
        fill_cache(eng, depth)
        dec = decoder_for(eng.model, eng.cache)
        return dec(torch.tensor([7], device=eng.device), torch.tensor([depth], device=eng.device)
                   ).clone()  # fmt: skip


def run(ckpt: Path, depths: list[int], names: list[str], greedy: int = 0) -> dict[str, Any]:
    import engine

    make(ckpt)
    t0 = time.time()
    eng = engine.load(ckpt, device="cuda")
    res: dict[str, Any] = {"load_s": round(time.time() - t0, 1), "rows": []}
    base = logits_of(eng, VARIANTS[names[0]])
    for name in names:
        env = VARIANTS[name]
        same = torch.equal(base, logits_of(eng, env))
        for depth in depths:
            with _env(**env):
                r = decode_rate(eng, depth)
            r.update(variant=name, logits_identical_to_plain=same,
                     logits_max_abs_diff=float((base - logits_of(eng, env)).abs().max()))  # fmt: skip
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
    if greedy:  # the default arrangement's greedy tokens against the reference path's
        fill_cache(eng, 0)
        res["e2b_greedy"] = greedy_pair(eng, [2] + list(range(100, 131)), greedy)
        print(json.dumps({k: v for k, v in res["e2b_greedy"].items()
                          if k not in ("fast", "reference")}), flush=True)  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--depths", default="0,4096,32768")
    ap.add_argument("--variants", default="plain,prefetch,pdl,pdl+prefetch",
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
