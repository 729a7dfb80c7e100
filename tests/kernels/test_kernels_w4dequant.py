"""4-bit row gathers (embedding) and whole-matrix dequantisation (prompt reading)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.w4dequant import w4_dequantize, w4_gather_rows, w4_gather_rows_reference
from engine.kernels.w4gemv import dequantize_reference


def _table(rows: int, k: int, device, dtype=torch.bfloat16):
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(rows, k // 32, device=device) + 0.01).to(dtype)
    return packed, scales


def _equal_within_rounding(a: torch.Tensor, b: torch.Tensor, interpreted: bool) -> bool:
    """Bit-equal on the GPU; the CPU interpreter truncates fp32->bf16, so allow one bf16 ulp."""
    if not interpreted or a.dtype != torch.bfloat16:
        return torch.equal(a, b)
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2**-7 + 1e-30).all())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_rows_equals_reference(device, interpreted, out_dtype) -> None:
    packed, scales = _table(97, 160, device)
    ids = torch.randint(0, 97, (3, 5), device=device)
    ids[0, 0] = 96  # the last row
    got = w4_gather_rows(ids, packed, scales, dtype=out_dtype)
    want = w4_gather_rows_reference(ids, packed, scales, dtype=out_dtype)
    assert got.shape == (3, 5, 160)
    assert _equal_within_rounding(got, want, interpreted)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_whole_matrix(device, interpreted, out_dtype) -> None:
    packed, scales = _table(33, 2048 + 64, device, dtype=torch.float16)
    out = torch.full((33, 2112), float("nan"), device=device, dtype=out_dtype)
    got = w4_dequantize(packed, scales, out=out)
    want = dequantize_reference(packed, scales).to(out_dtype)
    assert _equal_within_rounding(got, want, interpreted)


def test_wrong_table_is_refused(device) -> None:
    packed, scales = _table(4, 64, device)
    with pytest.raises(ValueError, match="4-bit table"):
        w4_dequantize(packed, scales[:, :1])
