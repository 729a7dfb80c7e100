"""Warp tiling of the warp-level int4 product (engine/kernels/w4mma_kernel.py): how many warps a
program puts side by side along N (NWN) and along K (NWK) for a shape and row bucket.

Lookup: the table measured on the lent H200 (engine/kernels/configs/w4mma_NVIDIA_H200.json,
written from lab/engine/gemm_bench.py's `w4_mma` cells, which time every candidate), then
`default_config`, which follows the shape of that table (K split until a warp has about three
128-element steps; neighbouring tiles only for the widest matrices). Under Triton's CPU
interpreter, `interpreter_config`: there a program's cost is its count of Python-level tensor
operations whatever its width, so the widest tiling runs the fewest.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton

from engine.kernels import tuning
from engine.options import triton_interpreted


def candidate_configs(n: int, k: int) -> list[dict[str, Any]]:
    """Every (NWN, NWK, MT) of at most 16 warps whose K split divides the 128-element steps."""
    steps = k // 128
    return [
        {"NWN": nwn, "NWK": nwk, "MT": mt}
        for mt in (1, 2)
        for nwk in (1, 2, 4, 8, 16)
        for nwn in (1, 2, 4, 8)
        if nwn * nwk <= 16 and steps % nwk == 0 and triton.cdiv(n, 16 * mt) >= nwn
    ]


def tuned_table(gpu: str) -> dict[str, dict[str, Any]]:
    """The table measured on this GPU model and shipped with the package (empty if none)."""
    return tuning.shipped_table("w4mma", gpu)


def bucket(m: int) -> int:
    """The row-count bucket a tiling is chosen for: 2, 4, 8 or 16."""
    return max(2, triton.next_power_of_2(m))


def default_config(n: int, k: int, m: int) -> dict[str, Any]:
    steps = k // 128
    nwk = 1
    while nwk < 16 and steps % (2 * nwk) == 0 and steps // (2 * nwk) >= 3:
        nwk *= 2
    nwn = 2 if triton.cdiv(n, 16) >= 1536 and nwk <= 2 else 1
    cfg = {"NWN": nwn, "NWK": nwk, "MT": 1}
    return cfg if cfg in candidate_configs(n, k) else {"NWN": 1, "NWK": 1, "MT": 1}


def interpreter_config(n: int, k: int) -> dict[str, Any]:
    """The tiling with the fewest interpreted (program, K step) pairs: programs along N times
    each warp's 128-element steps, MT = 2 counted double (its steps do twice the operations)."""

    def cost(cfg: dict[str, Any]) -> tuple[int, int]:
        programs = triton.cdiv(n, 16 * cfg["NWN"] * cfg["MT"])
        return programs * (k // 128 // cfg["NWK"]) * cfg["MT"], cfg["MT"]

    return min(candidate_configs(n, k), key=cost)


@functools.cache
def _cached(n: int, k: int, b: int, gpu: str) -> tuple[int, int, int]:
    if gpu == "interpreter":
        cfg = interpreter_config(n, k)
    else:
        hit = tuned_table(gpu).get(f"N{n}_K{k}_M{b}")
        cfg = hit if hit else default_config(n, k, b)
    return cfg["NWN"], cfg["NWK"], cfg.get("MT", 1)


def config_for(n: int, k: int, m: int, device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        gpu = tuning.gpu_key(device)
    else:
        gpu = "interpreter" if triton_interpreted() else "cpu"
    nwn, nwk, mt = _cached(n, k, bucket(m), gpu)
    return {"NWN": nwn, "NWK": nwk, "MT": mt}
