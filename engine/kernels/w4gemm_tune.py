"""Tile choice for the int4 few-row product: which (path, BLOCK_N, BLOCK_KW, warps, stages,
split-K) runs a shape fastest for a row-count bucket (2, 4, 8, 16) on this GPU.

Order of lookup: the tuning cache (engine/kernels/tuning.py, kernel "w4gemm"), then the table
measured on the lent H200 (engine/kernels/configs/w4gemm_NVIDIA_H200.json), then, outside CUDA-graph capture
with autotuning on, a timing of the candidates (stored in the cache), else `default_config`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
import triton

from engine.kernels import tuning
from engine.kernels.attention_decode import dot_for_capability
from engine.kernels.w4gemm_kernel import (
    KERNEL_NAME,
    KERNEL_VERSION,
    default_config,
    launch,
    workspace,
)

_log = logging.getLogger(__name__)


def tuned_table(gpu: str) -> dict[str, dict[str, Any]]:
    """The table measured on this GPU model and shipped with the package (empty if none):
    lab/engine/gemm_bench.py --tune on the lent H200, bf16, shape key -> tiling."""
    return tuning.shipped_table("w4gemm", gpu)


# tensor-core tilings: (BLOCK_N, BLOCK_KW, num_warps, SWAP, SLAB, PIPE). SLAB: K taken nibble
# by nibble (8 dots per step, no reshape of the unpacked tile); SWAP: the weight tile is the
# dot's A operand (wgmma on Hopper). Split-K is added per shape where N gives few tiles.
_TC_TILES = (
    (16, 16, 2, False, False, True),
    (32, 8, 2, False, False, True),
    (64, 16, 4, True, False, True),
    (128, 8, 4, True, False, True),
    (32, 16, 4, False, True, False),
    (64, 16, 4, False, True, False),
    (32, 32, 4, False, True, True),
    (64, 16, 4, True, True, False),
    (64, 16, 4, True, True, True),
    (64, 32, 4, True, True, False),
    (128, 16, 4, True, True, False),
    (128, 16, 8, True, True, False),
)
# multiply-and-sum tilings (BLOCK_N, BLOCK_KW, num_warps, SLAB): Turing, and few rows anywhere;
# SLAB: the [rows, BLOCK_N, BLOCK_KW] accumulator takes one nibble position at a time
_FMA_TILES = ((4, 8, 4, False), (8, 16, 4, True), (16, 16, 4, True), (4, 32, 4, True),
              (16, 32, 8, True), (32, 8, 4, True))  # fmt: skip


def bucket(m: int) -> int:
    """The row-count bucket a config is chosen for: 2, 4, 8 or 16."""
    return max(2, triton.next_power_of_2(m))


def shape_key(n: int, k: int, dtype: torch.dtype, m: int, tc: bool) -> str:
    path = "tc" if tc else "fma"
    return f"v{KERNEL_VERSION}_N{n}_K{k}_{str(dtype).removeprefix('torch.')}_M{bucket(m)}_{path}"


@functools.cache
def use_tc(device_index: int) -> bool:
    """Tensor cores for this GPU (sm_80 on), by the attention kernel's rule."""
    return dot_for_capability(torch.cuda.get_device_capability(device_index))


