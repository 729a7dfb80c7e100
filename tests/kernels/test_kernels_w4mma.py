"""The warp-level int4 product (engine/kernels/w4mma_kernel.py) against the PyTorch reference:
compiled on a GPU (the PTX loads, unpack and mma.sync), interpreted on the CPU (the same
fragment mapping written in tl ops), for every row count, both 16-bit dtypes, the three
epilogues and the warp splits of N and K."""

from __future__ import annotations

import pytest
import torch
from compile_support import compiled_rows, mma_ptx, ptxas_report

from engine.kernels.w4gemm import w4_gemm_reference
from engine.kernels.w4mma_kernel import launch, mma_ok
from engine.kernels.w4mma_tune import candidate_configs, default_config

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}  # as the tl.dot GEMM's (one 16-bit rounding)


def _operands(m, n, k, dtype, device, seed, epi=0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.05 + 0.005).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    aux = torch.randn(m, n, generator=gen).to(dtype) if epi == 2 else None
    to = (lambda t: t.to(device)) if device.type != "cpu" else (lambda t: t)
    return to(packed), to(scales), to(x), None if aux is None else to(aux)


def _check(device, m, n, k, dtype, epi, cfg, seed=0, out_dtype=None, ahead=False):
    packed, scales, x, aux = _operands(m, n, k, dtype, device, seed, epi)
    assert mma_ok(x, packed, scales)
    width = n // 2 if epi == 1 else n
    y = torch.full((m, width), float("nan"), device=device, dtype=out_dtype or dtype)  # all written
    launch(x, packed, scales, y, cfg, epi=epi, aux=aux, ahead=ahead)
    assert not torch.isnan(y).any()
    ref = w4_gemm_reference(x, packed, scales, epi=epi, aux=aux, out_dtype=out_dtype)
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], (m, n, k, dtype, epi, cfg, err)
    return y


@pytest.mark.parametrize(
    ("m", "dtype"),
    [(1, torch.bfloat16), (8, torch.bfloat16), (9, torch.bfloat16), (16, torch.bfloat16),
     (5, torch.float16), (13, torch.float16)],
)  # fmt: skip
def test_every_epilogue_at_row_counts_across_both_batch_tiles(device, m, dtype) -> None:
    for epi in (0, 1, 2):
        _check(device, m, 16, 256, dtype, epi, {"NWN": 1, "NWK": 1}, seed=m + epi)


@pytest.mark.parametrize(
    "cfg",
    [{"NWN": 2, "NWK": 1}, {"NWN": 1, "NWK": 2}, {"NWN": 2, "NWK": 2},
     {"NWN": 1, "NWK": 2, "MT": 2}],
)  # fmt: skip
def test_warp_splits_of_n_and_k_compute_the_same_function(device, cfg) -> None:
    """N = 40: the last 16-row tile is cut at row 40 (rows past N are clamped and not stored;
    with MT 2 a warp's second tile is rows 16..31 or 48..63);
    K = 512: four steps, two a warp when split in two."""
    y = _check(device, 11, 40, 512, torch.bfloat16, 0, cfg, seed=3)
    again = _check(device, 11, 40, 512, torch.bfloat16, 0, cfg, seed=3)
    assert torch.equal(y, again)  # the warp sum runs in a fixed order


@pytest.mark.parametrize(
    ("m", "cfg"), [(5, {"NWN": 1, "NWK": 2}), (11, {"NWN": 1, "NWK": 2, "MT": 2})]
)
def test_asking_a_step_ahead_changes_when_operands_load_not_the_result(device, m, cfg) -> None:
    """AHEAD requests a step's scales and activations one step early; without it (the default)
    they load in the step. K = 512 gives each warp two steps, so both orders run."""
    ahead = _check(device, m, 40, 512, torch.bfloat16, 1, cfg, seed=m, ahead=True)
    in_step = _check(device, m, 40, 512, torch.bfloat16, 1, cfg, seed=m)
    assert torch.equal(ahead, in_step)


