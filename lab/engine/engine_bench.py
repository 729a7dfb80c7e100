"""One call on the GPU that builds, checks and times the engine's kernels and its peers.

    python3 -m lab.engine.engine_bench --out $OUT/engine_bench.json [--sections bandwidth,gemv,...]

Sections (each writes into the JSON as soon as it finishes, so a run cut short keeps its part):

* env        card, SMs, L2, versions, date;
* bandwidth  the read ceiling measured in this run: `sum` over 4 GiB of fp16 (and a copy);
* gemv       every E2B weight shape at batch 1: our Triton int4 GEMV (tuned per shape), cuBLAS
             fp16, torch's tinygemm `_weight_int4pack_mm` (bf16, group 32) and gemlite 0.6 (fp16,
             if importable); microseconds from CUDA-graph replays over rotated copies larger than
             the L2, each also as % of the read bandwidth over the int4 bytes (codes + scales);
             every kernel is first checked against an fp64 reference on the same random data;
* attention  decode attention over the full-attention cache (head 512) at several depths and the
             sliding ring (head 256), with and without tl.dot;
* gather     4-bit embedding row gathers; dequantisation of the widest matrix (prompt reading);
* e2e        the whole engine (see lab/engine/e2e_bench.py), when the engine exists.

The last thing printed is a short table; everything is in the JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

GEMV_SHAPES: list[tuple[str, int, int, int]] = [
    # name, N (out), K (in), times per decode token (fused q|k|v and gate|up)
    ("qkv sliding", 2560, 1536, 12),
    ("qkv full", 5120, 1536, 3),
    ("q sliding (kv-shared)", 2048, 1536, 16),
    ("q full (kv-shared)", 4096, 1536, 4),
    ("o sliding", 1536, 2048, 28),
    ("o full", 1536, 4096, 7),
    ("gate+up", 12288, 1536, 15),
    ("gate+up wide", 24576, 1536, 20),
    ("down", 1536, 6144, 15),
    ("down wide", 1536, 12288, 20),
    ("per-layer gate", 256, 1536, 35),
    ("per-layer proj", 1536, 256, 35),
    ("per-layer model projection", 8960, 1536, 1),
    ("lm_head", 262144, 1536, 1),
]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def int4_bytes(n: int, k: int) -> int:
    """Bytes a batch-1 int4 GEMV must read: codes (N*K/2) + one 16-bit scale per 32."""
    return n * k // 2 + n * k // 16


def _copies(nbytes: int, l2: int, cap: int = 48) -> int:
    return max(2, min(cap, math.ceil(3 * l2 / max(nbytes, 1))))


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------------------------
def section_env() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    import triton

    info: dict[str, Any] = {
        "date": _now(),
        "card": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    for mod in ("transformers", "gemlite"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable: {exc.__class__.__name__}"
    return info


def section_bandwidth() -> dict[str, Any]:
    """The read ceiling: a `sum` over 4 GiB of fp16 (median of 10), and a 2 GiB copy."""
    x = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.float16).repeat(2)
    nbytes = x.numel() * 2
    for _ in range(3):
        x.sum()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    read = nbytes / sorted(times)[len(times) // 2]
    y = torch.empty(nbytes // 4, device="cuda", dtype=torch.float16)
    src = x[: y.numel()]
    y.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    copy = 2 * y.numel() * 2 / sorted(times)[len(times) // 2]
    del x, y
    torch.cuda.empty_cache()
    return {"read_GBps": read / 1e9, "copy_rw_GBps": copy / 1e9, "bytes": nbytes}


# ----------------------------------------------------------------------------------------------
def _tinygemm_pack(codes: torch.Tensor, scales: torch.Tensor, order: str, zero: str):
    """Weights for torch's tinygemm: uint8 [N, K/2] codes -> int4pack, [K/32, N, 2] scale|zero."""
    if order == "hi_even":
        u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    else:
        u8 = (codes[:, 1::2] << 4 | codes[:, ::2]).to(torch.uint8)
    wp = torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), 8)
    s = scales.to(torch.bfloat16)
    z = torch.zeros_like(s) if zero == "zero" else (8 * s.float()).to(torch.bfloat16)
    sz = torch.stack([s.T, z.T], dim=-1).contiguous()
    return wp, sz


