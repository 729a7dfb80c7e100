"""int4 matrix product for 1..16 activation rows (a batched decode step): the Python API around
engine/kernels/w4gemm_kernel.py, tile choice in engine/kernels/w4gemm_tune.py.

`w4_gemm(x, packed, scales, out=None, epi=0, aux=None)`: Y = X W^T with every weight word read
once for all rows; epi 1: gelu_tanh(gate) * up over interleaved gate|up rows ([M, N/2]); epi 2:
gelu_tanh(Y) * aux ([M, N]). One row goes to the GEMV (engine/kernels/w4gemv.py), which is
tuned for it. `w4_gemm_reference` is the PyTorch ground truth (fp32 accumulation, the same
roundings).

CUDA graphs: the config is chosen on the host from (N, K, M bucket, dtype, device) and cached;
a shape's first call outside capture may tune it (`warm` does it ahead). Split-K's workspace and
tickets are held per device, grown outside capture only and never freed (a captured graph keeps
pointing at them); one stream at a time uses them, as a decode step does.

Two kernels behind it for 2..16 rows: the warp-level mma kernel (engine/kernels/w4mma_kernel.py:
operands built in registers, bf16/fp16 from sm_80) and the tl.dot GEMM
(engine/kernels/w4gemm_kernel.py: fp32, Turing, K not a multiple of 128), whose unpacked tile
goes through shared memory; lab/journal.md has both.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from engine.kernels.w4gemm_kernel import launch, split_plan, workspace
from engine.kernels.w4gemm_tune import bucket, config_for
from engine.kernels.w4gemv import dequantize_reference
from engine.kernels.w4gemv_kernel import launch as gemv_launch
from engine.kernels.w4gemv_tune import config_for as gemv_config_for
from engine.kernels.w4mma_kernel import launch as mma_launch
from engine.kernels.w4mma_kernel import mma_ok
from engine.kernels.w4mma_tune import config_for as mma_config_for


def _check(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, epi: int, aux):
    if x.dim() != 2:
        raise ValueError(f"w4_gemm: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 8 != k or scales.shape != (n, k // 32) or k % 32:
        raise ValueError(
            f"w4_gemm: x has K={k}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}; "
            "expected packed [N, K/8] and scales [N, K/32] with K a multiple of 32"
        )
    if not 1 <= m <= 16:
        raise ValueError(f"w4_gemm: 1..16 activation rows, got {m}")
    if epi not in (0, 1, 2) or (epi == 1 and n % 2):
        raise ValueError(f"w4_gemm: epi must be 0, 1 (N even) or 2, got {epi} with N={n}")
    if epi == 2 and (aux is None or aux.shape != (m, n) or aux.stride(1) != 1):
        raise ValueError("w4_gemm: epi=2 needs aux [M, N] with unit stride along N")
    return m, n, k


def w4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    epi: int = 0,
    aux: torch.Tensor | None = None,
    *,
    config: dict[str, Any] | None = None,
    ahead: bool = False,
) -> torch.Tensor:
    """Y[M, N] = x[M, K] @ dequant(packed, scales).T (fp32 accumulation), in x's dtype or into
    `out` ([M, N], or [M, N/2] for epi 1; any float dtype: intermediates round to out's dtype).

    epi 1: rows of the weight interleaved gate|up -> gelu_tanh(gate) * up, [M, N/2].
    epi 2: gelu_tanh(Y) * aux, aux [M, N] (one row per activation row).
    config: a tiling to use instead of the tuned one (tests, benchmarks): {"NWN", "NWK"} forces
    the warp-level mma kernel, any other the tl.dot GEMM's; M == 1 with no config runs the GEMV.
    Without one, 2..16 rows of bf16/fp16 go to the warp-level mma kernel where `mma_ok` allows
    (sm_80 on, K % 128 == 0), else to the tl.dot GEMM. ahead: the mma kernel requests a step's
    scales and activations one step early (its AHEAD)."""
    m, n, k = _check(x, packed, scales, epi, aux)
    width = n // 2 if epi == 1 else n
    if out is None:
        out = torch.empty(m, width, device=x.device, dtype=x.dtype)
    elif out.shape != (m, width) or out.stride(1) != 1:
        raise ValueError(f"w4_gemm: out must be [{m}, {width}] with unit stride along N")
    if x.stride(1) != 1:
        raise ValueError("w4_gemm: x must have unit stride along K (row-contiguous)")
    if m == 1 and config is None:
        _gemv(x, packed, scales, out, epi, aux)
        return out
    if config is None or "NWN" in config:
        takes = mma_ok(x, packed, scales)
        if config is not None and not takes:
            raise ValueError("w4_gemm: an mma tiling needs bf16/fp16 x, K % 128 == 0, 16-byte "
                             "aligned rows and sm_80 or newer")  # fmt: skip
        if takes:
            mma_launch(x, packed, scales, out, config or mma_config_for(n, k, m, x.device), epi,
                       aux, ahead=ahead)  # fmt: skip
            return out
    cfg = config or config_for(n, k, x.dtype, m, x.device)
    ws = tk = None
    split, _ = split_plan(k, cfg)
    if split > 1:
        ws, tk = workspace(x.device, split * m * n, triton.cdiv(n, cfg["BLOCK_N"]))
    launch(x, packed, scales, out, cfg, epi=epi, aux=aux, ws=ws, tickets=tk)
    return out


def _gemv(x, packed, scales, out, epi, aux) -> None:
    """One row: the GEMV and its epilogues, into `out` (the GEMV is tuned for M == 1)."""
    n, k = packed.shape[0], x.shape[1]
    cfg = dict(gemv_config_for(n, k, x.dtype, 1, x.device))
    if epi == 1 and cfg["BLOCK_N"] % 2:  # whole (gate, up) row pairs, as w4_gemv_glu does
        cfg["BLOCK_N"] = 2
    gemv_launch(x, packed.contiguous(), scales.contiguous(), out, cfg, epi=epi,
                aux=aux[0] if aux is not None else None)  # fmt: skip


def warm(n: int, k: int, dtype: torch.dtype, device: torch.device, rows=(2, 4, 8, 16)) -> None:
    """Choose (tune, where allowed) every row bucket's config of a shape and size the split-K
    workspace for it: call before capturing CUDA graphs."""
    for m in sorted({bucket(r) for r in rows if r > 1}):
        cfg = config_for(n, k, dtype, m, device)
        if split_plan(k, cfg)[0] > 1:
            workspace(device, split_plan(k, cfg)[0] * m * n, triton.cdiv(n, cfg["BLOCK_N"]))


def w4_gemm_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    epi: int = 0,
    aux: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """PyTorch ground truth: fp32 dequantization and accumulation, rounded to out_dtype (x's
    dtype unless given) where the kernel rounds."""
    dt = out_dtype or x.dtype
    y = (x.float() @ dequantize_reference(packed, scales).T).to(dt)
    if epi == 1:
        return _gelu_mul(y[:, 0::2], y[:, 1::2], dt)
    if epi == 2:
        return _gelu_mul(y, aux, dt)
    return y


def _gelu_mul(g: torch.Tensor, u: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """round(round(gelu_tanh(g)) * u), in fp32 between the roundings (as fused.gelu_mul)."""
    act = torch.nn.functional.gelu(g.float(), approximate="tanh").to(dt).float()
    return (act * u.float()).to(dt)
