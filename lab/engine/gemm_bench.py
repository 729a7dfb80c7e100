"""The int4 few-row product (engine.kernels.w4gemm) per Gemma 4 E2B shape at 1/4/8/16 rows,
beside the GEMV, cuBLAS on the dequantised bf16 weight, tinygemm and gemlite.

    python3 -m lab.engine.gemm_bench --tune --out-json $OUT/gemm.json --out-md $OUT/gemm.md
    python3 -m lab.engine.gemm_bench --smoke      # the CPU interpreter, tiny shapes (CI)

Times are microseconds per call from CUDA graphs: one graph of calls that each read another copy
of the operands (copies rotated past the L2, so every call reads device memory as a decode step
does), replayed 5 times, median (engine.kernels.tuning.time_graph_us); launch overhead is not
in them. Read bandwidth = bytes a method must read per call (its weights, scales, activations)
/ time, against the card's sold bandwidth (H200 4.8 TB/s, H100 3.35; --peak-gbps). --tune first
times every candidate tiling per shape and row bucket (2, 4, 8, 16) and prints the table
engine/kernels/w4gemm_tune.py keeps.

Imports only torch, triton and engine.kernels (the device machine has no pydantic).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES = [  # (name, N, K) of every matrix a batched E2B decode step multiplies
    ("qkv_sliding", 2560, 1536), ("qkv_full", 5120, 1536), ("q_sliding", 2048, 1536),
    ("q_full", 4096, 1536), ("o_sliding", 1536, 2048), ("o_full", 1536, 4096),
    ("gate_up", 12288, 1536), ("gate_up_wide", 24576, 1536), ("down", 1536, 6144),
    ("down_wide", 1536, 12288), ("ple_gate", 256, 1536), ("ple_proj", 1536, 256),
    ("ple_model_proj", 8960, 1536), ("lm_head", 262144, 1536),
]  # fmt: skip
SMOKE_SHAPES = [("smoke_a", 64, 128), ("smoke_b", 96, 224)]  # w4_mma takes K % 128 == 0 only
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0}  # read bandwidth each card is sold with, GB/s
METHODS = ("w4_mma", "w4_gemm", "w4_gemv", "cublas_bf16", "tinygemm", "gemlite")


def _copies(nbytes: int, device: torch.device) -> int:
    """Operand copies so one round of calls reads >= 3x the L2 (1 on the CPU)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(2, min(64, math.ceil(3 * l2 / nbytes)))


def _time_us(calls: list[Callable[[], Any]], device: torch.device) -> float:
    if device.type == "cuda":
        from engine.kernels.tuning import time_graph_us

        return time_graph_us(calls, repeats=5)
    t0 = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - t0) * 1e6 / len(calls)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


