"""The int4 few-row product (w4_gemm) against its PyTorch reference, on fresh random packed
weights: every row count 1..16, the three epilogues, both inner paths (tensor-core dot and
multiply-and-sum), split-K with the fused ticket reduction and the two-pass one."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.w4gemm import w4_gemm, w4_gemm_reference
from engine.kernels.w4gemm_tune import candidate_configs, shape_key

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# norm-relative error against the reference; 16-bit outputs round (and the GLU / GELU epilogues
# round three times), so a one-ulp difference in y shows up as ~1e-2 for bf16
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SHAPES = [(64, 96), (96, 256), (64, 64)]  # K=96: 12 words, no power-of-two tile divides it


def _layer(n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype
    scales = (torch.rand(n, k // 32, generator=gen) * 0.05 + 0.005).to(scale_dtype)
    return packed.to(device), scales.to(device)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _check(device, m, n, k, dtype, epi, config=None, out_dtype=None, seed=0) -> torch.Tensor:
    packed, scales = _layer(n, k, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    aux = torch.randn(m, n, generator=gen).to(dtype).to(device) if epi == 2 else None
    width = n // 2 if epi == 1 else n
    out = None
    if out_dtype is not None:  # poisoned: every element must be written
        out = torch.full((m, width), float("nan"), device=device, dtype=out_dtype)
    y = w4_gemm(x, packed, scales, out=out, epi=epi, aux=aux, config=config)
    assert y.shape == (m, width) and y.dtype == (out_dtype or dtype)
    assert not torch.isnan(y).any()
    ref = w4_gemm_reference(x, packed, scales, epi=epi, aux=aux, out_dtype=out_dtype)
    err = _rel_err(y, ref)
    # the tensor-core path rounds each dequantized weight to x's dtype: x's tolerance
    assert err < TOL[dtype], (m, n, k, dtype, epi, config, err)
    return y


@pytest.mark.parametrize("m", range(1, 17))
def test_every_row_count_every_epilogue_and_dtype(device, m) -> None:
    n, k = SHAPES[m % 3]
    for dtype in DTYPES:
        for epi in (0, 1, 2):
            _check(device, m, n, k, dtype, epi, seed=m * 10 + epi)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_out_given_in_fp32(device, m) -> None:
    """fp32 logits from bf16 activations (the lm_head's case); the epilogues round to out's
    dtype, as the GEMV's do."""
    for epi in (0, 1, 2):
        _check(device, m, 96, 256, torch.bfloat16, epi, out_dtype=torch.float32, seed=m)


def _cfg(**kw):
    base = {"TC": True, "BLOCK_N": 32, "BLOCK_KW": 4, "num_warps": 4, "num_stages": 1,
            "SPLIT": 1, "FUSED": True, "SWAP": False, "PIPE": True}  # fmt: skip
    return dict(base, **kw)


@pytest.mark.parametrize("m", [2, 5, 16])
def test_multiply_and_sum_path_forced(device, m) -> None:
    """The Turing path (no tl.dot): same function, several K steps and a masked last one."""
    cfg = _cfg(TC=False, BLOCK_N=4, BLOCK_KW=4)
    for dtype in DTYPES:
        for epi in (0, 1, 2):
            _check(device, m, 40, 96, dtype, epi, config=cfg, seed=m + epi)


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(SPLIT=2),  # 12 words in steps of 4: splits of 8 and 4 words
        _cfg(SPLIT=4, BLOCK_KW=2),
        _cfg(SPLIT=3, FUSED=False),  # the two-pass reduction
        _cfg(SPLIT=2, SWAP=True, BLOCK_N=16),  # the weight tile as the dot's A operand
        _cfg(SPLIT=2, PIPE=False),
        _cfg(TC=False, BLOCK_N=8, BLOCK_KW=2, SPLIT=4),
        _cfg(SPLIT=64),  # more splits than K steps: clamped, none empty
    ],
)
def test_split_k_and_tilings_compute_the_same_function(device, cfg) -> None:
    for dtype, epi, m in ((torch.float32, 0, 3), (torch.bfloat16, 1, 16), (torch.float16, 2, 7)):
        _check(device, m, 72, 96, dtype, epi, config=cfg, seed=epi)


def test_split_k_is_deterministic_and_leaves_its_tickets_at_zero(device) -> None:
    from engine.kernels import w4gemm

    cfg = _cfg(SPLIT=4, BLOCK_KW=2)
    y1 = _check(device, 9, 64, 128, torch.float32, 0, config=cfg)
    y2 = _check(device, 9, 64, 128, torch.float32, 0, config=cfg)
    assert torch.equal(y1, y2)
    _, tickets = w4gemm._WORKSPACES[str(device)]
    assert int(tickets.abs().sum()) == 0


def test_one_row_runs_the_gemv_and_agrees_with_the_product(device) -> None:
    from engine.kernels.w4gemv import w4_gemv

    packed, scales = _layer(64, 256, torch.float32, device, 3)
    x = torch.randn(1, 256, device=device)
    assert torch.equal(w4_gemm(x, packed, scales), w4_gemv(x, packed, scales))
    two = w4_gemm(torch.cat([x, x]), packed, scales)
    assert torch.allclose(two[0], two[1]) and torch.allclose(two[:1], w4_gemv(x, packed, scales),
                                                              rtol=1e-5, atol=1e-5)  # fmt: skip


def test_bad_input_is_refused(device) -> None:
    packed, scales = _layer(64, 64, torch.float32, device, 0)
    with pytest.raises(ValueError, match="expected packed"):
        w4_gemm(torch.randn(2, 96, device=device), packed, scales)
    with pytest.raises(ValueError, match="1..16"):
        w4_gemm(torch.randn(17, 64, device=device), packed, scales)
    with pytest.raises(ValueError, match="aux"):
        w4_gemm(torch.randn(2, 64, device=device), packed, scales, epi=2)
    with pytest.raises(ValueError, match="out must be"):
        w4_gemm(torch.randn(2, 64, device=device), packed, scales, epi=1,
                out=torch.empty(2, 64, device=device))  # fmt: skip


def test_candidates_fit_their_shape() -> None:
    """Tiling candidates: no K tile wider than the row, whole gate|up pairs for the GLU, the
    multiply-and-sum accumulator kept small; keys separate row buckets and paths."""
    for tc in (True, False):
        cands = candidate_configs(1536, 256, 16, tc, epi=1)
        assert cands and all(c["BLOCK_KW"] <= 32 and c["BLOCK_N"] % 2 == 0 for c in cands)
        assert all(c["TC"] == tc for c in cands)
    assert any(c["SPLIT"] > 1 for c in candidate_configs(1536, 12288, 8, True))
    keys = {shape_key(1536, 6144, torch.bfloat16, m, tc) for m in (2, 3, 4, 5, 16)
            for tc in (True, False)}  # fmt: skip
    assert len(keys) == 8  # buckets 2, 4, 8, 16 (3 -> 4, 5 -> 8), each for both paths
