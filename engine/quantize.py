"""W4A16 group quantization and the compressed-tensors int32 packing, as plain tensor functions.

Symmetric, one scale per group of `group_size` input elements: scale = max|w| / 7.5 rounded to
bf16, q = clamp(round(w / scale), -8, 7). (7.5 rather than 7 keeps the group's extreme inside the
4-bit range [-8, 7] after rounding while using the negative code -8.) Packing is
compressed-tensors' "pack-quantized" layout: 8 codes per int32 word along the input dimension,
element 0 in the lowest bits, stored unsigned as q + 8.
"""

from __future__ import annotations

import torch

QMIN, QMAX = -8, 7
SCALE_DIVISOR = 7.5


def quantize_groups(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes int8 [N, K], scales [N, K // group_size] in `scale_dtype`)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input width {k} is not a multiple of the group size {group_size}")
    groups = w.to(torch.float32).reshape(n, k // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / SCALE_DIVISOR).to(scale_dtype)
    safe = scales.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    codes = torch.round(groups / safe).clamp(QMIN, QMAX).to(torch.int8)
    return codes.reshape(n, k), scales


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K a multiple of 8) -> int32 words [N, K // 8]."""
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"input width {k} is not a multiple of 8")
    unsigned = (codes.to(torch.int64) + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (unsigned << shifts).sum(dim=-1)  # < 2**32, exact in int64
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K] * scales [N, K // g] -> fp32 [N, K] (exact)."""
    group = codes.shape[1] // scales.shape[1]
    return codes.to(torch.float32) * scales.to(torch.float32).repeat_interleave(group, dim=1)
