"""Do the fast path's answers equal the reference path's? Greedy tokens, and why they differ.

Run on a CUDA machine: `python3 -m lab.engine.answers --out $OUT/answers.json [--ckpt DIR]`.

Free-running greedy decoding says only *whether* the two paths agree: after the first
different token they read different text and every later token differs too. This script also
runs them teacher-forced: both paths read the reference path's tokens, so every step is
compared on the same input, and for each step it records whether the argmax agrees, the
reference's margin between its best and second-best logit, and the largest difference between
the two paths' logits. A disagreement whose margin is below that difference is a near-tie the
summation order decides (both answers are the model's within its rounding); a disagreement with
a margin far above it would be a bug. Run per dtype: in fp32 the rounding is ~1e-6 and the
tokens should be identical; in bf16 each intermediate is rounded to 8 bits of mantissa.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

import engine
from lab.engine.e2e_bench import E2B_DIR, greedy_pair, make, reference_engine
from lab.engine.rows import held_rows, read_whole, step_fn

PROMPT = [2] + list(range(100, 131))


def teacher_forced(eng, prompt: list[int], n: int) -> dict[str, Any]:
    """Both paths read the reference's greedy tokens; per-step agreement, margins, differences."""
    ref_eng = reference_engine(eng)  # the same checkpoint, fast path off
    steps = []
    with held_rows(ref_eng, 1) as ref_slots, held_rows(eng, 1) as slots:
        logits = read_whole(ref_eng, prompt, int(ref_slots[0]))
        for i in ref_eng.pool.k:  # the same prompt state for both paths (the same geometry)
            eng.pool.k[i].copy_(ref_eng.pool.k[i])
            eng.pool.v[i].copy_(ref_eng.pool.v[i])
            eng.pool.pos[i].copy_(ref_eng.pool.pos[i])
        eng.pool.block_tables.copy_(ref_eng.pool.block_tables)
        ref_step, fast_step = step_fn(ref_eng, ref_slots), step_fn(eng, slots)
        token = logits.reshape(-1).argmax().view(1)
        pos = torch.tensor([len(prompt)], dtype=torch.int64, device=eng.device)
        with torch.inference_mode():
            for _ in range(n):
                ref = ref_step(token, pos)[0].float()
                fast = fast_step(token, pos)[0].float()
                top2 = ref.topk(2)
                diff = (fast - ref).abs()
                steps.append({
                    "agree": bool(fast.argmax() == top2.indices[0]),
                    "reference_margin": float(top2.values[0] - top2.values[1]),
                    "max_abs_logit_diff": float(diff.max()),
                    "logit_scale": float(ref.abs().max()),
                })  # fmt: skip
                token = top2.indices[:1].clone()
                pos = pos + 1
    bad = [s for s in steps if not s["agree"]]
    return {
        "steps": n,
        "agreeing": n - len(bad),
        "disagreements": bad,
        "every_disagreement_is_a_near_tie": all(
            s["reference_margin"] <= 2 * s["max_abs_logit_diff"] for s in bad
        ),
        "max_abs_logit_diff": max(s["max_abs_logit_diff"] for s in steps),
        "median_reference_margin": sorted(s["reference_margin"] for s in steps)[n // 2],
        "per_step": steps,
    }


def presets_identity(presets: list[str], tokens: int, device: str) -> list[dict[str, Any]]:
    """Free-running greedy identity on small random presets, loaded under the 3,732 MiB cap
    (the code path a 4 GB card uses): the agreeing prefix per preset and dtype (once
    lab/engine/greedy_identity.py)."""
    from engine.checkpoint_maker import make_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            ckpt = Path(tmp) / preset
            make_checkpoint(ckpt, preset=preset, seed=0)
            for dtype in (torch.float32, torch.bfloat16):
                eng = engine.load(ckpt, device=device, max_context=2048, dtype=dtype,
                                  memory_cap_mib=3732 if device != "cpu" else None)  # fmt: skip
                row = greedy_pair(eng, [2] + list(range(10, 310)), tokens)
                row.update(preset=preset, dtype=str(dtype).removeprefix("torch."))
                rows.append({k: v for k, v in row.items() if k not in ("fast", "reference")})
                print(rows[-1], flush=True)
                del eng
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--presets",
        default="tiny,small",
        help="free-running identity on these random presets too ('' for none)",
    )
    ap.add_argument("--device", default="cuda", help="cpu: the reference against itself (a check)")
    ap.add_argument("--preset", default="e2b", help="the --ckpt checkpoint's preset when made")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "answers.json"))
    args = ap.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(
            "lab.engine.answers compares the CUDA fast path: run it on a machine with a GPU"
        )
    make(Path(args.ckpt), args.preset)
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        eng = engine.load(Path(args.ckpt), device=args.device, dtype=dtype, max_context=1024)
        free = greedy_pair(eng, PROMPT, args.tokens)
        forced = teacher_forced(eng, PROMPT, args.tokens)
        row = {"dtype": name, "free_running": {k: v for k, v in free.items()
                                               if k not in ("fast", "reference")},
               "teacher_forced": forced}  # fmt: skip
        rows.append(row)
        short = {k: v for k, v in forced.items() if k != "per_step"}
        print(json.dumps({"dtype": name, "free_agreeing": free["agreeing"], **short}), flush=True)
        del eng
    presets = [p for p in args.presets.split(",") if p]
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    out = {"device": name, "torch": torch.__version__, "checkpoint": args.ckpt,
           "prompt": PROMPT, "rows": rows,
           "presets": presets_identity(presets, 64, args.device)}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
