"""Where a decode token's time goes: every kernel of one graph replay, timed by the profiler.

    python3 -m lab.engine.decode_profile --out $OUT/profile.json

* profile   the e2b decode step replayed as its CUDA graph under torch.profiler (CUPTI records
            the kernels inside graph launches): per kernel name, how many per token, total and
            mean microseconds; the sum of kernel time against the replay's wall time (the rest
            is gaps between dependent kernels).
* batch     the same for the decode step of B = 1, 2, 8, 16 rows at depth 600 in an engine of
            16 sequences (once lab/engine/batch_profile.py): where a batched step's time goes.
* prompt    reading a prompt (32, 512, 4,096 tokens) under the profiler: wall against kernel
            time, kernels launched.
* gemv_hot  each E2B GEMV shape timed with its weights resident in L2 (one copy, replayed) and
            streamed from memory (rotated copies larger than the L2): what is left when the
            bytes cost nothing is the kernel's own fixed cost.

(The L2-prefetch and PDL parts this script once had measured no gain; those switches are gone
from the engine; bench/NOTES.md cites their results, which git history keeps.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import triton

from lab.engine.e2e_bench import E2B_DIR, make, read_as_generate
from lab.engine.rows import fill_rows, held_rows, step_fn


def kernels_of_trace(path: str) -> list[dict[str, Any]]:
    return kernels_of_events(events_of_trace(path))


def events_of_trace(path: str) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def kernels_of_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        (e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"]
    )


def trace_events(prof) -> list[dict[str, Any]]:
    """Every event a finished torch.profiler run recorded, through its Chrome trace (the one
    export that keeps kernels launched inside CUDA graphs)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        trace = f.name
    try:
        prof.export_chrome_trace(trace)
        return events_of_trace(trace)
    finally:
        os.unlink(trace)


def profiled_kernels(prof) -> list[dict[str, Any]]:
    """The GPU kernels a finished torch.profiler run recorded, in start order."""
    return kernels_of_events(trace_events(prof))


def kernel_name(name: str) -> str:
    """A kernel's name without its arguments and template parameters, at most 60 characters."""
    return name.split("(")[0].split("<")[0][:60]


def profile_decode(eng, depth: int, replays: int = 3, rows: int = 1) -> dict[str, Any]:
    """The engine's decode step of `rows` rows at `depth` (its CUDA graph where it has one)."""
    with held_rows(eng, rows, depth + 8) as slots, torch.no_grad():
        fill_rows(eng, slots, depth)
        dec = step_fn(eng, slots)
        tok = torch.full((rows,), 7, dtype=torch.int64, device=eng.device)
        pos = torch.full((rows,), depth, dtype=torch.int64, device=eng.device)
        for _ in range(3):
            dec(tok, pos)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(replays):
                dec(tok, pos)
            torch.cuda.synchronize()
    ks = profiled_kernels(prof)
    if not ks:
        return {"error": "no kernel events in the trace"}
    # every replay launches the same kernels: the last 1/replays of the records is one replay
    per = len(ks) // replays
    step = ks[-per:]
    wall = step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]
    busy = sum(e["dur"] for e in step)
    # time covered by at least one kernel (PDL overlaps kernels)
    covered, end = 0.0, -1.0
    for e in step:
        s, t = e["ts"], e["ts"] + e["dur"]
        if t > end:
            covered += t - max(s, end)
            end = t
    by: dict[str, list[float]] = collections.defaultdict(list)
    for e in step:
        by[kernel_name(e["name"])].append(e["dur"])
    table = sorted(
        ({"kernel": k, "count": len(v), "total_us": sum(v), "mean_us": sum(v) / len(v),
          "max_us": max(v)} for k, v in by.items()),
        key=lambda r: -r["total_us"],
    )  # fmt: skip
    seq = [{"k": kernel_name(e["name"]), "start": round(e["ts"] - step[0]["ts"], 2),
            "dur": round(e["dur"], 2)} for e in step[:60]]  # fmt: skip
    return {"depth": depth, "rows": rows, "kernels_per_token": len(step), "wall_us": wall, "kernel_us": busy,
            "covered_us": covered, "gap_us": wall - covered, "by_kernel": table,
            "first_60": seq}  # fmt: skip