def _gemlite_layer(codes: torch.Tensor, scales: torch.Tensor):
    from gemlite.helper import A16Wn

    zeros = torch.full_like(scales, 8, dtype=torch.float16)
    return A16Wn(device="cuda:0", dtype=torch.float16).from_weights(
        codes.to(torch.uint8), scales.to(torch.float16), zeros, W_nbits=4, group_size=32
    )


def section_gemv(read_bps: float, dtypes=("bfloat16",), peers=True) -> dict[str, Any]:
    from engine.kernels import tuning, w4gemv
    from engine.kernels.w4gemv import dequantize_reference, w4_gemv
    from engine.kernels.w4gemv_kernel import h2_on

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    gpu = tuning.gpu_key(0)
    have_gemlite = False
    if peers:
        try:
            import gemlite  # noqa: F401

            have_gemlite = True
        except Exception as exc:  # noqa: BLE001
            print("gemlite unavailable:", exc)
    tiny_variant: tuple[str, str] | None = None
    rows = []
    for name, n, k, per_token in GEMV_SHAPES:
        row: dict[str, Any] = {"name": name, "N": n, "K": k, "per_token": per_token}
        nbytes = int4_bytes(n, k)
        row["int4_bytes"] = nbytes
        copies = _copies(nbytes, l2)
        gen = torch.Generator(device="cuda").manual_seed(n + 31 * k)
        sets = []
        for _ in range(copies):
            p = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda",
                              dtype=torch.int32, generator=gen)  # fmt: skip
            s = torch.rand(n, k // 32, device="cuda", generator=gen) * 0.02 + 0.002
            x = torch.randn(1, k, device="cuda", generator=gen)
            sets.append((p, s, x))
        ref0 = sets[0][2].double() @ dequantize_reference(sets[0][0], sets[0][1]).double().T
        # ---- ours
        for dname in dtypes:
            dtype = getattr(torch, dname)
            t0 = time.time()
            ours = [(p, s.to(dtype), x.to(dtype), torch.empty(1, n, device="cuda", dtype=dtype))
                    for p, s, x in sets]  # fmt: skip
            cfg = w4gemv.config_for(n, k, dtype, 1, torch.device("cuda"))
            row[f"ours_{dname}_config"] = cfg
            row[f"ours_{dname}_tune_s"] = round(time.time() - t0, 2)
            y = w4_gemv(ours[0][2], ours[0][0], ours[0][1], out=ours[0][3])
            ref = ours[0][2].double() @ dequantize_reference(ours[0][0], ours[0][1]).double().T
            row[f"ours_{dname}_relerr"] = _rel(y, ref)
            calls = [lambda a=a, c=cfg: w4_gemv(a[2], a[0], a[1], out=a[3], config=c)
                     for a in ours]  # fmt: skip
            us = tuning.time_graph_us(calls, repeats=7)
            row[f"ours_{dname}_us"] = us
            row[f"ours_{dname}_pct_bw"] = 100 * nbytes / (us * 1e-6) / read_bps
            row[f"ours_{dname}_half2"] = h2_on(dtype, torch.device("cuda"))
            if row[f"ours_{dname}_half2"]:  # the exact fp32-unpack path beside it
                cfg_x = w4gemv.config_for(n, k, dtype, 1, torch.device("cuda"), half2=False)
                calls = [lambda a=a, c=cfg_x: w4_gemv(a[2], a[0], a[1], out=a[3], config=c,
                                                      half2=False) for a in ours]  # fmt: skip
                us_x = tuning.time_graph_us(calls, repeats=7)
                row[f"ours_{dname}_exact_us"] = us_x
                row[f"ours_{dname}_exact_pct_bw"] = 100 * nbytes / (us_x * 1e-6) / read_bps
            del ours
        if peers:
            # ---- cuBLAS fp16 on the dequantised matrix (2 bytes per weight)
            try:
                dense = []
                for p, s, x in sets[: _copies(n * k * 2, l2, cap=16)]:
                    dense.append((dequantize_reference(p, s).half(), x.half()))
                row["cublas_fp16_relerr"] = _rel(
                    torch.nn.functional.linear(dense[0][1], dense[0][0]), ref0
                )
                calls = [lambda a=a: torch.nn.functional.linear(a[1], a[0]) for a in dense]
                us = tuning.time_graph_us(calls, repeats=7)
                row["cublas_fp16_us"] = us
                row["cublas_fp16_pct_bw_of_int4_bytes"] = 100 * nbytes / (us * 1e-6) / read_bps
                row["cublas_fp16_pct_bw_own_bytes"] = 100 * n * k * 2 / (us * 1e-6) / read_bps
                del dense
            except Exception as exc:  # noqa: BLE001
                row["cublas_fp16_error"] = repr(exc)
            torch.cuda.empty_cache()
            # ---- tinygemm bf16 group 32
            try:
                shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)

                def codes_of(p, shifts=shifts):
                    return ((p.unsqueeze(-1) >> shifts) & 0xF).reshape(p.shape[0], -1)

                variants = [tiny_variant] if tiny_variant else [
                    ("hi_even", "zero"), ("lo_even", "zero"), ("hi_even", "eight"),
                    ("lo_even", "eight")]  # fmt: skip
                best = None
                for var in variants:
                    wp, sz = _tinygemm_pack(codes_of(sets[0][0]), sets[0][1], *var)
                    xb = sets[0][2].to(torch.bfloat16)
                    err = _rel(torch.ops.aten._weight_int4pack_mm(xb, wp, 32, sz), ref0)
                    if best is None or err < best[1]:
                        best = (var, err)
                tiny_variant = best[0]
                row["tinygemm_layout"] = list(best[0])
                row["tinygemm_relerr"] = best[1]
                packs = []
                for p, s, x in sets:
                    wp, sz = _tinygemm_pack(codes_of(p), s, *tiny_variant)
                    packs.append((wp, sz, x.to(torch.bfloat16)))
                calls = [lambda a=a: torch.ops.aten._weight_int4pack_mm(a[2], a[0], 32, a[1])
                         for a in packs]  # fmt: skip
                us = tuning.time_graph_us(calls, repeats=7)
                row["tinygemm_bf16_us"] = us
                row["tinygemm_bf16_pct_bw"] = 100 * nbytes / (us * 1e-6) / read_bps
                del packs
            except Exception as exc:  # noqa: BLE001
                row["tinygemm_error"] = repr(exc)[:300]
            torch.cuda.empty_cache()
            # ---- gemlite fp16
            if have_gemlite:
                try:
                    shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)
                    layers = []
                    for p, s, x in sets:
                        codes = ((p.unsqueeze(-1) >> shifts) & 0xF).reshape(n, k)
                        layers.append((_gemlite_layer(codes, s.half()), x.half()))
                    row["gemlite_relerr"] = _rel(layers[0][0](layers[0][1]), ref0)
                    for layer, x in layers:  # warm up (autotune) outside the graph
                        layer(x)
                    calls = [lambda a=a: a[0](a[1]) for a in layers]
                    us = tuning.time_graph_us(calls, repeats=7)
                    row["gemlite_fp16_us"] = us
                    row["gemlite_fp16_pct_bw"] = 100 * nbytes / (us * 1e-6) / read_bps
                    del layers
                except Exception as exc:  # noqa: BLE001
                    row["gemlite_error"] = repr(exc)[:300]
                torch.cuda.empty_cache()
        del sets
        torch.cuda.empty_cache()
        peers_us = [row.get(key) for key in ("cublas_fp16_us", "tinygemm_bf16_us",
                                              "gemlite_fp16_us")]  # fmt: skip
        peers_us = [u for u in peers_us if u]
        if peers_us:
            row["best_peer_us"] = min(peers_us)
            row["ours_faster_than_best_peer"] = row[f"ours_{dtypes[0]}_us"] < min(peers_us)
        rows.append(row)
        print(json.dumps({k2: v for k2, v in row.items() if not k2.endswith("config")}),
              flush=True)  # fmt: skip
    per_token_us = sum(r[f"ours_{dtypes[0]}_us"] * r["per_token"] for r in rows)
    per_token_bytes = sum(r["int4_bytes"] * r["per_token"] for r in rows)
    return {
        "gpu_key": gpu,
        "shapes": rows,
        "decode_linears_us_per_token": per_token_us,
        "decode_linears_bytes_per_token": per_token_bytes,
        "decode_linears_pct_bw": 100 * per_token_bytes / (per_token_us * 1e-6) / read_bps,
        "tok_per_s_if_only_linears": 1e6 / per_token_us,
    }


