"""The engine at a preset (default e2b) through a sweep, in one command for the lent GPU.

    python3 -m lab.sweep_e2b --out DIR [--preset e2b] [--emb4] [--input-lens 512,4096]
        [--concurrency 1,4,8,16] [--repeats 3] [--output-len 128] [--ckpt DIR]
        [--server-args '--prefill-budget 4096']

Writes the random-weight checkpoint (unless --ckpt names one), then run_sweep with one `server`
target: the sweep starts `gpurig engine serve` through the lifecycle tools, measures it (the
bandwidth probe first, NVML through every cell) and stops it. The sweep's directory (REPORT.md,
results.json, results.csv, plots/) is DIR/sweep; DIR/checkpoint.json says what was served. Run
again with the same DIR, it resumes the sweep there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from bench.sweep.progress import ProgressBar, int_list
from tools.fileio import write_atomic


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the sweep directory goes")
    ap.add_argument("--preset", default="e2b")
    ap.add_argument("--emb4", action="store_true", help="4-bit embedding tables (the engine's own)")
    ap.add_argument("--ckpt", help="an existing checkpoint (default: write one under /tmp)")
    ap.add_argument("--input-lens", type=int_list, default=[512, 4096])
    ap.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default=None, help="the engine's device (default: cuda)")
    ap.add_argument("--server-args", default="",
                    help="more `gpurig engine serve` flags, e.g. '--prefill-budget 4096'")  # fmt: skip
    args = ap.parse_args(argv)

    from bench.sweep import run_sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt) if args.ckpt else Path(f"/tmp/gpurig-{args.preset}-ckpt")
    if not (ckpt / "config.json").is_file():
        from engine.checkpoint_maker import make_checkpoint

        t0 = time.perf_counter()
        info = make_checkpoint(ckpt, preset=args.preset, seed=0, emb4=args.emb4)
        made = {**info.model_dump(), "seconds": round(time.perf_counter() - t0, 1)}
        write_atomic(out / "checkpoint.json", json.dumps(made, indent=2) + "\n")
        sys.stderr.write(f"checkpoint written in {made['seconds']} s: {ckpt}\n")
    label = f"engine-{args.preset}" + ("-emb4" if args.emb4 else "")
    server = {"model": str(ckpt), "backend": "engine", "timeout_s": 900}
    if args.device:
        server["device"] = args.device
    if args.server_args:
        server["extra_args"] = shlex.split(args.server_args)
    sweep_dir = out / "sweep"
    resume = str(sweep_dir) if (sweep_dir / "sweep.json").is_file() else None
    result = run_sweep(
        targets=None if resume else [{"label": label, "server": server}],
        resume=resume,
        input_lens=args.input_lens,
        output_len=args.output_len,
        concurrency=args.concurrency,
        repeats=args.repeats,
        out_dir=str(sweep_dir),
        progress=ProgressBar(),
    )
    print(result.table)
    for line in result.failures:
        print("failed:", line)
    for r in result.roofline:
        print(
            f"roofline {r.target}: {r.bytes_per_token} B/token, {r.bandwidth_gb_s} GB/s, "
            f"ceiling {r.ceiling_tok_s} tok/s, c=1 share {r.c1_share} {r.missing or ''}"
        )
    print("report:", result.report)
    return 0 if not result.failures else 1


if __name__ == "__main__":
    sys.exit(main())
