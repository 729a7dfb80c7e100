"""The kernels at every real Gemma 4 E2B shape, on the GPU (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_decode import DecodeAttention, decode_attention_reference
from engine.kernels.w4dequant import w4_dequantize, w4_gather_rows, w4_gather_rows_reference
from engine.kernels.w4gemv import dequantize_reference, w4_gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# (out, in) of every matrix a decode step multiplies, unfused and fused (q|k|v, gate|up)
E2B_SHAPES = [
    (2048, 1536), (256, 1536), (4096, 1536), (512, 1536),  # q, k/v sliding; q, k/v full
    (1536, 2048), (1536, 4096),  # o sliding, o full
    (6144, 1536), (12288, 1536), (1536, 6144), (1536, 12288),  # gate/up, down (normal, wide)
    (2560, 1536), (5120, 1536), (24576, 1536),  # fused qkv sliding/full, gate|up, wide gate|up
    (256, 1536), (1536, 256), (8960, 1536),  # per-layer gate, projection, model projection
    (262144, 1536),  # lm_head (the tied 4-bit embedding)
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), E2B_SHAPES)
def test_w4_gemv_at_e2b_shape(n, k, dtype) -> None:
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // 32, device="cuda") * 0.02 + 0.002).to(dtype)
    x = torch.randn(1, k, device="cuda").to(dtype)
    out = torch.full((1, n), float("nan"), device="cuda", dtype=dtype)
    y = w4_gemv(x, packed, scales, out=out)
    ref = x.double() @ dequantize_reference(packed, scales).double().T
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert not torch.isnan(y).any()
    assert err < (8e-3 if dtype == torch.bfloat16 else 1e-3), err


@pytest.mark.parametrize(("rows", "k"), [(262144, 1536), (262144, 8960)])
def test_gather_rows_of_the_vocabulary_tables(rows, k) -> None:
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(rows, k // 32, device="cuda") + 0.01).to(torch.bfloat16)
    ids = torch.randint(0, rows, (17,), device="cuda")
    ids[0] = rows - 1
    got = w4_gather_rows(ids, packed, scales)
    assert torch.equal(got, w4_gather_rows_reference(ids, packed, scales))


def test_dequantize_widest_matrix_bit_exact() -> None:
    packed = torch.randint(-(2**31), 2**31 - 1, (24576, 192), dtype=torch.int32, device="cuda")
    scales = (torch.rand(24576, 48, device="cuda") * 0.02).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = w4_dequantize(packed, scales, dtype=dtype)
        assert torch.equal(got, dequantize_reference(packed, scales).to(dtype))


@pytest.mark.parametrize("use_dot", [True, False])
@pytest.mark.parametrize(
    ("ring", "slots", "dim", "positions"),
    [
        (True, 512, 256, [0, 7, 511, 512, 4095, 131071]),
        (False, 131072, 512, [0, 1, 4095, 32767, 100000, 131071]),
    ],
)
def test_decode_attention_at_e2b_shape(ring, slots, dim, positions, use_dot) -> None:
    att = DecodeAttention(8, dim, slots, torch.device("cuda"), ring=ring,
                          window=512 if ring else 0, use_dot=use_dot)  # fmt: skip
    k = torch.randn(slots, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(slots, dim, device="cuda", dtype=torch.bfloat16)
    for pos in positions:
        # q scaled as Gemma's q/k norms scale it (scores O(1)); unscaled random q at width 512
        # gives scores ~20 whose bf16 rounding (the reference's, mirrored here) dominates
        q = (torch.randn(8, dim, device="cuda") * dim**-0.5).to(torch.bfloat16)
        got = att(q, k, v, torch.tensor([pos], device="cuda", dtype=torch.int32))
        want = decode_attention_reference(q.double(), k.double(), v.double(), pos, ring=ring,
                                          window=512 if ring else 0)  # fmt: skip
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 3e-2, (pos, err)  # scores rounded to bf16, as the reference does


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e4, 1e30])
def test_w4_gemv_half2_path_keeps_any_bf16_activation_range(magnitude) -> None:
    """The half2 path scales each column's activations into fp16's range and back: bf16 inputs
    far beyond fp16's 65504 (or far below its normal range) still give the exact path's result
    to within the bf16 output rounding, and never inf/nan."""
    n, k = 1536, 2048
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // 32, device="cuda") * 0.02 + 0.002).to(torch.bfloat16)
    x = (torch.randn(1, k, device="cuda") * magnitude).to(torch.bfloat16)
    x[0, :7] *= 1e-3  # a few columns mix small and large values
    exact = w4_gemv(x, packed, scales, half2=False)
    half2 = w4_gemv(x, packed, scales, half2=True)
    ref = x.double() @ dequantize_reference(packed, scales).double().T
    assert torch.isfinite(half2).all()
    for y in (exact, half2):
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 8e-3, err


@pytest.mark.parametrize(("n", "k"), [(1536, 12288), (24576, 1536), (262144, 1536)])
def test_w4_gemv_pipelined_and_plain_loops_agree_bit_for_bit(n, k) -> None:
    """The software pipeline only moves the loads: same arithmetic, same order, same bits."""
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // 32, device="cuda") * 0.02 + 0.002).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    for tile in ({"BLOCK_N": 4, "BLOCK_KW": 64, "num_warps": 2, "num_stages": 2},
                 {"BLOCK_N": 32, "BLOCK_KW": 32, "num_warps": 1, "num_stages": 2}):  # fmt: skip
        a = w4_gemv(x, packed, scales, config=dict(tile, PIPE=True))
        b = w4_gemv(x, packed, scales, config=dict(tile, PIPE=False))
        assert torch.equal(a, b)
        ref = x.double() @ dequantize_reference(packed, scales).double().T
        assert ((a.double() - ref).norm() / ref.norm()).item() < 8e-3


@pytest.mark.parametrize(("n", "epi", "with_next"), [(2560, 0, True), (256, 2, False)])
def test_residual_norm_in_the_gemv_prologue_at_e2b_shape(n, epi, with_next) -> None:
    """The q|k|v and per-layer-gate GEMVs with the preceding residual+norm in their prologue,
    against residual_norm + the plain GEMV (bf16, K = 1536)."""
    from engine.kernels.fused import gelu_mul, residual_norm
    from engine.kernels.w4gemv import w4_gemv_after_residual

    k, dt = 1536, torch.bfloat16
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // 32, device="cuda") * 0.02 + 0.002).to(dt)
    y = torch.randn(1, k, device="cuda").to(dt)
    h = (torch.randn(1, k, device="cuda") * 4).to(dt)
    w_post = (torch.rand(k, device="cuda") + 0.5).to(dt)
    w_next = (torch.rand(k, device="cuda") + 0.5).to(dt) if with_next else None
    scalar = torch.tensor([0.75], device="cuda").to(dt) if with_next else None
    aux = torch.randn(n, device="cuda").to(dt) if epi == 2 else None
    h_ref, x_ref = residual_norm(h.clone(), y, w_post, 1e-6, scalar=scalar, w_next=w_next)
    plain = w4_gemv(x_ref if with_next else h_ref, packed, scales)
    want = gelu_mul(plain, aux) if epi == 2 else plain
    h_out = torch.full_like(h, float("nan"))
    got = w4_gemv_after_residual(y, h, w_post, 1e-6, packed, scales, h_out, scalar=scalar,
                                 w_next=w_next, epi=epi, aux=aux)  # fmt: skip
    assert (
        h_out.float() - h_ref.float()
    ).abs().max().item() <= 2 * h_ref.float().abs().max() * 2**-8
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, err