# ----------------------------------------------------------------------------------------------
def section_attention(read_bps: float) -> dict[str, Any]:
    from engine.kernels import tuning
    from engine.kernels.attention_decode import DecodeAttention, decode_attention_reference

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    out: list[dict[str, Any]] = []
    cases = [("full", 131072, 512, d) for d in (1, 4096, 32768, 131072)] + [("ring", 512, 256, 512)]
    for kind, slots, dim, depth in cases:
        ring = kind == "ring"
        nbytes = 2 * min(depth, slots) * dim * 2
        copies = _copies(nbytes, l2, cap=12) if depth > 1 else 2
        caches = [
            (torch.randn(slots, dim, device="cuda", dtype=torch.bfloat16),
             torch.randn(slots, dim, device="cuda", dtype=torch.bfloat16))
            for _ in range(min(copies, 12 if slots <= 4096 else 3))
        ]  # fmt: skip
        pos = torch.tensor([depth - 1 if not ring else 4095], device="cuda", dtype=torch.int32)
        for use_dot in (True, False):
            row: dict[str, Any] = {"cache": kind, "slots": slots, "head_dim": dim,
                                   "depth": depth, "use_dot": use_dot, "bytes": nbytes}  # fmt: skip
            try:
                att = DecodeAttention(8, dim, slots, torch.device("cuda"), ring=ring,
                                      window=512 if ring else 0, use_dot=use_dot)  # fmt: skip
                q = torch.randn(8, dim, device="cuda", dtype=torch.bfloat16) * 0.05
                o = torch.empty(8, dim, device="cuda", dtype=torch.bfloat16)
                got = att(q, caches[0][0], caches[0][1], pos, out=o)
                p = int(pos.item())
                if slots <= 32768 or depth <= 32768:
                    want = decode_attention_reference(
                        q.double(), caches[0][0].double(), caches[0][1].double(), p,
                        ring=ring, window=512 if ring else 0)  # fmt: skip
                    row["relerr"] = _rel(got, want)
                calls = [lambda c=c, a=att, q=q, o=o, t=pos: a(q, c[0], c[1], t, out=o) for c in caches] * (
                    max(1, 24 // len(caches)))  # fmt: skip
                us = tuning.time_graph_us(calls, repeats=5)
                row["us"] = us
                row["pct_bw"] = 100 * nbytes / (us * 1e-6) / read_bps
                row["splits"] = att.splits
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:300]
            out.append(row)
            print(json.dumps(row), flush=True)
        del caches
        torch.cuda.empty_cache()
    return {"cases": out}


def section_gather(read_bps: float) -> dict[str, Any]:
    from engine.kernels import tuning
    from engine.kernels.w4dequant import w4_dequantize, w4_gather_rows

    res: dict[str, Any] = {}
    for name, rows, k in (("embed", 262144, 1536), ("per_layer_embed", 262144, 8960)):
        packed = torch.randint(-(2**31), 2**31 - 1, (rows, k // 8), device="cuda",
                               dtype=torch.int32)  # fmt: skip
        scales = torch.rand(rows, k // 32, device="cuda").to(torch.bfloat16)
        ids = [torch.randint(0, rows, (1,), device="cuda") for _ in range(32)]
        out = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
        calls = [lambda i=i, p=packed, s=scales, o=out: w4_gather_rows(i, p, s, out=o) for i in ids]
        res[f"{name}_gather_1_row_us"] = tuning.time_graph_us(calls)
        ids512 = torch.randint(0, rows, (512,), device="cuda")
        out512 = torch.empty(512, k, device="cuda", dtype=torch.bfloat16)
        res[f"{name}_gather_512_rows_us"] = tuning.time_graph_us(
            [lambda i=ids512, p=packed, s=scales, o=out512: w4_gather_rows(i, p, s, out=o)] * 8
        )
        del packed, scales
    n, k = 24576, 1536
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
    scales = torch.rand(n, k // 32, device="cuda").to(torch.bfloat16)
    for dname in ("bfloat16", "float32"):
        outm = torch.empty(n, k, device="cuda", dtype=getattr(torch, dname))
        us = tuning.time_graph_us([lambda o=outm: w4_dequantize(packed, scales, out=o)] * 8)
        moved = int4_bytes(n, k) + outm.numel() * outm.element_size()
        res[f"dequant_24576x1536_{dname}_us"] = us
        res[f"dequant_24576x1536_{dname}_pct_bw"] = 100 * moved / (us * 1e-6) / read_bps
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------
def _summary(results: dict[str, Any]) -> str:
    from tabulate import tabulate

    lines = []
    bw = results.get("bandwidth", {})
    if bw:
        lines.append(f"read {bw['read_GBps']:.0f} GB/s, copy(r+w) {bw['copy_rw_GBps']:.0f} GB/s")
    g = results.get("gemv")
    if g:
        table = []
        for r in g["shapes"]:
            table.append([
                r["name"], f"{r['N']}x{r['K']}",
                f"{r.get('ours_bfloat16_us', float('nan')):.2f} ({r.get('ours_bfloat16_pct_bw', 0):.0f}%)",
                f"{r.get('ours_bfloat16_exact_us', float('nan')):.2f}",
                f"{r.get('cublas_fp16_us', float('nan')):.2f}",
                f"{r.get('tinygemm_bf16_us', float('nan')):.2f} ({r.get('tinygemm_bf16_pct_bw', 0):.0f}%)",
                f"{r.get('gemlite_fp16_us', float('nan')):.2f} ({r.get('gemlite_fp16_pct_bw', 0):.0f}%)",
                r.get("ours_faster_than_best_peer"),
            ])  # fmt: skip
        lines.append(tabulate(table, headers=["shape", "NxK", "ours bf16 us", "exact", "cuBLAS fp16",
                                              "tinygemm", "gemlite", "ours<best"]))  # fmt: skip
        lines.append(
            f"linears per token: {g['decode_linears_us_per_token']:.1f} us, "
            f"{g['decode_linears_pct_bw']:.0f}% of read bw, "
            f"{g['tok_per_s_if_only_linears']:.0f} tok/s if only the linears"
        )
    a = results.get("attention")
    if a:
        table = [[c["cache"], c["depth"], c["head_dim"], c["use_dot"], c.get("us"),
                  c.get("pct_bw"), c.get("relerr"), c.get("error", "")] for c in a["cases"]]  # fmt: skip
        lines.append(tabulate(table, headers=["cache", "depth", "D", "dot", "us", "%bw", "err",
                                              ""], floatfmt=".3g"))  # fmt: skip
    e = results.get("e2e")
    if e and "summary" in e:
        lines.append(json.dumps(e["summary"], indent=1))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "engine_bench.json"))
    ap.add_argument("--sections", default="env,bandwidth,gemv,attention,gather,e2e")
    ap.add_argument("--no-peers", action="store_true", help="time only our kernels")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=540.0,
        help="the e2e section plans its parts to end within this many seconds",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("engine_bench needs an NVIDIA GPU", file=sys.stderr)
        return 2
    sections = [s for s in args.sections.split(",") if s]
    out_path = Path(args.out)
    results: dict[str, Any] = {"started": _now(), "sections": sections}

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str))
        os.replace(tmp, out_path)

    read_bps = 4.1e12
    maker = None
    if "e2e" in sections:  # the random e2b checkpoint is CPU work: make it while kernels run
        import subprocess

        from lab.engine import e2e_bench

        maker = subprocess.Popen(
            [sys.executable, "-m", "lab.engine.e2e_bench", "make", "--ckpt", str(e2e_bench.E2B_DIR)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
    t_begin = time.time()
    for sec in sections:
        t0 = time.time()
        try:
            if sec == "env":
                results["env"] = section_env()
            elif sec == "bandwidth":
                results["bandwidth"] = section_bandwidth()
                read_bps = results["bandwidth"]["read_GBps"] * 1e9
            elif sec == "gemv":
                results["gemv"] = section_gemv(read_bps, peers=not args.no_peers)
            elif sec == "attention":
                results["attention"] = section_attention(read_bps)
            elif sec == "gather":
                results["gather"] = section_gather(read_bps)
            elif sec == "e2e":
                try:
                    from lab.engine import e2e_bench
                except ImportError as exc:
                    results["e2e"] = {"skipped": f"no e2e bench: {exc}"}
                else:
                    if maker is not None:
                        maker.wait()
                    budget = args.deadline_s - (time.time() - t_begin)
                    results["e2e"] = e2e_bench.run_all(read_bps, save_cb=save, partial=results,
                                                       budget_s=budget)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results[sec] = {"error": repr(exc)[:2000]}
        results.setdefault("seconds", {})[sec] = round(time.time() - t0, 1)
        print(f"== section {sec} done in {time.time() - t0:.1f}s", flush=True)
        save()
    results["finished"] = _now()
    save()
    print(_summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
