"""Where a decode step's time goes in its chain: each kind of kernel taken out of the step graph.

    python3 -m bench.engine.step_ablation --out $OUT/ablation.json [--rows 1,8] [--depth 600] \
        [--carveouts 100,0]

A per-kernel profile of a PDL graph cannot say what a kind of kernel costs: each kernel's
recorded time includes its wait for the one before (bench/NOTES.md v28). Here each kind is
replaced, inside the engine's own step (engine/fast/batch_decode.py), by a stand-in that
launches nothing and returns a tensor of the right shape; the bucket's graph is captured again
and replayed. The step's time without a kind, against the whole step, is what that kind costs
in the chain (its kernels and their boundaries), the number a fusion or a faster kernel of that
kind can win at most. The logits of an ablated step are garbage; only its time is read.

Kinds: `products` (every int4 product: the GEMVs, their prologue and GLU variants, the mma
product, the lm_head), `attention` (the paged split and combine), `qkv_norm_rope` (the q/k/v
head norms, RoPE and the KV write), `residual_norm` (the residual+norm launches; the GEMV
prologue's stays with `products`), and `all_but_products` (the three together: what the
products' chain costs inside the step).

`--carveouts` then times the whole step under each shared-memory carveout (GPURIG_CARVEOUT),
captured again in the same process after the driver's choice (a kernel keeps a carveout once
given one, so the driver's comes first).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

KINDS = ("products", "attention", "qkv_norm_rope", "residual_norm", "all_but_products")


def _out_width(packed: torch.Tensor, epi: int) -> int:
    return packed.shape[0] // 2 if epi == 1 else packed.shape[0]


def _no_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out=None,
                epi: int = 0, **_: Any) -> torch.Tensor:  # fmt: skip
    return x.new_empty(*x.shape[:-1], _out_width(packed, epi))


def _no_prologue_product(y, h, w_post, eps, packed, scales, spare, epi: int = 0, **_: Any):
    return y.new_empty(_out_width(packed, epi))


def _no_qkv_rope(qkv, q_norm, k_norm, cos, sin, hq, kv_heads, hd, eps, **_: Any):
    return qkv[:, : hq * hd].unflatten(1, (hq, hd)), None, None


def _no_residual_norm(h, y, w_post, eps, **_: Any):
    return h, y


def _no_attention(self, layer: int, rows: int) -> Callable[..., torch.Tensor]:
    return lambda q, *args, **kwargs: q


def stand_ins(kind: str) -> list[tuple[Any, str, Any]]:
    """(module or class, attribute, stand-in) for one kind."""
    from engine.fast import batch_decode as bd
    from engine.fast import ops_fast

    table: dict[str, list[tuple[Any, str, Any]]] = {
        "products": [(bd, "w4_gemv", _no_product), (bd, "w4_gemv_glu", functools.partial(_no_product, epi=1)),
                     (bd, "w4_gemv_after_residual", _no_prologue_product),
                     (bd, "w4_gemm", _no_product), (ops_fast, "w4_gemv", _no_product)],
        "attention": [(bd.BatchDecoder, "_attn", _no_attention)],
        "qkv_norm_rope": [(bd, "qkv_rope_rows", _no_qkv_rope)],
        "residual_norm": [(bd, "residual_norm", _no_residual_norm)],
    }  # fmt: skip
    if kind == "all_but_products":
        return table["attention"] + table["qkv_norm_rope"] + table["residual_norm"]
    if kind not in table:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    return table[kind]


@contextlib.contextmanager
def ablated(kind: str | None) -> Iterator[None]:
    """Inside: the step runs without `kind` (None: the whole step); restored on exit."""
    patches = stand_ins(kind) if kind else []
    for owner, name, _ in patches:  # a renamed function would be added, not replaced
        if not hasattr(owner, name):
            raise AttributeError(f"step_ablation: {owner.__name__} has no {name} to replace")
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, stand_in in patches:
            setattr(owner, name, stand_in)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def step_us(eng, rows: int, depth: int, kind: str | None, iters: int = 50) -> float:
    """The bucket's step graph captured again under `kind`'s ablation and replayed with every
    row `depth` tokens deep (0: the padding rows the capture left)."""
    from bench.engine.batch_bench import replay_us, replay_us_at_depth

    graphs = eng.runner.graphs
    bucket = graphs._by_size[rows]
    with ablated(kind):
        bucket.graph = None
        graphs._capture(bucket)
    if depth:
        return replay_us_at_depth(eng, rows, depth, iters)
    return replay_us(bucket.graph, iters)


def ablation(eng, rows_list: list[int], depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rows in rows_list:
        whole = step_us(eng, rows, depth, None)
        row: dict[str, Any] = {"whole_us": round(whole, 1)}
        for kind in KINDS:
            us = step_us(eng, rows, depth, kind)
            row[kind] = {"step_us": round(us, 1), "kind_costs_us": round(whole - us, 1)}
            print(f"rows {rows} without {kind:17s} {us:8.1f} us (costs {whole - us:7.1f})",
                  flush=True)  # fmt: skip
        step_us(eng, rows, depth, None)  # the bucket's graph whole again
        out[f"rows_{rows}"] = row
    return out


def carveouts(eng, rows_list: list[int], depth: int, percents: list[int]) -> dict[str, Any]:
    """The whole step of each bucket under each carveout (engine/kernels/launch.py)."""
    from engine.kernels.launch import set_carveout

    out: dict[str, Any] = {}
    for percent in percents:
        set_carveout(percent)
        out[str(percent)] = {f"rows_{r}": round(step_us(eng, r, depth, None), 1)
                             for r in rows_list}  # fmt: skip
        print(f"carveout {percent}: {out[str(percent)]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.engine.batch_bench import E2B_DIR, load, make

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=E2B_DIR)
    ap.add_argument("--rows", default="1,8", help="buckets to ablate, comma-separated")
    ap.add_argument("--depth", type=int, default=600, help="tokens each row is deep (0: none)")
    ap.add_argument("--carveouts", default="", help="percentages to time the step under after")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    percents = [int(p) for p in args.carveouts.split(",") if p]
    make(args.ckpt)
    eng = load(args.ckpt, max_num_seqs=max(rows_list))
    if eng.runner.graphs is None:
        print("step_ablation: the engine captured no decode graphs (a CUDA GPU is needed)",
              file=sys.stderr)  # fmt: skip
        return 2
    result = {"device": torch.cuda.get_device_name(0), "depth": args.depth,
              "ablation": ablation(eng, rows_list, args.depth)}  # fmt: skip
    if percents:
        result["carveouts"] = carveouts(eng, rows_list, args.depth, percents)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