class Shape:
    """Random int4 operands of one shape (several copies), and each method's prepared form."""

    def __init__(self, n: int, k: int, device: torch.device, dtype: torch.dtype) -> None:
        self.n, self.k, self.device, self.dtype = n, k, device, dtype
        gen = torch.Generator(device=device).manual_seed(n + 3 * k)
        int4_bytes = n * k // 2 + n * k // 16
        self.sets = []
        for _ in range(_copies(int4_bytes, device)):
            p = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=device,
                              dtype=torch.int32, generator=gen)  # fmt: skip
            s = (torch.rand(n, k // 32, device=device, generator=gen) * 0.02 + 0.001).to(dtype)
            self.sets.append((p, s))
        self.x = torch.randn(16, k, device=device, generator=gen).to(dtype)
        self.y = torch.empty(16, n, device=device, dtype=dtype)

    def reference(self, m: int) -> torch.Tensor:
        from engine.kernels.w4gemv import dequantize_reference

        p, s = self.sets[0]
        return self.x[:m].float() @ dequantize_reference(p, s).T

    def bytes_int4(self, m: int) -> int:
        return self.n * self.k // 2 + self.n * self.k // 32 * 2 + m * self.k * 2


def calls_w4_gemm(sh: Shape, m: int):
    from engine.kernels.w4gemm import w4_gemm

    fns = [lambda p=p, s=s: w4_gemm(sh.x[:m], p, s, out=sh.y[:m]) for p, s in sh.sets]
    return fns, sh.bytes_int4(m)


def calls_w4_gemv(sh: Shape, m: int):
    """The GEMV as it is: grid (N tiles, M), so M rows read the weights M times."""
    from engine.kernels.w4gemv import w4_gemv

    fns = [lambda p=p, s=s: w4_gemv(sh.x[:m], p, s, out=sh.y[:m]) for p, s in sh.sets]
    return fns, sh.bytes_int4(m)


def calls_cublas(sh: Shape, m: int):
    """torch.mm on the dequantised weight in the activation dtype (cuBLAS on a GPU)."""
    from engine.kernels.w4gemv import dequantize_reference

    if not hasattr(sh, "dense"):
        nb = sh.n * sh.k * sh.x.element_size()
        sh.dense = [dequantize_reference(*sh.sets[i % len(sh.sets)]).to(sh.dtype)
                    for i in range(_copies(nb, sh.device))]  # fmt: skip
    fns = [lambda w=w: torch.mm(sh.x[:m], w.t(), out=sh.y[:m]) for w in sh.dense]
    return fns, sh.n * sh.k * sh.x.element_size() + m * sh.k * 2


def calls_tinygemm(sh: Shape, m: int):
    """torch's tinygemm int4 kernel: uint8 [N, K/2] with the EVEN element in the high nibble
    (ours: low), scale-and-zero [K/32, N, 2] with w = (q - 8) * scale + zero, zero = 0."""
    if sh.device.type != "cuda" or sh.dtype != torch.bfloat16:
        raise RuntimeError("needs CUDA and bf16 activations")
    if not hasattr(sh, "tiny"):
        sh.tiny = []
        for p, s in sh.sets:
            b = p.contiguous().view(torch.uint8).view(sh.n, sh.k // 2)
            swapped = ((b & 0xF) << 4) | (b >> 4)
            wp = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
            sz = torch.stack([s.t(), torch.zeros_like(s.t())], dim=2).contiguous()
            sh.tiny.append((wp, sz))
    fns = [lambda wp=wp, sz=sz: torch.ops.aten._weight_int4pack_mm(sh.x[:m], wp, 32, sz)
           for wp, sz in sh.tiny]  # fmt: skip
    return fns, sh.n * sh.k // 2 + sh.n * sh.k // 32 * 4 + m * sh.k * 2


def calls_gemlite(sh: Shape, m: int):
    """gemlite's Triton int4 kernels with its default (not autotuned) configs: W_q codes
    [N, K] uint8, scales [N, K/32], zero 8."""
    if sh.device.type != "cuda":
        raise RuntimeError("needs CUDA")
    import gemlite

    if not hasattr(sh, "gl"):
        gemlite.set_autotune(False)
        sh.gl = []
        for p, s in sh.sets:
            shifts = torch.arange(0, 32, 4, device=p.device, dtype=torch.int32)
            codes = ((p.unsqueeze(-1) >> shifts) & 0xF).reshape(sh.n, sh.k).to(torch.uint8)
            layer = gemlite.GemLiteLinearTriton(
                W_nbits=4, group_size=32, in_features=sh.k, out_features=sh.n,
                input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16,
            )  # fmt: skip
            layer.pack(codes, s.contiguous(), 8, bias=None)
            sh.gl.append(layer)
    fns = [lambda layer=layer: layer(sh.x[:m]) for layer in sh.gl]
    return fns, sh.bytes_int4(m)


def calls_w4_mma(sh: Shape, m: int):
    """The warp-level mma kernel at its fastest (NWN, NWK) for this shape and row count, timed
    here over every candidate (the choice goes into the cell)."""
    from engine.kernels import w4mma_kernel as mk
    from engine.kernels.w4mma_tune import candidate_configs, default_config

    x, y = sh.x[:m], sh.y[:m]
    if not mk.mma_ok(x, *sh.sets[0]):
        raise RuntimeError("w4mma does not take these operands")
    best = None
    cands = candidate_configs(sh.n, sh.k) if sh.device.type == "cuda" else []
    for cfg in cands or [default_config(sh.n, sh.k, m)]:  # the interpreter: the default only
        fns = [lambda p=p, s=s, cfg=cfg: mk.launch(x, p, s, y, cfg) for p, s in sh.sets]
        fns[0]()
        us = _time_us(fns, sh.device)
        if best is None or us < best[0]:
            best = (us, cfg, fns)
    sh.mma_cfg = getattr(sh, "mma_cfg", {})
    sh.mma_cfg[m] = best[1]
    return best[2], sh.bytes_int4(m)


CALLS = {"w4_gemm": calls_w4_gemm, "w4_mma": calls_w4_mma, "w4_gemv": calls_w4_gemv, "cublas_bf16": calls_cublas,
         "tinygemm": calls_tinygemm, "gemlite": calls_gemlite}  # fmt: skip


def measure(sh: Shape, method: str, m: int) -> dict[str, Any]:
    """One cell: us, GB/s and % of peak read bandwidth, error against the reference; or n/a."""
    try:
        fns, nbytes = CALLS[method](sh, m)
        out = fns[0]()
        out = out if out is not None else sh.y[:m]
        err = _rel_err(out.float(), sh.reference(m))
        us = _time_us(fns, sh.device)
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        if sh.device.type == "cuda":
            torch.cuda.synchronize()
        return {"method": method, "m": m, "na": f"{type(e).__name__}: {str(e)[:200]}"}
    gbps = nbytes / us / 1e3
    extra = {"config": sh.mma_cfg[m]} if method == "w4_mma" else {}
    return {**extra, "method": method, "m": m, "us": round(us, 3), "gbps": round(gbps, 1),
            "rel_err": float(f"{err:.3g}")}  # fmt: skip


def peak_gbps(device_name: str) -> float:
    """The card's sold read bandwidth (the % column's base): an H200's where the name is none
    of PEAK_GBPS's, as before the table knew more than one card."""
    return next((v for k, v in PEAK_GBPS.items() if k in device_name), PEAK_GBPS["H200"])


def _precompile_worker(job: tuple[int, int, list[tuple[int, int]], str]) -> int:
    """Compile (by running once, on zeros) every candidate whose index % procs == rank, at
    every shape: Triton's disk cache then serves the tuning process. Returns launches run."""
    rank, procs, shapes, dtype_name = job
    from engine.kernels.w4gemm_kernel import launch, workspace
    from engine.kernels.w4gemm_tune import candidate_configs

    dev, dtype, done = torch.device("cuda"), getattr(torch, dtype_name), 0
    for n, k in shapes:
        p = torch.zeros(n, k // 8, device=dev, dtype=torch.int32)
        s = torch.ones(n, k // 32, device=dev, dtype=dtype)
        for m in (2, 4, 8, 16):
            x, y = (
                torch.zeros(m, k, device=dev, dtype=dtype),
                torch.empty(m, n, device=dev, dtype=dtype),
            )
            ws, tk = workspace(dev, 8 * m * n, n)
            for cfg in candidate_configs(n, k, m, True):
                key = json.dumps(cfg, sort_keys=True)
                if hash(key) % procs != rank or (cfg["TC"] and m in (4, 8)):
                    continue  # M 2, 4, 8 share one specialization on the tensor-core path
                try:
                    launch(x, p, s, y, cfg, ws=ws, tickets=tk)
                    done += 1
                except Exception:  # noqa: BLE001 - tuning skips what does not build
                    pass
    torch.cuda.synchronize()
    return done


def precompile(shapes, procs: int, dtype: torch.dtype) -> None:
    """Build the candidates in `procs` processes at once (compiling, not timing, is what tuning
    spends its time on)."""
    import multiprocessing as mp

    os.environ["PYTHONHASHSEED"] = "0"  # one hash() of a config in every process
    nk = [(n, k) for _, n, k in shapes]
    with mp.get_context("spawn").Pool(procs) as pool:
        done = pool.map(_precompile_worker, [(r, procs, nk, str(dtype).split(".")[-1])
                                             for r in range(procs)])  # fmt: skip
    print(f"precompiled: {sum(done)} launches in {procs} processes", flush=True)


def tune_all(shapes, device: torch.device, dtype: torch.dtype, path: Path | None = None):
    """Time every candidate per shape and row bucket; store the winners in the tuning cache
    (so this process's benchmark uses them) and return the table (engine/kernels/configs/w4gemm_NVIDIA_H200.json)."""
    from engine.kernels import tuning
    from engine.kernels.w4gemm_kernel import KERNEL_NAME, default_config
    from engine.kernels.w4gemm_tune import candidate_configs, path_for, random_sets, shape_key, tune

    table: dict[str, Any] = {}
    gpu = tuning.gpu_key(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tc = path_for(device)
    for name, n, k in shapes:
        sets = random_sets(n, k, dtype, 16, device)
        for m in (2, 4, 8, 16):
            t0 = time.time()
            dflt = default_config(n, k, m, tc, sms)
            cands = [dflt, *(c for c in candidate_configs(n, k, m, tc) if c != dflt)]
            best, us, results = tune(n, k, dtype, m, device, candidates=cands, sets=sets)
            d_us = next((t for c, t in results if c == dflt), None)
            best = dict(best, us=round(us, 3), us_default=round(d_us, 3) if d_us else None)
            key = shape_key(n, k, dtype, m, tc)
            tuning.store(KERNEL_NAME, key, gpu, best)
            table[key] = best
            print(f"tune {name} M{m}: {us:.2f} us (default {d_us or 0:.2f}) {best} "
                  f"[{len(results)} cands, {time.time() - t0:.1f}s]", flush=True)  # fmt: skip
        del sets
        torch.cuda.empty_cache()
        if path:  # after every shape: a run cut short keeps what it measured
            path.write_text(json.dumps(table, indent=1, sort_keys=True))
    return table


def run(shapes, rows, methods, device, dtype, deadline: float) -> list[dict[str, Any]]:
    out = []
    for name, n, k in shapes:
        sh = Shape(n, k, device, dtype)
        for m in rows:
            for method in methods:
                if method == "w4_gemv" and m > 1 and device.type == "cuda" and n > 100000:
                    continue  # lm_head re-read 16 times: slow and known
                if time.time() > deadline and method in ("gemlite", "tinygemm"):
                    cell = {"method": method, "m": m, "na": "skipped: bench time budget"}
                else:
                    cell = measure(sh, method, m)
                cell.update(shape=name, n=n, k=k)
                out.append(cell)
                print(json.dumps(cell), flush=True)
        del sh
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def markdown(cells: list[dict[str, Any]], rows) -> str:
    """One line per (shape, rows): us (% of peak read bandwidth) per method, and w4_gemm's time
    over the one-row GEMV's (close to 1: a batched step costs what one sequence's does)."""
    idx = {(c["shape"], c["method"], c["m"]): c for c in cells}
    shapes = list(dict.fromkeys(c["shape"] for c in cells))
    methods = [mt for mt in METHODS if any(c["method"] == mt for c in cells)]
    head = ["shape (N x K)", "M", *methods, "w4_gemm / gemv M=1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in shapes:
        first = next(c for c in cells if c["shape"] == s)
        base = idx.get((s, "w4_gemv", 1), {}).get("us")
        for m in rows:
            row = [f"{s} ({first['n']} x {first['k']})", str(m)]
            for mt in methods:
                c = idx.get((s, mt, m))
                if c is None:
                    row.append("-")
                elif "na" in c:
                    row.append("n/a")
                else:
                    row.append(f"{c['us']:.1f} ({c['pct_peak']:.0f}%)")
            us = idx.get((s, "w4_gemm", m), {}).get("us")
            row.append(f"{us / base:.2f}" if us and base else "-")
            lines.append("| " + " | ".join(row) + " |")
    notes = sorted({f"{c['method']}: {c['na']}" for c in cells if "na" in c})
    return "\n".join(lines) + ("\n\nn/a:\n" + "\n".join(f"- {n}" for n in notes) if notes else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, two tiny shapes")
    ap.add_argument("--tune", action="store_true", help="tune every shape and row bucket first")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="after this many seconds the slow baselines are skipped")  # fmt: skip
    ap.add_argument("--peak-gbps", type=float,
                    help="read bandwidth for the %% column (default: the card's, by its name)")  # fmt: skip
    ap.add_argument("--out-json", type=Path)
    ap.add_argument("--out-md", type=Path)
    ap.add_argument("--tuned-json", type=Path, help="where --tune writes its table")
    ap.add_argument("--precompile-procs", type=int, default=0,
                    help="with --tune: build the candidates in this many processes first")  # fmt: skip
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, shapes = torch.device("cpu"), SMOKE_SHAPES
    else:
        if not torch.cuda.is_available():
            print("gemm_bench: no CUDA GPU here; run with --smoke on the CPU", file=sys.stderr)
            return 2
        device, shapes = torch.device("cuda"), SHAPES
    if a.shapes:
        shapes = [s for s in shapes if s[0] in a.shapes.split(",")]
    dtype = torch.bfloat16
    rows = [int(r) for r in a.rows.split(",")]
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                           else "cpu (interpreter)", "torch": torch.__version__,
                           "timing": "CUDA graph of calls over operand copies rotated past the "
                           "L2, median of 5 replays (no launch overhead)",
                           "dtype": "bfloat16"}  # fmt: skip
    peak = a.peak_gbps or peak_gbps(res["device"])
    res["peak_gbps"] = peak
    if a.tune and device.type == "cuda":
        if a.precompile_procs:
            t1 = time.time()
            precompile(shapes, a.precompile_procs, dtype)
            res["precompile_s"] = round(time.time() - t1, 1)
        res["tuned"] = tune_all(shapes, device, dtype, a.tuned_json)
    res["cells"] = run(shapes, rows, a.methods.split(","), device, dtype, t0 + a.budget_s)
    for cell in res["cells"]:
        if "gbps" in cell:
            cell["pct_peak"] = round(100 * cell["gbps"] / peak, 1)
    res["wall_s"] = round(time.time() - t0, 1)
    md = markdown(res["cells"], rows)
    print(md)
    if a.out_json:
        a.out_json.write_text(json.dumps(res, indent=1))
    if a.out_md:
        a.out_md.write_text(f"# int4 product on {res['device']}\n\n{res['timing']}; "
                            f"us (% of {peak / 1000:.2f} TB/s read bandwidth).\n\n{md}\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
