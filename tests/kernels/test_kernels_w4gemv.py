"""The int4 GEMV against the PyTorch reference, on fresh random packed weights each run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.kernels import tuning
from engine.kernels.w4gemv import dequantize_reference, w4_gemv

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _random_layer(n: int, k: int, dtype: torch.dtype, device: torch.device):
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype
    scales = (torch.rand(n, k // 32, device=device) * 0.05 + 0.005).to(scale_dtype)
    return packed, scales


def _rel_err(y: torch.Tensor, x: torch.Tensor, packed, scales) -> float:
    ref = x.double() @ dequantize_reference(packed, scales).double().T
    return ((y.double() - ref).norm() / ref.norm()).item()


def test_dequantize_reference_matches_the_documented_layout() -> None:
    # element k of a row sits in word k//8 at bits 4*(k%8), stored as q+8
    codes = torch.tensor([[0, 1, 2, 3, 15, 8, 9, 7] * 4])
    word = sum(int(codes[0, j]) << (4 * j) for j in range(8))
    word = word - (1 << 32) if word >= 1 << 31 else word
    packed = torch.full((1, 4), word, dtype=torch.int32)
    scales = torch.tensor([[0.5]], dtype=torch.float16)
    w = dequantize_reference(packed, scales)
    assert torch.equal(w, (codes.float() - 8) * 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 96), (1, 64, 1024), (3, 5, 256)])
def test_w4_gemv_matches_reference(device, dtype, m, n, k) -> None:
    packed, scales = _random_layer(n, k, dtype, device)
    x = torch.randn(m, k, device=device).to(dtype)
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)  # poison: all written?
    y = w4_gemv(x, packed, scales, out=out)
    assert not torch.isnan(y).any()
    assert _rel_err(y, x, packed, scales) < TOL[dtype]


@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_N": 1, "BLOCK_KW": 32, "num_warps": 1, "num_stages": 1},  # K not a multiple
        {"BLOCK_N": 16, "BLOCK_KW": 64, "num_warps": 4, "num_stages": 2},  # rows masked
        {"BLOCK_N": 4, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 3},  # 3 K steps, pipelined
        # the same without the software pipeline (operands loaded after each step's arithmetic)
        {"BLOCK_N": 1, "BLOCK_KW": 32, "num_warps": 1, "num_stages": 1, "PIPE": False},
        {"BLOCK_N": 4, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 3, "PIPE": False},
    ],
)
def test_every_tiling_computes_the_same_function(device, cfg) -> None:
    n, k = 45, 352  # K/8 = 44 words: no power-of-two tile divides it
    packed, scales = _random_layer(n, k, torch.float32, device)
    x = torch.randn(2, k, device=device)
    y = w4_gemv(x, packed, scales, config=cfg)
    assert _rel_err(y, x, packed, scales) < 1e-5


def test_extreme_codes_are_exact(device) -> None:
    # every nibble 0 (q=-8) or 15 (q=+7) in every position: the magic-number path is exact
    n, k = 8, 64
    packed = torch.tensor([0, -1, 0x0F0F0F0F, -0x0F0F0F10], dtype=torch.int32, device=device)
    packed = packed.repeat(n, k // 32)
    scales = torch.ones(n, k // 32, dtype=torch.float16, device=device)
    x = torch.ones(1, k, device=device)
    y = w4_gemv(x, packed, scales)
    ref = x.double() @ dequantize_reference(packed, scales).double().T
    assert torch.equal(y.double(), ref)


def test_bad_shapes_are_refused(device) -> None:
    packed, scales = _random_layer(8, 64, torch.float32, device)
    with pytest.raises(ValueError, match="expected packed"):
        w4_gemv(torch.randn(1, 96, device=device), packed, scales)


@pytest.fixture
def cache_in(tmp_path):
    """The tuning tables under tmp_path for the test (the settings an engine would put in force)."""
    tuning.forget_memory()
    with tuning.tuning_settings(tuning.TuningSettings(cache_dir=tmp_path)):
        yield tmp_path
    tuning.forget_memory()


@pytest.mark.usefixtures("cache_in")
def test_config_cache_round_trips_through_its_file(tmp_path) -> None:
    cfg = {"BLOCK_N": 4, "BLOCK_KW": 128, "num_warps": 4, "num_stages": 2, "us": 3.1}
    tuning.store("w4gemv", "N2560_K1536_bfloat16_M1", "Some_GPU", cfg)
    on_disk = json.loads((tmp_path / "Some_GPU.json").read_text())
    assert on_disk["w4gemv"]["N2560_K1536_bfloat16_M1"] == cfg
    tuning.forget_memory()
    assert tuning.lookup("w4gemv", "N2560_K1536_bfloat16_M1", "Some_GPU") == cfg
    assert tuning.lookup("w4gemv", "N1_K32_bfloat16_M1", "Some_GPU") is None
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.usefixtures("cache_in")
def test_an_unshipped_hopper_reads_the_h200s_tables(tmp_path, monkeypatch) -> None:
    """A card with no shipped tables of its own (an H100) reads those of the shipped card of its
    compute capability (the H200's: its first start then tunes nothing); its own tuned entries
    still win; a card of an unshipped capability reads nothing and tunes. (No GPU here: the
    names and capabilities are what `gpu_key` reads from torch on one.)"""
    monkeypatch.setattr(tuning, "_STAND_IN_MEMO", {})
    h200 = json.loads((Path(tuning.__file__).with_name("configs") / "NVIDIA_H200.json").read_text())
    key, shipped = next(iter(h200["w4gemv"].items()))
    assert tuning.stand_in("NVIDIA_H200", (9, 0)) == "NVIDIA_H200"
    assert tuning.stand_in("NVIDIA_H100_80GB_HBM3", (9, 0)) == "NVIDIA_H200"
    assert tuning.stand_in("NVIDIA_A100-SXM4-80GB", (8, 0)) == "NVIDIA_A100-SXM4-80GB"
    tuning._STAND_IN_MEMO.update({"NVIDIA_H100_80GB_HBM3": "NVIDIA_H200", "Tesla_T4": "Tesla_T4"})
    assert tuning.lookup("w4gemv", key, "NVIDIA_H100_80GB_HBM3") == shipped
    assert tuning.lookup("w4gemv", key, "Tesla_T4") is None  # its first use tunes
    mma = tuning.shipped_table("w4mma", "NVIDIA_H100_80GB_HBM3")
    assert mma and mma == tuning.shipped_table("w4mma", "NVIDIA_H200")
    own = {"BLOCK_N": 2, "BLOCK_KW": 64, "num_warps": 1, "num_stages": 2, "us": 1.0}
    tuning.store("w4gemv", key, "NVIDIA_H100_80GB_HBM3", own)  # tuned on the card itself
    tuning.forget_memory()
    assert tuning.lookup("w4gemv", key, "NVIDIA_H100_80GB_HBM3") == own
    assert tuning.lookup("w4gemv", key, "NVIDIA_H200") == shipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["NVIDIA_H100_80GB_HBM3.json"]
    tuning.shipped_table.cache_clear()  # it read through this test's stand-ins


def test_gemv_epilogues_match_their_unfused_form(device) -> None:
    from engine.kernels.fused import gelu_mul
    from engine.kernels.w4gemv import w4_gemv_gelu_mul, w4_gemv_glu

    n, k = 96, 128
    packed, scales = _random_layer(n, k, torch.float32, device)
    x = torch.randn(1, k, device=device)
    y = w4_gemv(x, packed, scales)
    # GLU over interleaved rows
    got = w4_gemv_glu(x, packed, scales)
    assert got.shape == (1, n // 2)
    want = gelu_mul(y[:, 0::2].contiguous(), y[:, 1::2].contiguous())
    assert torch.allclose(got, want, atol=1e-5)
    # gelu(y) * aux
    aux = torch.randn(n, device=device)
    assert torch.allclose(w4_gemv_gelu_mul(x, packed, scales, aux), gelu_mul(y, aux), atol=1e-5)


@pytest.mark.parametrize(("epi", "with_scalar", "with_next"), [(0, True, True), (1, False, True),
                                                               (2, False, False)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_made_in_the_gemv_prologue_equals_the_two_kernels(
    device, epi, with_scalar, with_next, dtype
) -> None:
    """The fused launch must give what residual_norm + the GEMV give: the same h' (written to
    h_out, h untouched) and the GEMV of the same activations, over several K steps."""
    from engine.kernels.fused import gelu_mul, residual_norm
    from engine.kernels.w4gemv import w4_gemv_after_residual

    n, k = 64, 512
    packed, scales = _random_layer(n, k, dtype, device)
    y = torch.randn(1, k, device=device).to(dtype)
    h = (torch.randn(1, k, device=device) * 4).to(dtype)
    h_keep = h.clone()
    w_post = (torch.rand(k, device=device) + 0.5).to(dtype)
    w_next = (torch.rand(k, device=device) + 0.5).to(dtype) if with_next else None
    scalar = torch.tensor([0.75], device=device).to(dtype) if with_scalar else None
    aux = torch.randn(n, device=device).to(dtype) if epi == 2 else None
    h_ref, x_ref = residual_norm(h.clone(), y, w_post, 1e-6, scalar=scalar, w_next=w_next)
    x_ref = x_ref if with_next else h_ref
    cfg = {"BLOCK_N": 16, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 2}  # 4 K steps
    plain = w4_gemv(x_ref, packed, scales, config=cfg).float()
    if epi == 1:
        want = gelu_mul(
            plain[:, 0::2].contiguous().to(dtype), plain[:, 1::2].contiguous().to(dtype)
        )
    elif epi == 2:
        want = gelu_mul(plain.to(dtype), aux)
    else:
        want = plain.to(dtype)
    h_out = torch.full_like(h, float("nan"))
    got = w4_gemv_after_residual(y, h, w_post, 1e-6, packed, scales, h_out, scalar=scalar,
                                 w_next=w_next, epi=epi, aux=aux)  # fmt: skip
    assert torch.equal(h, h_keep)
    # the prologue's norm sums in another order than residual_norm's kernel (on a GPU: other
    # warps): an inv_rms one ulp off moves h' by ~1e-7 absolute, which fails any rtol where
    # h + rms(y) * w_post nearly cancels; an absolute term covers it
    h_tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-2, 2e-2)
    assert torch.allclose(h_out.float(), h_ref.float(), rtol=h_tol[0], atol=h_tol[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (got - want).abs().max()
    with pytest.raises(ValueError, match="h_out"):
        w4_gemv_after_residual(y, h, w_post, 1e-6, packed, scales, h, w_next=w_next)


@pytest.mark.parametrize("epi", [0, 2])
def test_prologue_over_several_rows_equals_each_row_alone(device, epi) -> None:
    """Three rows (a batch step's per-layer gate): each row's h' and output equal what the
    one-token launch gives that row alone, bit for bit; aux is a strided view (one layer's
    column of the per-layer inputs), as the batched step passes it."""
    from engine.kernels.w4gemv import w4_gemv_after_residual

    n, k, m, dtype = 48, 256, 3, torch.float32
    packed, scales = _random_layer(n, k, dtype, device)
    y = torch.randn(m, k, device=device)
    h = torch.randn(m, k, device=device) * 4
    w_post = torch.rand(k, device=device) + 0.5
    w_next = torch.rand(k, device=device) + 0.5
    scalar = torch.tensor([0.75], device=device)
    ple = torch.randn(m, 5, n, device=device)  # [rows, layers, width]: layer 2's column
    aux = ple[:, 2] if epi == 2 else None
    cfg = {"BLOCK_N": 16, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 2}
    h_out = torch.full_like(h, float("nan"))
    with pytest.MonkeyPatch.context() as mp:
        from engine.kernels import w4gemv

        mp.setattr(w4gemv, "config_for", lambda *a, **kw: cfg)
        got = w4_gemv_after_residual(y, h, w_post, 1e-6, packed, scales, h_out, scalar=scalar,
                                     w_next=w_next, epi=epi, aux=aux)  # fmt: skip
        for r in range(m):
            one_h = torch.full_like(h[r], float("nan"))
            one = w4_gemv_after_residual(y[r], h[r].clone(), w_post, 1e-6, packed, scales,
                                         one_h, scalar=scalar, w_next=w_next, epi=epi,
                                         aux=None if aux is None else aux[r])  # fmt: skip
            assert torch.equal(h_out[r], one_h), r
            assert torch.equal(got[r], one[0]), r
    assert got.shape == (m, n)


@pytest.mark.parametrize(
    ("k", "cfg"),
    [
        (160, {"BLOCK_N": 16, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 2}),  # K not even
        (384, {"BLOCK_N": 16, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 2}),  # 3 even steps
        (160, {"BLOCK_N": 16, "BLOCK_KW": 32, "num_warps": 2, "num_stages": 2}),  # one masked
        (384, {"BLOCK_N": 8, "BLOCK_KW": 16, "num_warps": 2, "num_stages": 2, "PIPE": False}),
    ],
)
def test_gemv_prologue_over_several_programs_and_k_steps(device, monkeypatch, k, cfg) -> None:
    """The prologue under the tilings a GPU picks (the CPU default is one program, one K step):
    rows over several programs (only program 0 writes h'), K steps pipelined or not, a last
    step that is masked."""
    from engine.kernels import w4gemv
    from engine.kernels.fused import residual_norm

    n, dtype = 40, torch.float32
    packed, scales = _random_layer(n, k, dtype, device)
    y = torch.randn(1, k, device=device)
    h = torch.randn(1, k, device=device) * 4
    w_post = torch.rand(k, device=device) + 0.5
    w_next = torch.rand(k, device=device) + 0.5
    scalar = torch.tensor([0.75], device=device)
    h_ref, x_ref = residual_norm(h.clone(), y, w_post, 1e-6, scalar=scalar, w_next=w_next)
    want = w4_gemv(x_ref, packed, scales, config=cfg)
    monkeypatch.setattr(w4gemv, "config_for", lambda *a, **kw: dict(cfg))
    h_out = torch.full_like(h, float("nan"))
    got = w4gemv.w4_gemv_after_residual(y, h, w_post, 1e-6, packed, scales, h_out,
                                        scalar=scalar, w_next=w_next)  # fmt: skip
    assert torch.allclose(h_out, h_ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
