"""int4 GEMV: y = x @ dequant(W).T straight from the packed int32 words (decode, batch 1).

Layout (compressed-tensors "pack-quantized", symmetric, group 32): ``packed`` int32 [N, K/8],
element k of a row in word k//8 at bits 4*(k%8), stored unsigned as q+8; ``scales`` [N, K/32]
in fp16/bf16. ``w[n, k] = (code - 8) * scales[n, k // 32]``.

Why it is written this way: at batch 1 every weight is read once per token, so the kernel must
stream the packed words at the card's read bandwidth and never write a 16-bit copy. On a fast
card (an H200 reads 4+ TB/s, i.e. 8e12 codes/s) the unpacking arithmetic itself becomes the
limit, so each code costs one logic instruction and two float ones:

* the magic-number conversion: OR a 4-bit field into the mantissa of 2^23 (0x4B000000) and the
  fp32 bit pattern reads 2^23 + field, exactly; subtracting 2^23 + 8 gives code - 8. This skips
  the integer-to-float conversion (slow on Turing) and the shift before it.
* nibbles 0..4 are masked in place (the field may sit anywhere in the 23 mantissa bits, so
  nibble j reads 2^23 + code * 16^j); the 16^-j is folded into the activation, which is loaded
  once per tile and shared by all BLOCK_N rows. Nibbles 5..7 are shifted once by 20 bits.
  Every step is exact in fp32 (powers of two), so the result is the true dot product.
* one program owns BLOCK_N whole rows and walks K; no split-K, no atomics, no second pass:
  small BLOCK_N gives the parallelism instead. The tiling is chosen per (N, K) on the device.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels import tuning

KERNEL_NAME = "w4gemv"
_MAGIC = 0x4B000000
_TWO23 = 8388608.0

# (BLOCK_N, BLOCK_KW, num_warps, num_stages); BLOCK_KW counts int32 words (8 codes each).
# Tiles with several rows per thread let one thread reuse its activations across rows, which is
# what keeps the unpacking arithmetic (not the memory) from being the limit on a fast card.
_CANDIDATE_TILES = [
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
]


@triton.jit
def _nibble_dot(w, x_ptrs, k_mask, MASK: tl.constexpr, OFFSET: tl.constexpr,
                XSCALE: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """(code_j - 8) * x_j for one nibble position j of every word in the tile (exact)."""
    xj = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32) * XSCALE
    if USE_ASM:  # (w & MASK) | 2^23 in ONE lop3 (ptxas emits two LOP3s for the plain form)
        bits = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
            [w, tl.full(w.shape, MASK, tl.int32), tl.full(w.shape, 0x4B000000, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        bits = (w & MASK) | 0x4B000000
    v = bits.to(tl.float32, bitcast=True) - OFFSET
    return v * xj[None, :]


@triton.jit
def _w4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K, stride_xm, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    KW = K // 8
    G = K // 32
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_KW)
    n_mask = rn < N
    rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
    w_ptrs = w_ptr + rn_safe[:, None] * KW + rk[None, :]
    s_ptrs = s_ptr + rn_safe[:, None] * G + rk[None, :] // 4
    x_ptrs = x_ptr + pid_m * stride_xm + rk * 8
    acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    for kw0 in range(0, KW, BLOCK_KW):
        if EVEN_K:
            k_mask = rk < BLOCK_KW
            w = tl.load(w_ptrs)
            s = tl.load(s_ptrs).to(tl.float32)
        else:
            k_mask = (kw0 + rk) < KW
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0)
            s = tl.load(s_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
        part = _nibble_dot(w, x_ptrs + 0, k_mask, 0xF, 8388616.0, 1.0, USE_ASM)
        part += _nibble_dot(w, x_ptrs + 1, k_mask, 0xF0, 8388736.0, 0.0625, USE_ASM)
        part += _nibble_dot(w, x_ptrs + 2, k_mask, 0xF00, 8390656.0, 0.00390625, USE_ASM)
        part += _nibble_dot(w, x_ptrs + 3, k_mask, 0xF000, 8421376.0, 0.000244140625, USE_ASM)
        part += _nibble_dot(w, x_ptrs + 4, k_mask, 0xF0000, 8912896.0, 0.0000152587890625, USE_ASM)
        wh = w >> 20
        part += _nibble_dot(wh, x_ptrs + 5, k_mask, 0xF, 8388616.0, 1.0, USE_ASM)
        part += _nibble_dot(wh, x_ptrs + 6, k_mask, 0xF0, 8388736.0, 0.0625, USE_ASM)
        part += _nibble_dot(wh, x_ptrs + 7, k_mask, 0xF00, 8390656.0, 0.00390625, USE_ASM)
        acc += part * s
        w_ptrs += BLOCK_KW
        s_ptrs += BLOCK_KW // 4
        x_ptrs += BLOCK_KW * 8
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + pid_m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def w4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The PyTorch ground truth: dequantize to fp32 and multiply (any device)."""
    return (x.float() @ dequantize_reference(packed, scales).T).to(x.dtype)


