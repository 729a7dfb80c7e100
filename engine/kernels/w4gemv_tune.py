"""Tile tuning for the int4 GEMV: which (BLOCK_N, BLOCK_KW, warps, stages, PIPE) runs a shape
fastest on this GPU, timed once and stored through engine/kernels/tuning.py."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import triton

from engine.kernels import tuning
from engine.kernels.w4gemv_kernel import (
    ASM_MEMO,
    KERNEL_NAME,
    default_config,
    h2_on,
    launch,
    shape_key,
)

_log = logging.getLogger(__name__)

# (BLOCK_N, BLOCK_KW, num_warps, num_stages); BLOCK_KW counts int32 words (8 codes each).
# Tiles with several rows per thread let one thread reuse its activations across rows, which is
# what keeps the unpacking arithmetic (not the memory) from being the limit on a fast card.
_CANDIDATE_TILES = (
    (1, 64, 1, 2),
    (1, 128, 1, 2),
    (1, 256, 2, 2),
    (2, 128, 2, 2),
    (2, 256, 2, 2),
    (4, 64, 1, 3),
    (4, 128, 2, 2),
    (4, 256, 4, 2),
    (4, 256, 8, 3),
    (4, 128, 4, 3),
    (8, 32, 1, 2),
    (8, 64, 1, 2),
    (8, 64, 2, 2),
    (8, 128, 2, 2),
    (8, 128, 4, 2),
    (8, 256, 4, 2),
    (8, 256, 8, 2),
    (16, 32, 1, 2),
    (16, 64, 1, 2),
    (16, 64, 2, 2),
    (16, 128, 2, 2),
    (16, 128, 4, 2),
    (16, 256, 4, 2),
    (16, 256, 8, 2),
    (16, 64, 4, 2),
    (32, 32, 1, 2),
    (32, 64, 2, 2),
    (32, 128, 4, 2),
    (32, 256, 8, 2),
    (32, 64, 4, 2),
    (64, 32, 2, 2),
    (64, 64, 4, 2),
    # more warps on narrow rows
    (8, 32, 4, 2),
    (16, 32, 4, 2),
    (32, 32, 4, 2),
    (64, 32, 8, 2),
    (16, 64, 8, 2),
)


def candidate_configs(n: int, k: int, epi: int = 0) -> list[dict[str, Any]]:
    """The tilings worth timing for one shape (BLOCK_KW no wider than the row; the GLU epilogue
    needs whole (gate, up) row pairs, so an even BLOCK_N)."""
    kw = k // 8
    out = []
    for bn, bkw, warps, stages in _CANDIDATE_TILES:
        if bkw > max(32, triton.next_power_of_2(kw)) or (epi == 1 and bn % 2):
            continue
        tile = {"BLOCK_N": bn, "BLOCK_KW": bkw, "num_warps": warps, "num_stages": stages}
        out.append(dict(tile, PIPE=True))
        if kw > bkw:  # several K steps: loading after the arithmetic is the other choice
            out.append(dict(tile, PIPE=False))
    return out


def tune(
    n: int,
    k: int,
    dtype: torch.dtype,
    m: int = 1,
    device: torch.device | None = None,
    epi: int = 0,
    candidates: list[dict[str, Any]] | None = None,
    half2: bool = True,
) -> tuple[dict[str, Any], float, list[tuple[dict[str, Any], float]]]:
    """Time every candidate tiling on random data of this shape, with the epilogue it will run
    with; returns (best, us, all)."""
    device = device or torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    one = n * k // 2 + n * k // 16  # bytes of codes + scales
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    copies = max(2, min(64, math.ceil(3 * l2 / one)))
    sets = []
    for _ in range(copies):
        p = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=device, dtype=torch.int32,
                          generator=gen)  # fmt: skip
        s = (torch.rand(n, k // 32, device=device, generator=gen) * 0.02 + 0.001).to(dtype)
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        y = torch.empty(m, n // 2 if epi == 1 else n, device=device, dtype=dtype)
        sets.append((x, p, s, y))
    aux = torch.rand(n, device=device, generator=gen).to(dtype) + 0.5
    extra: dict[str, Any] = {"aux": aux} if epi == 2 else {}

    def make_calls(cfg):
        return [lambda a=a, cfg=cfg: launch(a[0], a[1], a[2], a[3], cfg, epi=epi, half2=half2, **extra)
                for a in sets]  # fmt: skip

    candidates = candidates or candidate_configs(n, k, epi)
    try:
        best, us, results = tuning.pick_fastest(candidates, make_calls)
    except RuntimeError:  # nothing built: retry with the plain (two-instruction) unpack
        if not ASM_MEMO["ok"]:
            raise
        ASM_MEMO["ok"] = False
        best, us, results = tuning.pick_fastest(candidates, make_calls)
    return best, us, results


_TILES_ONLY = ("BLOCK_N", "BLOCK_KW", "num_warps", "num_stages", "PIPE")


def config_for(
    n: int, k: int, dtype: torch.dtype, m: int, device: torch.device, half2: bool = True
) -> dict[str, Any]:
    """Stored config for this shape on this GPU; tune now if allowed and possible, else default.

    The GLU and GELU epilogues add a few instructions per output and use the plain GEMV's
    tiling, so every launch of a shape shares one entry."""
    if device.type != "cuda":  # the CPU interpreter: few, big programs run fastest
        return {"BLOCK_N": 64, "BLOCK_KW": min(128, default_config(n, k)["BLOCK_KW"]),
                "num_warps": 4, "num_stages": 1}  # fmt: skip
    gpu = tuning.gpu_key(device)
    key = shape_key(n, k, dtype, m, h2_on(dtype, device, half2))
    cfg = tuning.lookup(KERNEL_NAME, key, gpu)
    if cfg is not None:
        return cfg
    if not tuning.autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return default_config(n, k)
    try:
        best, us, results = tune(n, k, dtype, m, device, half2=half2)
    except torch.OutOfMemoryError:  # a capped card: tune another time, run the default now
        torch.cuda.empty_cache()
        return default_config(n, k)
    best = dict(best, us=round(us, 3))
    _log.info("w4gemv: tuned N=%d K=%d %s on %s: %s (%.2f us)", n, k, dtype, gpu,
              {t: best[t] for t in _TILES_ONLY if t in best}, us)  # fmt: skip
    no_pipe = [t for c, t in results if not c.get("PIPE", True)]
    if no_pipe:  # kept beside the choice: what the software pipeline gained on this shape
        best["us_no_pipe"] = round(min(no_pipe), 3)
    tuning.store(KERNEL_NAME, key, gpu, best)
    return best
