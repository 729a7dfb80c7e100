"""int4 GEMV (decode, batch 1): the launch code and the Python API around the Triton kernel in
engine/kernels/w4gemv_kernel.py; tile choice in engine/kernels/w4gemv_tune.py.

Entry points: `w4_gemv` (y = x W^T), `w4_gemv_glu` (GELU(gate) * up over interleaved gate|up
rows), `w4_gemv_gelu_mul` (GELU(x W^T) * aux) and `w4_gemv_after_residual` (the residual+norm
that makes the GEMV's input, in its prologue). `w4_gemv_reference` is the PyTorch ground truth.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels.w4gemv_kernel import launch
from engine.kernels.w4gemv_tune import config_for


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


def w4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
    half2: bool = True,
) -> torch.Tensor:
    """y[..., N] = x[..., K] @ dequant(packed, scales).T, accumulated in fp32, in x's dtype.

    `out` (optional) receives the result; its dtype may differ from x's (e.g. fp32 logits).
    half2: 16-bit activations multiply in half2 on NVIDIA GPUs (False: the exact fp32 unpack,
    the tests' and the benchmarks' reference).
    """
    x2, n, k = _prepare(x, packed, scales)
    m = x2.shape[0]
    y = out.view(m, n) if out is not None else torch.empty(m, n, device=x.device, dtype=x.dtype)
    cfg = config or config_for(n, k, x.dtype, m, x.device, half2)
    launch(x2, packed.contiguous(), scales.contiguous(), y, cfg, half2=half2)
    return y.view(*x.shape[:-1], n)


def _prepare(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor):
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
    return x2, n, k


def w4_gemv_glu(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    half2: bool = True,
) -> torch.Tensor:
    """gelu_tanh(gate) * up from ONE GEMV over a gate|up matrix whose rows are interleaved
    (row 2i = gate_i, row 2i+1 = up_i): [..., N/2], rounded as the reference rounds."""
    x2, n, k = _prepare(x, packed, scales)
    cfg = dict(config_for(n, k, x.dtype, x2.shape[0], x.device, half2))
    if cfg["BLOCK_N"] % 2:  # a one-row tiling tuned for the plain GEMV: whole row pairs
        cfg["BLOCK_N"] = 2
    y = torch.empty(x2.shape[0], n // 2, device=x.device, dtype=x.dtype)
    launch(x2, packed.contiguous(), scales.contiguous(), y, cfg, epi=1, half2=half2)
    return y.view(*x.shape[:-1], n // 2)


def w4_gemv_gelu_mul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     aux: torch.Tensor, half2: bool = True) -> torch.Tensor:  # fmt: skip
    """gelu_tanh(x W^T) * aux (aux: N values), in one launch."""
    x2, n, k = _prepare(x, packed, scales)
    cfg = config_for(n, k, x.dtype, x2.shape[0], x.device, half2)
    y = torch.empty(x2.shape[0], n, device=x.device, dtype=x.dtype)
    launch(
        x2,
        packed.contiguous(),
        scales.contiguous(),
        y,
        cfg,
        epi=2,
        aux=aux.contiguous(),
        half2=half2,
    )
    return y.view(*x.shape[:-1], n)


def w4_gemv_after_residual(
    y: torch.Tensor,
    h: torch.Tensor,
    w_post: torch.Tensor,
    eps: float,
    packed: torch.Tensor,
    scales: torch.Tensor,
    h_out: torch.Tensor,
    scalar: torch.Tensor | None = None,
    w_next: torch.Tensor | None = None,
    epi: int = 0,
    aux: torch.Tensor | None = None,
    half2: bool = True,
) -> torch.Tensor:
    """`residual_norm(h, y, w_post, eps, scalar, w_next)` and the GEMV that reads its output, in
    ONE launch, for M rows (y, h, h_out [M, K] or one token's [K]). h' = h + rms_norm(y, w_post)
    [* scalar] goes to h_out (a buffer other than h: every program of a row reads h while one
    writes h'); the GEMV reads x = rms_norm(h', w_next), or h' itself without w_next. epi 1:
    GLU over interleaved gate|up rows ([M, N/2]); epi 2: gelu(.) * aux (aux [N] for one
    token, [M, N] with unit stride along N for M rows); 0: plain. The tiling is the one-row
    GEMV's: each row is its own grid row, as `w4_gemv` runs several."""
    k = h.shape[-1]
    m = h.numel() // k
    n = packed.shape[0]
    if (y.numel() != m * k or packed.shape[1] * 8 != k or scales.shape != (n, k // 32)
            or h_out.numel() != m * k or h_out.data_ptr() in (h.data_ptr(), y.data_ptr())
            or not y.dtype == h.dtype == h_out.dtype
            or not (y.is_contiguous() and h.is_contiguous() and h_out.is_contiguous())):  # fmt: skip
        raise ValueError(
            "w4_gemv_after_residual: y, h, h_out (contiguous rows) and the GEMV's K must agree "
            "in shape and dtype, and h_out must be a buffer other than h and y"
        )
    if aux is not None:
        aux = aux.reshape(m, n) if m > 1 else aux.reshape(-1)
        if aux.stride(-1) != 1:
            aux = aux.contiguous()
    y2 = y.reshape(m, k)
    cfg = dict(config_for(n, k, y.dtype, 1, y.device, half2))
    if epi == 1 and cfg["BLOCK_N"] % 2:
        cfg["BLOCK_N"] = 2
    out = torch.empty(m, n // 2 if epi == 1 else n, device=y.device, dtype=y.dtype)
    launch(y2, packed.contiguous(), scales.contiguous(), out, cfg, epi=epi, half2=half2,
            aux=aux, eps=eps, pro=(y2, h.reshape(-1), w_post, scalar, w_next,
                                   h_out.reshape(-1)))  # fmt: skip
    return out
