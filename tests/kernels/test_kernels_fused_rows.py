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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_from_k", [False, True])
def test_qkv_rope_rows_equals_the_reference_norms_and_rope(dtype, v_from_k) -> None:
    """Every row's q/k head norms with weights, v norm without, RoPE from that row's position."""
    from engine.kernels.fused import qkv_rope_rows

    t, hq, kvh, d, eps = 6, 4, 1, 32, 1e-6
    n = (hq + kvh + (0 if v_from_k else kvh)) * d
    wide = (torch.randn(t, n + 8, device=DEV) * 2).to(dtype)
    qkv = wide[:, :n]  # rows strided, as a column slice would be
    q_norm = (torch.rand(d, device=DEV) + 0.5).to(dtype)
    k_norm = (torch.rand(d, device=DEV) + 0.5).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    cos, sin = ops.rope_cos_sin(torch.arange(7, 7 + t, device=DEV), inv_freq, dtype)
    q, k, v = qkv_rope_rows(qkv, q_norm, k_norm, cos, sin, hq, kvh, d, eps, v_from_k=v_from_k)
    q_ref = ops.apply_rope(ops.rms_norm(qkv[:, : hq * d].reshape(t, hq, d), q_norm, eps), cos, sin)
    k_raw = qkv[:, hq * d : (hq + kvh) * d].reshape(t, kvh, d)
    k_ref = ops.apply_rope(ops.rms_norm(k_raw, k_norm, eps), cos, sin)
    v_raw = k_raw if v_from_k else qkv[:, (hq + kvh) * d :].reshape(t, kvh, d)
    v_ref = ops.rms_norm(v_raw, None, eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope_rows(qkv, q_norm, k_norm, cos[:2], sin[:2], hq, kvh, d, eps)


def test_residual_norm_refuses_an_h_out_it_would_write_past() -> None:
    """One program per row writes h_out row by row: an h_out of fewer elements, another layout
    or another dtype than h would be written past its end or wrongly."""
    h, y = torch.randn(3, 32, device=DEV), torch.randn(3, 32, device=DEV)
    w = torch.ones(32, device=DEV)
    big = torch.zeros(3, 32, device=DEV)
    with pytest.raises(ValueError, match="h_out"):
        residual_norm(h, y, w, 1e-6, h_out=big[:1])  # rows 1 and 2 would land past it
    assert not big.any()
    with pytest.raises(ValueError, match="h_out"):
        residual_norm(h, y, w, 1e-6, h_out=torch.empty(32, 3, device=DEV).T)
    with pytest.raises(ValueError, match="h_out"):
        residual_norm(h, y, w, 1e-6, h_out=torch.empty(3, 32, device=DEV, dtype=torch.float16))


def test_qkv_rope_rows_refuses_a_width_that_disagrees_with_the_heads() -> None:
    """A q|k output read as q|k|v (v_from_k wrong) would read past each row (past the tensor on
    the last row); q|k|v read as q|k would take the keys as values. sin must be [T, D] too."""
    from engine.kernels.fused import qkv_rope_rows

    t, hq, kvh, d, eps = 3, 2, 1, 16, 1e-6
    w = torch.ones(d, device=DEV)
    cos = sin = torch.ones(t, d, device=DEV)
    qk = torch.randn(t, (hq + kvh) * d, device=DEV)
    qkv = torch.randn(t, (hq + 2 * kvh) * d, device=DEV)
    with pytest.raises(ValueError, match="width"):
        qkv_rope_rows(qk, w, w, cos, sin, hq, kvh, d, eps, v_from_k=False)
    with pytest.raises(ValueError, match="width"):
        qkv_rope_rows(qkv, w, w, cos, sin, hq, kvh, d, eps, v_from_k=True)
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope_rows(qkv, w, w, cos, sin[:1], hq, kvh, d, eps)
    qkv_rope_rows(qk, w, w, cos, sin, hq, kvh, d, eps, v_from_k=True)  # the right flag: fine


@pytest.mark.parametrize("in_place", [False, True])
def test_ple_mix_over_a_chunk_of_rows_equals_the_reference(in_place) -> None:
    """ple_mix over [tokens * layers, width] rows (a prompt chunk's per-layer inputs), written
    over the lookup itself or into a new tensor: the reference's _embed arithmetic."""
    from engine.kernels.fused import ple_mix

    gen = torch.Generator().manual_seed(2)
    t, n, p, h = 3, 4, 32, 64
    proj = torch.randn(t, n * p, generator=gen).to(DEV)
    tok = torch.randn(t, n * p, generator=gen).to(DEV)
    w = torch.rand(p, generator=gen).to(DEV) + 0.5
    want = ops.rms_norm((proj * h**-0.5).reshape(t, n, p), w, 1e-6) + tok.reshape(t, n, p)
    want = want * 2**-0.5
    rows = tok.clone().view(t * n, p)
    out = ple_mix(proj.view(t * n, p), rows, w, t * n, p, 1e-6, h**-0.5, 2**-0.5,
                  out=rows if in_place else None)  # fmt: skip
    assert (out is rows) == in_place
    assert torch.allclose(out.view(t, n, p), want, atol=1e-5)
    with pytest.raises(ValueError):
        ple_mix(proj.view(t * n, p), rows, w, t * n, p, 1e-6, 1.0, 1.0, out=rows[:, :16])