def dequantize_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from packed int32 [N, K/8] and scales [N, K/32]."""
    n, kw = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    q = codes.reshape(n, kw * 8).float() - 8.0
    return q * scales.float().repeat_interleave(32, dim=1)


def _default_config(n: int, k: int) -> dict[str, Any]:
    """A reasonable tiling when nothing is tuned (CPU interpreter, capture, tuning off)."""
    kw = k // 8
    if n >= 4096 and kw >= 64:  # several rows per thread: the activations are reused
        return {"BLOCK_N": 8, "BLOCK_KW": 64, "num_warps": 2, "num_stages": 2}
    block_kw = 256 if kw >= 256 else triton.next_power_of_2(max(kw, 16))
    return {"BLOCK_N": 4, "BLOCK_KW": block_kw, "num_warps": 4, "num_stages": 2}


KERNEL_VERSION = 2  # bump when the kernel changes: stored tilings of older versions are ignored


def _shape_key(n: int, k: int, dtype: torch.dtype, m: int) -> str:
    return f"v{KERNEL_VERSION}_N{n}_K{k}_{str(dtype).removeprefix('torch.')}_M{min(m, 4)}"


_ASM = {"ok": True}  # cleared if the inline-PTX variant ever fails to build on this machine


def _use_asm(t: torch.Tensor) -> bool:
    """The inline-PTX lop3 runs on NVIDIA GPUs only (not in the CPU interpreter)."""
    return (
        _ASM["ok"]
        and t.is_cuda
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
    )


def _launch(x2, packed, scales, y, cfg: dict[str, Any]) -> None:
    m, k = x2.shape
    n = packed.shape[0]
    kw = k // 8
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), m)
    _w4_gemv_kernel[grid](
        x2, packed, scales, y, n, k, x2.stride(0), y.stride(0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=cfg["BLOCK_KW"], EVEN_K=(kw % cfg["BLOCK_KW"] == 0),
        USE_ASM=_use_asm(x2), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def candidate_configs(n: int, k: int) -> list[dict[str, Any]]:
    """The tilings worth timing for one shape (BLOCK_KW no wider than the row)."""
    kw = k // 8
    out = []
    for bn, bkw, warps, stages in _CANDIDATE_TILES:
        if bkw > max(32, triton.next_power_of_2(kw)):
            continue
        out.append({"BLOCK_N": bn, "BLOCK_KW": bkw, "num_warps": warps, "num_stages": stages})
    return out


def tune(
    n: int, k: int, dtype: torch.dtype, m: int = 1, device: torch.device | None = None
) -> tuple[dict[str, Any], float, list[tuple[dict[str, Any], float]]]:
    """Time every candidate tiling on random data of this shape; returns (best, us, all)."""
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
        y = torch.empty(m, n, device=device, dtype=dtype)
        sets.append((x, p, s, y))

    def make_calls(cfg):
        return [lambda a=a, cfg=cfg: _launch(a[0], a[1], a[2], a[3], cfg) for a in sets]

    try:
        best, us, results = tuning.pick_fastest(candidate_configs(n, k), make_calls)
    except RuntimeError:  # nothing built: retry with the plain (two-instruction) unpack
        if not _ASM["ok"]:
            raise
        _ASM["ok"] = False
        best, us, results = tuning.pick_fastest(candidate_configs(n, k), make_calls)
    return best, us, results


def config_for(n: int, k: int, dtype: torch.dtype, m: int, device: torch.device) -> dict[str, Any]:
    """Stored config for this shape on this GPU; tune now if allowed and possible, else default."""
    if device.type != "cuda":  # the CPU interpreter: few, big programs run fastest
        return {"BLOCK_N": 64, "BLOCK_KW": min(128, _default_config(n, k)["BLOCK_KW"]),
                "num_warps": 4, "num_stages": 1}  # fmt: skip
    gpu = tuning.gpu_key(device)
    key = _shape_key(n, k, dtype, m)
    cfg = tuning.lookup(KERNEL_NAME, key, gpu)
    if cfg is not None:
        return cfg
    if not tuning.autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return _default_config(n, k)
    try:
        best, us, _ = tune(n, k, dtype, m, device)
    except torch.OutOfMemoryError:  # a capped card: tune another time, run the default now
        torch.cuda.empty_cache()
        return _default_config(n, k)
    best = dict(best, us=round(us, 3))
    tuning.store(KERNEL_NAME, key, gpu, best)
    return best


def w4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """y[..., N] = x[..., K] @ dequant(packed, scales).T, accumulated in fp32, in x's dtype.

    `out` (optional) receives the result; its dtype may differ from x's (e.g. fp32 logits).
    """
    k = x.shape[-1]
    n = packed.shape[0]
    if packed.shape[1] * 8 != k or scales.shape != (n, k // 32) or k % 32:
        raise ValueError(
            f"w4_gemv: x has K={k}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}; "
            "expected packed [N, K/8] and scales [N, K/32] with K a multiple of 32"
        )
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = out.view(m, n) if out is not None else torch.empty(m, n, device=x.device, dtype=x.dtype)
    cfg = config or config_for(n, k, x.dtype, m, x.device)
    _launch(x2, packed.contiguous(), scales.contiguous(), y, cfg)
    return y.view(*x.shape[:-1], n)
