"""The CUDA GEMV over several activation rows (MR = 2..8: a batched decode step's products under
GPURIG_CUDA_GEMV), each weight word's codes unpacked once for all rows.

On the CPU: NVRTC builds every E2B shape's variants for sm_90 and sm_80, the weights of a thread
are requested before the wait, and the constants refuse what the kernel cannot hold. On a GPU:
every tiling (register and bulk) against the reference on E2B shapes and a ragged last block."""

from __future__ import annotations

import pytest
import torch
from cuda_gemv_support import HEADERS, PRO, SOURCE, layer, needs_nvrtc, no_gpu

from engine.kernels import cuda_build, w4gemv_cuda
from engine.kernels.w4gemv_cuda import (
    MAX_ROWS,
    MAX_SUMS,
    Tiling,
    bulk_tilings,
    candidate_tilings,
    default_tiling,
    defines,
    usable,
)

SHAPES = [(2560, 1536), (1536, 12288), (12288, 1536), (1536, 256), (1000, 512)]


@needs_nvrtc
@pytest.mark.parametrize("rows", [2, 8])
def test_every_rows_variant_builds_and_requests_its_weights_before_the_wait(rows) -> None:
    import re

    for n, k in [(2560, 1536), (1536, 12288), (1000, 512)]:
        for epi in (0, 1, 2):
            t = default_tiling(n, k, epi, rows)
            assert t.rpt * rows <= MAX_SUMS
            consts = defines(k, t, epi, None, "sm_90", rows)
            assert consts["MR"] == rows
            ptx = cuda_build.compile_ptx(SOURCE, consts, "sm_90", HEADERS)
            body = ptx[ptx.index(".entry w4_gemv") :]
            before, after = body.split("griddepcontrol.wait", 1)
            assert len(re.findall(r"ld\.global\.cs\.v4", before)) == t.ahead(k) * t.rpt
            assert not re.findall(r"ld\.global\.(cg|ca)|st\.global", before)
            # the activations: 16-byte loads of every row, after the wait
            assert len(re.findall(r"ld\.global\.ca\.v4", after)) >= rows
        old = defines(k, default_tiling(n, k, 0, rows), 0, None, "sm_80", rows)
        assert cuda_build.compile_cubin(SOURCE, old, "sm_80", HEADERS)[:4] == b"\x7fELF"


def test_what_several_rows_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match="rows"):
        defines(1536, Tiling(16, 2), 0, None, "sm_90", MAX_ROWS + 1)
    with pytest.raises(ValueError, match="rows"):
        defines(1536, Tiling(16, 2, xs=1), 0, None, "sm_90", 2)  # the staged row holds one
    with pytest.raises(ValueError, match="rows"):
        defines(1536, Tiling(16, 2), 0, PRO, "sm_90", 2)  # so does the prologue
    for n, k in SHAPES:
        for rows in (1, 2, 4, 8):
            tilings = candidate_tilings(n, k, 0, rows) + bulk_tilings(n, k, 0, rows)
            assert tilings and all(t.rpt * rows <= MAX_SUMS for t in tilings)
    x = torch.zeros(4, 1536, dtype=torch.bfloat16)
    assert not usable(x, 4)  # the CPU
    assert not usable(x.t(), 4) and not usable(x, MAX_ROWS + 1)


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_tiling_of_several_rows_equals_the_reference(rows, n, k) -> None:
    from engine.kernels.w4gemv import w4_gemv_reference

    gen = torch.Generator(device="cuda").manual_seed(rows * 131 + n + k)
    packed, scales = layer(n, k, gen)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    want = w4_gemv_reference(x, packed, scales).float()
    tilings = candidate_tilings(n, k, 0, rows)
    if torch.cuda.get_device_capability()[0] >= 9:
        tilings += bulk_tilings(n, k, 0, rows)
    for t in tilings:
        w4gemv_cuda.build_ahead(x.device, k, t, 0, None, rows)
    for t in tilings:
        y = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        w4gemv_cuda.launch(x, packed, scales, y, t)
        err = ((y.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (t, err)


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize("epi", [1, 2])
def test_the_epilogues_of_several_rows_equal_the_one_row_kernel_row_by_row(epi) -> None:
    """Row m of an 8-row launch equals the one-row launch of row m, bit for bit where the
    threads sum in the same order (same tiling): the GLU and gelu * aux per row."""
    gen = torch.Generator(device="cuda").manual_seed(epi)
    n, k, rows = 4096, 1536, 8
    packed, scales = layer(n, k, gen)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    aux = torch.randn(rows, n, generator=gen, device="cuda").bfloat16() if epi == 2 else None
    t = Tiling(16, 2)
    width = n // 2 if epi == 1 else n
    many = torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)
    w4gemv_cuda.launch(x, packed, scales, many, t, epi=epi, aux=aux)
    for m in range(rows):
        one = torch.empty(width, device="cuda", dtype=torch.bfloat16)
        w4gemv_cuda.launch(x[m].contiguous(), packed, scales, one, t, epi=epi,
                           aux=None if aux is None else aux[m].contiguous())  # fmt: skip
        assert torch.equal(many[m], one), m