def path_for(device: torch.device) -> bool:
    """True: the tensor-core path. The CPU interpreter runs tl.dot too (the GPU's path)."""
    return device.type != "cuda" or use_tc(device.index or 0)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def candidate_configs(n: int, k: int, m: int, tc: bool, epi: int = 0) -> list[dict[str, Any]]:
    """The tilings worth timing for one shape and row bucket: the tensor-core ones where the
    GPU has them, the multiply-and-sum ones (alone below sm_80; beside them up to 8 rows)."""
    kw = k // 8
    tiles = []
    if tc:
        tiles += [dict(TC=True, BLOCK_N=bn, BLOCK_KW=bkw, num_warps=w, SWAP=sw, SLAB=sl, PIPE=pp)
                  for bn, bkw, w, sw, sl, pp in _TC_TILES]  # fmt: skip
    if not tc or bucket(m) <= 8:
        tiles += [dict(TC=False, BLOCK_N=bn, BLOCK_KW=bkw, num_warps=w, SWAP=False, SLAB=sl,
                       PIPE=True) for bn, bkw, w, sl in _FMA_TILES
                  if bucket(m) * bn * bkw * (1 if sl else 8) <= 8192]  # fmt: skip
    out = []
    for t in tiles:
        if t["BLOCK_KW"] > max(2, triton.next_power_of_2(kw)) or (epi == 1 and t["BLOCK_N"] % 2):
            continue
        n_tiles = triton.cdiv(n, t["BLOCK_N"])
        for split in (1, 2, 4, 8):
            if split > 1 and (n_tiles >= 2 * 132 or kw // split < 2 * t["BLOCK_KW"]):
                continue  # split-K only where N gives few tiles
            out.append(dict(t, num_stages=2, SPLIT=split, FUSED=True))
    return out


def random_layer(n: int, k: int, dtype: torch.dtype, device: torch.device,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random packed words [n, k/8] and small positive scales [n, k/32] of one int4 layer."""
    p = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=device, dtype=torch.int32,
                      generator=gen)  # fmt: skip
    return p, (torch.rand(n, k // 32, device=device, generator=gen) * 0.02 + 0.001).to(dtype)


def random_sets(n: int, k: int, dtype: torch.dtype, m: int, device: torch.device, epi: int = 0):
    """Copies of random operands of one shape, enough to rotate past the L2 (each call then
    reads device memory, as in a decode step): [(x [m, K], packed, scales, out)]."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    one = n * k // 2 + n * k // 16
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    sets = []
    for _ in range(max(2, min(64, math.ceil(3 * l2 / one)))):
        p, s = random_layer(n, k, dtype, device, gen)
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        y = torch.empty(m, n // 2 if epi == 1 else n, device=device, dtype=dtype)
        sets.append((x, p, s, y))
    return sets


def tune(n: int, k: int, dtype: torch.dtype, m: int, device: torch.device, epi: int = 0,
         candidates: list[dict[str, Any]] | None = None, sets=None):  # fmt: skip
    """Time every candidate on random data of this shape (`random_sets`, or `sets` whose x has
    at least m rows); returns (best, us, all)."""
    tc = path_for(device)
    sets = sets or random_sets(n, k, dtype, m, device, epi)
    sets = [(x[:m], p, s, y[:m]) for x, p, s, y in sets]
    aux = torch.rand(m, n, device=device).to(dtype) if epi == 2 else None
    candidates = candidates or candidate_configs(n, k, m, tc, epi)
    ws, tk = workspace(device, 8 * m * n, triton.cdiv(n, 2))

    def make_calls(cfg):
        return [lambda a=a, cfg=cfg: launch(a[0], a[1], a[2], a[3], cfg, epi=epi, aux=aux,
                                            ws=ws, tickets=tk) for a in sets]  # fmt: skip

    return tuning.pick_fastest(candidates, make_calls)


def config_for(n: int, k: int, dtype: torch.dtype, m: int, device: torch.device) -> dict[str, Any]:
    """The config for this shape and row bucket (see the module's docstring for the order)."""
    tc = path_for(device)
    if device.type != "cuda":  # the CPU interpreter: few, big programs run fastest
        return {"TC": True, "BLOCK_N": 64, "BLOCK_KW": 16, "num_warps": 4, "num_stages": 1,
                "SPLIT": 1, "FUSED": True, "SWAP": False, "PIPE": True}  # fmt: skip
    gpu = tuning.gpu_key(device)
    key = shape_key(n, k, dtype, m, tc)
    cfg = tuning.lookup(KERNEL_NAME, key, gpu)
    if cfg is None:
        cfg = tuned_table(gpu).get(key)
    if cfg is not None:
        return cfg
    if dtype == torch.float32:  # exactness runs: the multiply-and-sum's fp32 FMAs, untuned
        return default_config(n, k, m, False, _sms(device))
    if not tuning.autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return default_config(n, k, m, tc, _sms(device))
    try:
        best, us, _ = tune(n, k, dtype, bucket(m), device)
    except torch.OutOfMemoryError:  # a capped card: tune another time, run the default now
        torch.cuda.empty_cache()
        return default_config(n, k, m, tc, _sms(device))
    except RuntimeError as exc:  # no candidate compiled here: the default, and say so
        _log.warning("w4gemm: tuning N=%d K=%d %s failed (%s); default tiles", n, k, dtype, exc)
        return default_config(n, k, m, tc, _sms(device))
    best = dict(best, us=round(us, 3))
    _log.info("w4gemm: tuned N=%d K=%d %s M<=%d on %s: %s", n, k, dtype, bucket(m), gpu, best)
    tuning.store(KERNEL_NAME, key, gpu, best)
    return best