def profile_prompt(eng, n: int, whole: bool) -> dict[str, Any]:
    """Reading an n-token prompt under the profiler: wall time against the GPU's kernel time
    (the rest is the host launching ops one by one), kernels launched, the costliest ops."""
    prompt = [int(t) for t in torch.randint(3, eng.config.vocab_size, (n,))]
    for _ in range(2):
        read_as_generate(eng, prompt, whole=whole)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        read_as_generate(eng, prompt, whole=whole)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ks = profiled_kernels(prof)
    by: dict[str, list[float]] = collections.defaultdict(list)
    for e in ks:
        by[kernel_name(e["name"])].append(e["dur"])
    table = sorted(({"kernel": k, "count": len(v), "total_us": round(sum(v), 1)}
                    for k, v in by.items()), key=lambda r: -r["total_us"])[:20]  # fmt: skip
    return {"tokens": n, "whole": whole, "wall_us_under_profiler": round(wall * 1e6),
            "kernels": len(ks), "kernel_us": round(sum(e["dur"] for e in ks)),
            "by_kernel": table}  # fmt: skip


def gemv_hot_cold() -> list[dict[str, Any]]:
    from engine.kernels import tuning, w4gemv
    from lab.engine.engine_bench import GEMV_SHAPES, int4_bytes

    out = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, n, k, per_token in GEMV_SHAPES:
        nbytes = int4_bytes(n, k)
        copies = max(2, min(48, -(-3 * l2 // nbytes)))
        sets = []
        for _ in range(copies):
            p = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
            s = (torch.rand(n, k // 32, device="cuda") * 0.02).to(torch.bfloat16)
            x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
            sets.append((x, p, s, torch.empty(1, n, device="cuda", dtype=torch.bfloat16)))
        cfg = w4gemv.config_for(n, k, torch.bfloat16, 1, torch.device("cuda"))
        row: dict[str, Any] = {"name": name, "N": n, "K": k, "per_token": per_token,
                               "config": cfg, "bytes": nbytes}  # fmt: skip
        cold = [lambda a=a, c=cfg: w4gemv.w4_gemv(a[0], a[1], a[2], out=a[3], config=c)
                for a in sets]  # fmt: skip
        hot = [lambda a=sets[0], c=cfg: w4gemv.w4_gemv(a[0], a[1], a[2], out=a[3],
                                                       config=c)] * 32  # fmt: skip
        row["cold_us_plain"] = tuning.time_graph_us(cold, repeats=7)
        row["hot_us_plain"] = tuning.time_graph_us(hot, repeats=7)
        print(json.dumps(row), flush=True)
        out.append(row)
        del sets
        torch.cuda.empty_cache()
    return out


PARTS = ("gemv_hot", "profile", "batch", "prompt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile.json"))
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        ap.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        print(f"{ap.prog} needs an NVIDIA GPU (none is visible to torch here)", file=sys.stderr)
        return 2
    res: dict[str, Any] = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "triton": triton.__version__}  # fmt: skip

    def save() -> None:
        Path(args.out).write_text(json.dumps(res, indent=1))

    if "gemv_hot" in parts:
        res["gemv_hot"] = gemv_hot_cold()
        save()
    if "profile" in parts:
        import engine

        make(Path(args.ckpt))
        eng = engine.load(Path(args.ckpt), device="cuda")
        res["profile"] = {}
        for depth in (0, 32768):
            key = f"plain_depth_{depth}"
            res["profile"][key] = r = profile_decode(eng, depth)
            print(key, {k: v for k, v in r.items() if k.endswith("us")
                        or k == "kernels_per_token"}, flush=True)  # fmt: skip
            for row in r.get("by_kernel", [])[:14]:
                print(f"   {row['kernel']:<40} x{row['count']:<4} "
                      f"{row['total_us']:8.1f} us  mean {row['mean_us']:6.2f}")  # fmt: skip
            save()
    if "batch" in parts:  # one step of B rows at depth 600 (an engine of 16 sequences)
        import engine

        make(Path(args.ckpt))
        eng = engine.load(Path(args.ckpt), device="cuda", max_context=4096, max_num_seqs=16)
        res["batch"] = {}
        for rows in (1, 2, 8, 16):
            r = profile_decode(eng, 600, rows=rows)
            res["batch"][f"rows_{rows}"] = {k: v for k, v in r.items() if k != "first_60"}
            print(f"rows {rows}", {k: v for k, v in r.items() if k.endswith("us")}, flush=True)
            save()
        del eng
    if "prompt" in parts:
        import engine

        make(Path(args.ckpt))
        eng = engine.load(Path(args.ckpt), device="cuda")
        res["prompt"] = []
        for n, whole in ((32, True), (32, False), (512, False), (4096, False)):
            r = profile_prompt(eng, n, whole)
            res["prompt"].append(r)
            print({k: v for k, v in r.items() if k != "by_kernel"}, flush=True)
            for row in r["by_kernel"][:8]:
                print(f"   {row['kernel']:<50} x{row['count']:<5} {row['total_us']:9.1f} us")
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
