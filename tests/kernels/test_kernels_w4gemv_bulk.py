"""The CUDA GEMV's bulk-copy tilings (engine/kernels/w4gemv_cuda.cu, BULK=1): the block's rows of
weights and scales copied into shared memory by the tensor memory accelerator before the wait.

On the CPU: NVRTC builds them for sm_90 and their PTX issues the copies before
griddepcontrol.wait, with no weight load from registers' path; the constants refuse what the
copy cannot do. On a GPU: every bulk tiling equals the register tiling of the same threads bit
for bit (the same sums in the same order), on E2B's shapes, a ragged last block and each
variant."""

from __future__ import annotations

import pytest
import torch
from cuda_gemv_support import HEADERS, PRO, SOURCE, layer, needs_nvrtc, no_gpu

from engine.kernels import w4gemv_cuda
from engine.kernels.w4gemv_cuda import Prologue, Tiling, bulk_tilings, defines

SHAPES = [(2560, 1536), (1536, 12288), (1536, 256), (24576, 1536), (1000, 512)]


@needs_nvrtc
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_bulk_tilings_copy_every_weight_before_the_wait(n, k) -> None:
    from engine.kernels import cuda_build

    tilings = bulk_tilings(n, k)
    assert tilings and all(t.bulk_bytes(k) <= w4gemv_cuda.MAX_BULK_BYTES for t in tilings)
    for epi, pro in ((0, None), (1, None), (2, None), (0, PRO)):
        if pro is not None and k > w4gemv_cuda.MAX_PRO_K:
            continue
        t = next(t for t in tilings if epi != 1 or t.rpt % 2 == 0)
        ptx = cuda_build.compile_ptx(SOURCE, defines(k, t, epi, pro, "sm_90"), "sm_90",
                                     HEADERS)  # fmt: skip
        body = ptx[ptx.index(".entry w4_gemv") :]
        before, after = body.split("griddepcontrol.wait", 1)
        assert before.count("cp.async.bulk.shared::cluster.global") == 2, (n, k, epi, t)
        assert "ld.global.cs" not in body and "cp.async.bulk" not in after
        assert "mbarrier.try_wait.parity" in after


def test_a_bulk_copy_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="bulk"):
        defines(1536, Tiling(16, 2, bulk=1), 0, None, "sm_80")  # no TMA before Hopper
    with pytest.raises(ValueError, match="bulk"):
        defines(1568, Tiling(16, 2, bulk=1), 0, None, "sm_90")  # scales rows not 16 bytes
    with pytest.raises(ValueError, match="bulk"):
        defines(12288, Tiling(8, 4, 8, bulk=1), 0, None, "sm_90")  # 128 rows of 6.75 KB
    assert bulk_tilings(1024, 1568) == []
    assert defines(1536, Tiling(16, 2, bulk=1), 0, None, "sm_90")["BULK"] == 1


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_bulk_tiling_equals_the_register_tiling_of_its_threads(n, k) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    packed, scales = layer(n, k, gen)
    x = torch.randn(k, generator=gen, device="cuda").bfloat16()
    for t in bulk_tilings(n, k):
        want = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        w4gemv_cuda.launch(x, packed, scales, want, Tiling(t.kt, t.rpt, t.warps))
        got = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
        w4gemv_cuda.launch(x, packed, scales, got, t)
        assert torch.equal(got, want), (t, (got.float() - want.float()).abs().max())


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize("epi", [0, 1, 2])
def test_the_bulk_variants_equal_the_register_variants(epi) -> None:
    """GLU, gelu*aux and the residual+norm prologue with a bulk copy, in a PDL graph replayed
    twice (the barrier is made afresh by every launch)."""
    from engine.kernels.launch import pdl_launches

    gen = torch.Generator(device="cuda").manual_seed(epi + 11)
    n, k = 4096, 1536
    packed, scales = layer(n, k, gen)
    aux = torch.randn(n, generator=gen, device="cuda").bfloat16() if epi == 2 else None
    y = torch.randn(k, generator=gen, device="cuda").bfloat16()
    h = (torch.randn(k, generator=gen, device="cuda") * 4).bfloat16()
    w_post = (torch.rand(k, generator=gen, device="cuda") + 0.5).bfloat16()
    w_next = (torch.rand(k, generator=gen, device="cuda") + 0.5).bfloat16()
    width = n // 2 if epi == 1 else n
    results = []
    for bulk in (0, 1):
        t = Tiling(16, 2, bulk=bulk)
        h_out = torch.full_like(h, float("nan"))
        out = torch.full((width,), float("nan"), device="cuda", dtype=torch.bfloat16)
        pro = Prologue(y, h, w_post, None, w_next, h_out, 1e-6)
        with pdl_launches():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w4gemv_cuda.launch(y, packed, scales, out, t, epi=epi, aux=aux, pro=pro)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), h_out.clone()))
    (reg, h_reg), (blk, h_blk) = results
    assert torch.equal(blk, reg) and torch.equal(h_blk, h_reg)
