"""The norm/GELU kernels over many rows (prompt chunks) against the reference ops."""

from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.kernels.fused import gelu_mul_pairs, residual_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scalar", [True, False])
def test_residual_norm_over_rows_equals_the_reference(dtype, with_scalar) -> None:
    rows, d, eps = 5, 96, 1e-6
    h = torch.randn(rows, d, device=DEV).to(dtype)
    y = (torch.randn(rows, d, device=DEV) * 3).to(dtype)
    w_post = torch.rand(d, device=DEV).to(dtype) + 0.5
    w_next = torch.rand(d, device=DEV).to(dtype) + 0.5
    scalar = torch.tensor([0.75], device=DEV).to(dtype) if with_scalar else None
    want_h = h + ops.rms_norm(y, w_post, eps)
    if scalar is not None:
        want_h = want_h * scalar
    want_x = ops.rms_norm(want_h, w_next, eps)
    h_in = h.clone()
    got_h, got_x = residual_norm(h_in, y, w_post, eps, scalar=scalar, w_next=w_next, h_out=h_in)
    assert got_h.data_ptr() == h_in.data_ptr()  # in place, row by row
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got_h.float(), want_h.float(), atol=tol, rtol=tol)
    assert torch.allclose(got_x.float(), want_x.float(), atol=tol, rtol=tol)
    # each row normalised on its own: a row changed alone changes only its outputs
    y2 = y.clone()
    y2[2] = torch.randn(d, device=DEV).to(dtype) * 3
    h2, _ = residual_norm(h.clone(), y2, w_post, eps, scalar=scalar, w_next=w_next)
    assert (h2 != got_h).any(dim=1).tolist() == [False, False, True, False, False]


def test_residual_norm_refuses_mismatched_rows() -> None:
    h = torch.randn(3, 32, device=DEV)
    w = torch.ones(32, device=DEV)
    with pytest.raises(ValueError, match="same size"):
        residual_norm(h, torch.randn(2, 32, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        residual_norm(h, torch.randn(32, 3, device=DEV).T, w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mul_pairs_reads_interleaved_gate_and_up(dtype) -> None:
    gu = (torch.randn(7, 2 * 300, device=DEV) * 2).to(dtype)  # 2,100 outputs: three blocks
    want = ops.gelu_tanh(gu[:, 0::2]) * gu[:, 1::2]
    got = gelu_mul_pairs(gu)
    assert got.shape == (7, 300) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="even"):
        gelu_mul_pairs(gu[:, :-1].contiguous())