def test_fp32_out_from_bf16_rows(device) -> None:
    """The lm_head's case: bf16 activations, fp32 logits (rounded to the output's dtype)."""
    _check(device, 8, 16, 256, torch.bfloat16, 0, {"NWN": 1, "NWK": 1}, out_dtype=torch.float32)


def test_operands_it_cannot_take_are_refused_or_left_to_the_other_kernels(device) -> None:
    packed, scales, x, _ = _operands(4, 32, 256, torch.bfloat16, device, 0)
    assert not mma_ok(x.float(), packed, scales)  # fp32 activations: the tl.dot GEMM
    assert not mma_ok(x[:, :192], packed[:, :24], scales[:, :6])  # K not a multiple of 128
    with pytest.raises(ValueError, match="does not divide"):
        launch(x, packed, scales, torch.empty(4, 32, dtype=x.dtype, device=device),
               {"NWN": 1, "NWK": 4})  # fmt: skip
    with pytest.raises(ValueError, match="1..16"):
        x17 = torch.randn(17, 256, device=device).to(torch.bfloat16)
        launch(x17, packed, scales, torch.empty(17, 32, dtype=x.dtype, device=device),
               {"NWN": 1, "NWK": 1})  # fmt: skip


def test_default_and_candidate_tilings_fit_the_e2b_shapes() -> None:
    for n, k in ((2560, 1536), (1536, 12288), (256, 1536), (1536, 256), (262144, 1536)):
        cfgs = candidate_configs(n, k)
        assert cfgs and default_config(n, k, 8) in cfgs
        assert all((k // 128) % c["NWK"] == 0 and c["NWN"] * c["NWK"] <= 16 for c in cfgs)


E2B = [(2560, 1536), (5120, 1536), (2048, 1536), (4096, 1536), (1536, 2048), (1536, 4096),
       (12288, 1536), (24576, 1536), (1536, 6144), (1536, 12288), (256, 1536), (1536, 256),
       (8960, 1536), (262144, 1536)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(("n", "k"), E2B)
def test_every_e2b_shape_on_the_gpu(n, k) -> None:
    dev = torch.device("cuda")
    for m in (2, 8, 16):
        for epi in (0, 1, 2):
            _check(dev, m, n, k, torch.bfloat16, epi, default_config(n, k, m), seed=m)
    _check(dev, 16, n, k, torch.float16, 0, default_config(n, k, 16), seed=1)
    two = {**default_config(n, k, 16), "MT": 2, "NWN": 1}
    for m in (8, 16):  # two 16-row tiles a warp
        _check(dev, m, n, k, torch.bfloat16, 1, two, seed=m + 1)


def _compile_for_targets(targets: list[int]) -> None:
    """One JSON line per (tiling, AHEAD): the kernel at sm_90 with PDL, ptxas's registers and
    spill report, for the tilings with the most live values (MT 2 with two batch tiles; 16
    warps, whose registers are bounded at 128 a thread; a plain one). Run as a script."""
    import json
    import re

    for sm in targets:
        for nwn, nwk, mt, nb in ((1, 4, 2, 2), (1, 16, 1, 2), (2, 4, 1, 1)):
            for ahead in (False, True):
                ptx = mma_ptx(sm, nwn * nwk, NWN=nwn, NWK=nwk, MT=mt, NB=nb, EPI=1, AHEAD=ahead,
                              PDL=sm >= 90)  # fmt: skip
                report = ptxas_report(ptx, sm)
                regs = re.search(r"Used (\d+) registers", report)
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
                print(json.dumps({"sm": sm, "warps": nwn * nwk, "mt": mt, "nb": nb, "ahead": ahead,
                                  "registers": int(regs.group(1)) if regs else None,
                                  "spilled": sum(map(int, spills.groups())) if spills else None}),
                      flush=True)  # fmt: skip


def test_tilings_with_the_most_live_values_compile_without_spills() -> None:
    rows = compiled_rows(__file__, [90])
    assert len(rows) == 6
    for row in rows:
        assert row["spilled"] == 0 and row["registers"] is not None, row
        assert row["registers"] * 32 * row["warps"] <= 65536, row  # a program fits an SM


if __name__ == "__main__":
    import sys

    _compile_for_targets([int(a) for a in sys.argv[1:]])
