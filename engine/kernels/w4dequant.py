"""Unpack 4-bit rows to a dense matrix: embedding row gathers and prompt-reading weights.

Two jobs, one kernel, both over the same packed layout as `w4gemv` (int32 [R, K/8] codes,
[R, K/32] scales):

* the 4-bit embedding table: `w4_gather_rows(ids, ...)` unpacks only the rows the tokens name,
  so the lookup and the lm_head GEMV read one shared 4-bit copy of the table;
* prompt reading: `w4_dequantize(...)` writes the whole matrix in 16-bit (tensor cores) or
  32-bit (cards without them) so cuBLAS can multiply a chunk of prompt tokens at once.

The product (code - 8) * scale is formed in fp32 and rounded once to the output dtype, which
equals the reference's `q.to(bf16) * scale` (one rounding of the exact product) bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs


@triton.jit
def _w4_rows_kernel(
    ids_ptr, w_ptr, s_ptr, out_ptr, mul_ptr, K, stride_out,
    HAS_IDS: tl.constexpr, BLOCK_KW: tl.constexpr, HAS_MUL: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_inputs(PDL)
    row = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW = K // 8
    G = K // 32
    if HAS_IDS:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        src = tl.load(ids_ptr + row).to(tl.int64)
    else:
        src = row.to(tl.int64)
    rk = pid_k * BLOCK_KW + tl.arange(0, BLOCK_KW)
    k_mask = rk < KW
    w = tl.load(w_ptr + src * KW + rk, mask=k_mask, other=0)
    s = tl.load(s_ptr + src * G + rk // 4, mask=k_mask, other=0.0).to(tl.float32)
    j = tl.arange(0, 8)
    codes = (w[:, None] >> (j[None, :] * 4)) & 0xF
    vals = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s[:, None]
    vals = vals.to(out_ptr.dtype.element_ty)
    if HAS_MUL:  # the reference's `rows * scale`: a second rounding, as a 16-bit multiply does
        vals = (vals.to(tl.float32) * tl.load(mul_ptr).to(tl.float32)).to(out_ptr.dtype.element_ty)
    offs = row.to(tl.int64) * stride_out + rk[:, None] * 8 + j[None, :]
    tl.store(out_ptr + offs, vals, mask=k_mask[:, None])


@triton.jit
def _w4_flat_kernel(
    w_ptr, s_ptr, out_ptr, total_words, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    """Whole-matrix unpack: word i of the flattened [N, K/8] codes becomes out[8i .. 8i+7] and
    uses scale i // 4 (a row's K/8 words and K/32 scales line up), so one flat index does."""
    wait_inputs(PDL)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total_words
    w = tl.load(w_ptr + idx, mask=mask, other=0)
    s = tl.load(s_ptr + idx // 4, mask=mask, other=0.0).to(tl.float32)
    j = tl.arange(0, 8)
    codes = (w[:, None] >> (j[None, :] * 4)) & 0xF
    vals = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s[:, None]
    tl.store(out_ptr + idx[:, None] * 8 + j[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=mask[:, None])  # fmt: skip


def _launch(ids, packed, scales, out, mul=None) -> None:
    rows, k = out.shape
    kw = k // 8
    block_kw = min(256, triton.next_power_of_2(max(kw, 16)))
    grid = (rows, triton.cdiv(kw, block_kw))
    run_kernel(_w4_rows_kernel, grid,
        ids if ids is not None else packed, packed, scales, out,
        mul if mul is not None else scales, k, out.stride(0),
        HAS_IDS=ids is not None, BLOCK_KW=block_kw, HAS_MUL=mul is not None, num_warps=4,
    )  # fmt: skip


def _check(packed: torch.Tensor, scales: torch.Tensor) -> int:
    n, kw = packed.shape
    k = kw * 8
    if scales.shape != (n, k // 32) or packed.dtype != torch.int32:
        raise ValueError(
            f"packed {tuple(packed.shape)} {packed.dtype} and scales {tuple(scales.shape)} do "
            "not form a 4-bit table (want int32 [R, K/8] and scales [R, K/32])"
        )
    return k


def w4_gather_rows(
    ids: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `ids` (any shape) of the 4-bit table, dequantized: [*ids.shape, K].

    `mul` (a one-element tensor) multiplies the rows after their rounding to `dtype`, rounded
    again: the reference's `embed_rows(...) * embed_scale` in one pass.
    """
    k = _check(packed, scales)
    flat = ids.reshape(-1)
    if out is None:
        out = torch.empty(flat.numel(), k, device=packed.device, dtype=dtype or scales.dtype)
    out2 = out.view(flat.numel(), k)
    if flat.numel():
        _launch(flat.contiguous(), packed.contiguous(), scales.contiguous(), out2, mul)
    return out2.view(*ids.shape, k)


def w4_dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole matrix [N, K] in `dtype` (default: the scales' dtype); `out` may be reused."""
    k = _check(packed, scales)
    n = packed.shape[0]
    if out is None:
        out = torch.empty(n, k, device=packed.device, dtype=dtype or scales.dtype)
    if not out.is_contiguous():
        raise ValueError("w4_dequantize writes a contiguous [N, K] matrix")
    total = packed.numel()
    block = 1024 if packed.is_cuda else 4096
    run_kernel(
        _w4_flat_kernel,
        (triton.cdiv(total, block),),
        packed.contiguous(),
        scales.contiguous(),
        out,
        total,
        BLOCK=block,
        num_warps=4,
    )
    return out.view(n, k)


def w4_gather_rows_reference(
    ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """PyTorch ground truth for `w4_gather_rows`."""
    from engine.kernels.w4gemv import dequantize_reference

    flat = ids.reshape(-1).long()
    rows = dequantize_reference(packed[flat], scales[flat]).to(dtype or scales.dtype)
    return rows.view(*ids.shape, packed.shape[1] * 8)
