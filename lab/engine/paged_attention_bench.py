"""Batched paged decode attention against the single-sequence kernel, at Gemma 4 E2B shapes.

    python3 -m lab.engine.paged_attention_bench --out $OUT/paged_attention.json   # GPU
    python3 -m lab.engine.paged_attention_bench --smoke                           # CPU check

One call of PagedDecodeAttention (split + combine) at B rows, every row at the same context,
for the full layer (D 512, pages of 16 positions, shuffled block tables) and the sliding layer
(D 256, a 512-slot ring per sequence, window 512), beside DecodeAttention at B = 1 over a
contiguous cache of the engine's kind (8,192 slots full, the 512-slot ring). Timed as the
engine runs it: inside a CUDA graph, median over replays. `cold`: the graph holds one call on
each of several copies of the pools (copies together over 256 MB, several times the H200's
L2), so each call reads its keys from HBM; `hot`: the same number of calls on one copy (small
caches then come from L2). GB/s counts the visible keys and values read (K and V, bf16).
Imports only torch, triton and engine.kernels, as the device machine has nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

H = 8
DTYPE = torch.bfloat16
LAYERS = {  # kind: head_dim, ring slots (0: paged), window
    "full": (512, 0, 0),
    "ring": (256, 512, 512),
}
BLOCK_SIZE = 16
MAX_CONTEXT = 8192
COLD_BYTES = 256 << 20
# --sweep NAME: (layer, rows, context, max_batch) x (BLOCK_S, warps, splits per row, pipeline
# stages) beside the defaults (full: 32 keys a tile, 4 warps, 2 stages; ring: 64 keys, at most
# one slice per 64 keys; splits about 2 per SM over the batch)
_LONG = [("full", 16, 4096, 16), ("full", 8, 4096, 8)]
SWEEPS = {
    "tiles": [
        *[
            (("full", r, c, r), (*t, None))
            for r, c in ((16, 4096), (8, 4096), (1, 4096), (16, 512))
            for t in ((32, 8, None), (64, 4, None), (64, 8, None), (16, 4, None))
        ],
        *[(("ring", 16, 512, 16), (*t, None)) for t in ((32, 4, 16), (16, 4, 16), (32, 8, 16))],
    ],
    "stages": [
        *[
            (shape, t)
            for shape in _LONG
            for t in (
                (None, None, 32, None),
                (None, None, None, 3),
                (None, None, 32, 3),
                (None, None, 64, 2),
                (None, None, None, 1),
            )
        ],
        (("full", 1, 4096, 1), (None, None, None, 3)),
    ],
    # a full layer's 16-key tile at one row (faster at 640 tokens, v21) against the default
    # at long contexts, with the split count of an engine holding 131,072 tokens (264 on an
    # H100 / H200 at one row) and of one holding 8,192 (128)
    "full_long": [
        (("full", 1, c, 1), (t, 4, sp, None))
        for c in (4096, 32768, 131072)
        for sp in (128, 264)
        for t in (32, 16)
    ],
    # the sweep's decode depth (512-token prompts, 128 new tokens) at the buckets of c=1 / c=8
    "short": [
        *[
            (("ring", r, 640, r), (*t, None))
            for r in (8, 1)
            for t in (
                (None, None, None),
                (32, 4, 16),
                (16, 4, 32),
                (32, 8, 16),
                (16, 2, 32),
                (64, 8, 8),
            )  # fmt: skip
        ],
        *[
            (("full", r, 640, r), (*t, None))
            for r in (8, 1)
            for t in (
                (None, None, None),
                (16, 4, None),
                (32, 8, None),
                (64, 4, None),
                (16, 2, None),
                (16, 4, 64),
            )  # fmt: skip
        ],
    ],
}
MAX_COPIES = 32


def _pools(kind: str, rows: int, ctx: int, copies: int, device: torch.device) -> list[tuple]:
    """`copies` independent (k, v, block table) sets for `rows` sequences of context `ctx`."""
    dim, r_slots, _ = LAYERS[kind]
    out = []
    for _ in range(copies):
        if r_slots:
            k = torch.randn(rows * r_slots, dim, device=device, dtype=DTYPE)
            v = torch.randn(rows * r_slots, dim, device=device, dtype=DTYPE)
            out.append((k, v, None))
            continue
        per_seq = triton_cdiv(ctx, BLOCK_SIZE)
        num_blocks = rows * per_seq
        table = torch.randperm(num_blocks, device=device).to(torch.int32).view(rows, per_seq)
        k = torch.randn(num_blocks * BLOCK_SIZE, dim, device=device, dtype=DTYPE)
        v = torch.randn(num_blocks * BLOCK_SIZE, dim, device=device, dtype=DTYPE)
        out.append((k, v, table))
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _keys_read(kind: str, ctx: int) -> int:
    _, r_slots, window = LAYERS[kind]
    return min(ctx, window) if r_slots else ctx


def _time_graph(calls, device: torch.device, replays: int) -> float:
    """Median microseconds of one replay of a graph holding `calls` (a list of thunks)."""
    for c in calls:  # compile and warm outside the capture
        c()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def measure(
    kind: str,
    rows: int,
    ctx: int,
    max_batch: int,
    device,
    smoke: bool,
    tiling: tuple[int | None, ...] = (None, None, None, None),
) -> dict:
    """One PagedDecodeAttention call; `tiling` (BLOCK_S, warps, splits per row, stages)
    overrides the defaults for the --sweep rows."""
    from engine.kernels.attention_paged import PagedDecodeAttention, paged_attention_reference

    dim, r_slots, window = LAYERS[kind]
    bytes_per_call = rows * _keys_read(kind, ctx) * dim * 2 * DTYPE.itemsize
    copies = 1 if smoke else max(1, min(MAX_COPIES, triton_cdiv(COLD_BYTES, bytes_per_call)))
    pools = _pools(kind, rows, ctx, copies, device)
    att = PagedDecodeAttention(H, dim, max_batch, MAX_CONTEXT, device, ring=bool(r_slots),
                               ring_slots=r_slots, window=window, block_size=BLOCK_SIZE,
                               scale=1.0, block_s=tiling[0], splits=tiling[2])  # fmt: skip
    if tiling[1]:
        att.num_warps = tiling[1]
    if tiling[3]:
        att.num_stages = tiling[3]
    q = (0.05 * torch.randn(rows, H, dim, device=device)).to(DTYPE)
    positions = torch.full((rows,), ctx - 1, dtype=torch.int64, device=device)
    seq_slots = torch.arange(rows, dtype=torch.int32, device=device)
    out = torch.empty(rows, H, dim, device=device, dtype=DTYPE)

    def call(p):
        return lambda: att(q, p[0], p[1], positions, seq_slots, p[2], out=out)

    replays = 2 if smoke else 50
    n = len(pools)
    cold = _time_graph([call(p) for p in pools], device, replays) / n
    hot = _time_graph([call(pools[0])] * n, device, replays) / n
    row = {"layer": kind, "head_dim": dim, "rows": rows, "context": ctx, "max_batch": max_batch,
           "splits_per_row": att.splits, "use_dot": att.use_dot, "block_s": att.block_s,
           "num_warps": att.num_warps, "num_stages": att.num_stages, "copies": n,
           "keys_per_row": _keys_read(kind, ctx), "mb_read": round(bytes_per_call / 1e6, 3),
           "us_cold": round(cold, 2), "us_hot": round(hot, 2),
           "gbps_cold": round(bytes_per_call / cold / 1e3, 1),
           "gbps_hot": round(bytes_per_call / hot / 1e3, 1)}  # fmt: skip
    # the answer, not only the speed: the hot graph's call (on copy 0) against the reference
    k, v, table = pools[0]
    want = paged_attention_reference(q, k, v, positions, seq_slots, table, ring=bool(r_slots),
                                     ring_slots=r_slots, window=window,
                                     block_size=BLOCK_SIZE)  # fmt: skip
    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
    row["rel_err_vs_reference"] = float(f"{err:.3g}")
    return row


def measure_single(kind: str, ctx: int, device, smoke: bool) -> dict:
    """DecodeAttention at one sequence, its cache contiguous (8,192 slots, or the ring)."""
    from engine.kernels.attention_decode import DecodeAttention

    dim, r_slots, window = LAYERS[kind]
    slots = r_slots or MAX_CONTEXT
    bytes_per_call = _keys_read(kind, ctx) * dim * 2 * DTYPE.itemsize
    copies = 1 if smoke else max(1, min(MAX_COPIES, triton_cdiv(COLD_BYTES, bytes_per_call)))
    caches = [(torch.randn(slots, dim, device=device, dtype=DTYPE),
               torch.randn(slots, dim, device=device, dtype=DTYPE)) for _ in range(copies)]  # fmt: skip
    att = DecodeAttention(H, dim, slots, device, ring=bool(r_slots), window=window)
    q = (0.05 * torch.randn(H, dim, device=device)).to(DTYPE)
    pos = torch.tensor([ctx - 1], device=device)
    out = torch.empty(H, dim, device=device, dtype=DTYPE)

    def call(c):
        return lambda: att(q, c[0], c[1], pos, out=out)

    replays = 2 if smoke else 50
    cold = _time_graph([call(c) for c in caches], device, replays) / copies
    hot = _time_graph([call(caches[0])] * copies, device, replays) / copies
    return {"layer": kind, "head_dim": dim, "rows": 1, "context": ctx, "kernel": "DecodeAttention",
            "splits": att.splits, "copies": copies, "mb_read": round(bytes_per_call / 1e6, 3),
            "us_cold": round(cold, 2), "us_hot": round(hot, 2),
            "gbps_cold": round(bytes_per_call / cold / 1e3, 1),
            "gbps_hot": round(bytes_per_call / hot / 1e3, 1)}  # fmt: skip


def sweep(name: str, device: torch.device) -> dict:
    rows = []
    for (kind, r, ctx, max_batch), tiling in SWEEPS[name]:
        row = measure(kind, r, ctx, max_batch, device, False, tiling)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device), f"sweep_{name}": rows}


def run(rows_list: list[int], contexts: list[int], device: torch.device, smoke: bool) -> dict:
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu (TRITON_INTERPRET=1)", "dtype": "bfloat16", "heads": H,
                           "block_size": BLOCK_SIZE, "max_context": MAX_CONTEXT,
                           "paged": [], "single": []}  # fmt: skip
    for kind in LAYERS:
        for ctx in contexts:
            r = measure_single(kind, ctx, device, smoke)
            res["single"].append(r)
            print(json.dumps(r), flush=True)
            for rows in rows_list:
                # a graph bucket of exactly `rows`; at one row also an instance sized for 16
                for max_batch in sorted({rows, max(rows_list)} if rows == 1 else {rows}):
                    r = measure(kind, rows, ctx, max_batch, device, smoke)
                    res["paged"].append(r)
                    print(json.dumps(r), flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under the Triton interpreter, checked against "
                         "the reference")  # fmt: skip
    ap.add_argument("--sweep", choices=sorted(SWEEPS),
                    help="only these variants of tiles, warps, splits, stages (GPU)")  # fmt: skip
    ap.add_argument("--out", default=None,
                    help="the JSON result (default: $OUT/paged_attention.json on the GPU, "
                         "none with --smoke)")  # fmt: skip
    args = ap.parse_args(argv)
    rows_list = [int(x) for x in args.rows.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    if args.smoke and args.sweep:
        ap.error("--sweep is for the GPU; --smoke alone checks the CPU path")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        for name in ("engine.kernels.attention_decode", "engine.kernels.attention_paged"):
            if name in sys.modules:
                import importlib

                importlib.reload(sys.modules[name])
        global MAX_CONTEXT
        MAX_CONTEXT = 256
        LAYERS.update(full=(32, 0, 0), ring=(32, 64, 48))
        rows_list, contexts, device = [1, 3], [40, 200], torch.device("cpu")
    elif not torch.cuda.is_available():
        ap.error("no CUDA GPU here: run with --smoke for the CPU check")
    else:
        device = torch.device("cuda")
    res = sweep(args.sweep, device) if args.sweep else run(rows_list, contexts, device, args.smoke)
    if args.smoke:
        worst = max(r["rel_err_vs_reference"] for r in res["paged"])
        print(f"smoke: worst relative error against the reference {worst:.2e}")
        if worst > 3e-2:
            return 1
    if args.out is None and args.smoke:
        return 0
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "paged_attention.json")
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, out_path)  # written whole or not at all
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
