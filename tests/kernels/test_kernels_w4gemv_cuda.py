"""The CUDA GEMV (engine/kernels/w4gemv_cuda.py): on the CPU, NVRTC builds every variant the
one-row E2B step launches, the disk cache returns a build without compiling again, and the
switch and the routing refuse what the kernel cannot run; on a GPU (marker `gpu`) each variant
equals the reference and the Triton kernel on every E2B shape, in a PDL graph too."""

from __future__ import annotations

import pytest
import torch
from cuda_gemv_support import HEADERS as _HEADERS
from cuda_gemv_support import PRO as _PRO
from cuda_gemv_support import SOURCE as _SOURCE
from cuda_gemv_support import layer as _layer
from cuda_gemv_support import needs_nvrtc, no_gpu

from engine.kernels import cuda_build, tuning, w4gemv_cuda
from engine.kernels.w4gemv_cuda import (
    Tiling,
    candidate_tilings,
    default_tiling,
    defines,
    usable,
)
from engine.options import EngineOptions

E2B_SHAPES = [(256, 1536), (1536, 256), (1536, 2048), (1536, 4096), (1536, 6144), (1536, 12288),
              (2048, 1536), (2560, 1536), (4096, 1536), (5120, 1536), (12288, 1536),
              (24576, 1536)]  # fmt: skip


@needs_nvrtc
@pytest.mark.parametrize(("n", "k"), E2B_SHAPES)
def test_every_variant_of_the_e2b_step_builds_for_hopper(n, k) -> None:
    for epi in (0, 1, 2):
        t = default_tiling(n, k, epi)
        staged = Tiling(t.kt, t.rpt, t.warps, xs=1)  # the probe's other row source
        cubin = cuda_build.compile_cubin(_SOURCE, defines(k, staged, epi, None, "sm_90"),
                                         "sm_90", _HEADERS)  # fmt: skip
        assert cubin[:4] == b"\x7fELF", (n, k, epi, "staged")
        for pro in (None, _PRO) if k == 1536 else (None,):
            cubin = cuda_build.compile_cubin(
                _SOURCE, defines(k, t, epi, pro, "sm_90"), "sm_90", _HEADERS
            )
            assert cubin[:4] == b"\x7fELF", (n, k, epi, pro is not None)


def _before_and_after_the_wait(n: int, k: int, t: Tiling, epi: int, pro) -> tuple[str, str]:
    ptx = cuda_build.compile_ptx(_SOURCE, defines(k, t, epi, pro, "sm_90"), "sm_90", _HEADERS)
    body = ptx[ptx.index(".entry w4_gemv") :]
    before, after = body.split("griddepcontrol.wait", 1)
    return before, after


@needs_nvrtc
@pytest.mark.parametrize(("n", "k"), E2B_SHAPES)
def test_every_weight_a_thread_reads_is_requested_before_the_wait(n, k) -> None:
    """What the kernel is for (its PTX, sm_90): each thread's 16-byte weight loads, one per
    chunk ahead and row, all come before griddepcontrol.wait; nothing the kernel before writes
    (activations, the prologue's rows: read through L2) is read, and nothing is stored, before
    it."""
    import re

    variants = [(epi, None) for epi in (0, 1, 2)] + ([(0, _PRO), (1, _PRO)] if k == 1536 else [])
    for epi, pro in variants:
        t = default_tiling(n, k, epi)
        before, after = _before_and_after_the_wait(n, k, t, epi, pro)
        weights = len(re.findall(r"ld\.global\.cs\.v4", before))
        assert weights == t.ahead(k) * t.rpt, (n, k, epi, pro is not None, t)
        if t.ahead(k) * t.kt >= k // 32:  # every chunk ahead: none left for after the wait
            assert not re.findall(r"ld\.global\.cs\.v4", after), (n, k, epi, t)
        assert not re.findall(r"ld\.global\.(cg|ca)|st\.global|st\.shared", before), (n, k, epi, t)


@needs_nvrtc
def test_before_hopper_the_kernel_builds_without_griddepcontrol() -> None:
    consts = defines(1536, Tiling(16, 2), 1, _PRO, "sm_80")
    assert consts["PDL"] == 0 and defines(1536, Tiling(16, 2), 1, _PRO, "sm_90")["PDL"] == 1
    assert cuda_build.compile_cubin(_SOURCE, consts, "sm_80", _HEADERS)[:4] == b"\x7fELF"


@needs_nvrtc
def test_a_build_is_read_back_from_the_disk_cache_without_compiling(tmp_path, monkeypatch) -> None:
    consts = defines(1536, Tiling(16, 2), 0, None, "sm_90")
    first = cuda_build.cached_cubin(_SOURCE, consts, "sm_90", tmp_path, _HEADERS)
    assert [p.suffix for p in tmp_path.iterdir()] == [".cubin"]

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(cuda_build, "compile_cubin", no_compile)
    assert cuda_build.cached_cubin(_SOURCE, consts, "sm_90", tmp_path, _HEADERS) == first
    other = dict(consts, RPT=4)  # another variant is another file
    with pytest.raises(AssertionError, match="compiled again"):
        cuda_build.cached_cubin(_SOURCE, other, "sm_90", tmp_path, _HEADERS)


@needs_nvrtc
def test_builds_ahead_run_once_per_variant_on_worker_threads(tmp_path) -> None:
    tuning.configure(True, tmp_path)
    try:
        cpu = torch.device("cpu")  # builds for sm_90 without a GPU
        first = w4gemv_cuda.build_ahead(cpu, 2048, Tiling(16, 2), 0, None)
        assert w4gemv_cuda.build_ahead(cpu, 2048, Tiling(16, 2), 0, None) is first
        other = w4gemv_cuda.build_ahead(cpu, 2048, Tiling(16, 2), 2, None)
        assert other is not first
        assert first.result(timeout=120)[:4] == other.result(timeout=120)[:4] == b"\x7fELF"
        assert len(list((tmp_path / "cuda").glob("*.cubin"))) == 2
    finally:
        tuning.configure(True, None)


@needs_nvrtc
def test_a_broken_source_fails_with_the_compilers_log(tmp_path) -> None:
    with pytest.raises(cuda_build.CudaBuildError, match="undefined|identifier"):
        cuda_build.cached_cubin(_SOURCE.replace("pdl_wait();", "pdl_wiat();", 1),
                                defines(256, Tiling(8, 1), 0, None, "sm_90"), "sm_90", tmp_path,
                                _HEADERS)  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(("n", "k"), E2B_SHAPES)
def test_the_tilings_fit_the_shape_and_the_glu_gets_whole_pairs(n, k) -> None:
    for epi in (0, 1):
        tilings = candidate_tilings(n, k, epi)
        assert tilings and all(t.rows_per_block() <= 2 * n for t in tilings)
        assert all(t.kt <= max(8, k // 32) for t in tilings)
        if epi == 1:
            assert all(t.rpt % 2 == 0 for t in tilings)
            assert default_tiling(n, k, epi).rpt % 2 == 0
    for t in candidate_tilings(n, k):
        assert t.ahead(k) * t.rpt <= w4gemv_cuda.MAX_AHEAD


def test_only_one_bf16_row_on_an_nvidia_gpu_is_routed_to_it() -> None:
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert not usable(x, 1)  # the CPU
    if torch.cuda.is_available():
        g = x.cuda()
        assert usable(g, 1) == cuda_build.cuda_build_available()
        assert not usable(g, 2) and not usable(g.half(), 1) and not usable(g.float(), 1)
        assert not usable(g, 1, out_dtype=torch.float32)
        assert not usable(torch.zeros(72, dtype=torch.bfloat16, device="cuda")[1:65], 1)


def test_the_switch_comes_from_the_engine_options() -> None:
    from engine.fast.ops_fast import FastOps

    assert not EngineOptions.from_env({}).cuda_gemv
    on = EngineOptions.from_env({"GPURIG_CUDA_GEMV": "1"})
    assert on.cuda_gemv and FastOps(cuda_gemv=on.cuda_gemv).cuda_gemv


def test_on_the_cpu_the_switch_leaves_the_triton_kernel(device) -> None:
    from engine.kernels.w4gemv import w4_gemv, w4_gemv_reference

    if device.type == "cuda":
        pytest.skip("the CPU's fallback")
    packed = torch.randint(-(2**31), 2**31 - 1, (32, 8), dtype=torch.int32)
    scales = torch.rand(32, 2).bfloat16() * 0.01
    x = torch.randn(1, 64).bfloat16()
    got = w4_gemv(x, packed, scales, cuda=True)
    want = w4_gemv_reference(x, packed, scales)
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize(("n", "k"), E2B_SHAPES)
def test_every_tiling_equals_the_reference_on_the_e2b_shapes(n, k) -> None:
    from engine.kernels.w4gemv import w4_gemv_reference

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    packed, scales = _layer(n, k, gen)
    x = torch.randn(k, generator=gen, device="cuda").bfloat16()
    want = w4_gemv_reference(x[None], packed, scales)[0].float()
    for t in candidate_tilings(n, k):  # the builds at once, on worker threads
        w4gemv_cuda.build_ahead(x.device, k, t, 0, None)
    for t in candidate_tilings(n, k):
        y = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
        w4gemv_cuda.launch(x, packed, scales, y, t)
        err = ((y.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (t, err)


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize(("epi", "with_scalar", "with_next"), [(0, True, True), (1, False, True),
                                                               (2, False, False), (0, False, False)])  # fmt: skip
def test_the_variants_equal_the_triton_kernel(epi, with_scalar, with_next) -> None:
    """Plain, GLU, gelu*aux and the residual+norm prologue, against the Triton kernel's same
    entry point (the exact fp32 unpack) on E2B's hidden width."""
    from engine.kernels.w4gemv import w4_gemv, w4_gemv_after_residual, w4_gemv_glu

    gen = torch.Generator(device="cuda").manual_seed(epi)
    n, k = 4096, 1536
    packed, scales = _layer(n, k, gen)
    x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
    tol = dict(rtol=2e-2, atol=2e-2)
    if epi == 0:
        assert torch.allclose(w4_gemv(x, packed, scales, cuda=True).float(),
                              w4_gemv(x, packed, scales, half2=False).float(), **tol)  # fmt: skip
    if epi == 1:
        assert torch.allclose(w4_gemv_glu(x, packed, scales, cuda=True).float(),
                              w4_gemv_glu(x, packed, scales, half2=False).float(), **tol)  # fmt: skip
    y = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
    h = (torch.randn(1, k, generator=gen, device="cuda") * 4).bfloat16()
    w_post = (torch.rand(k, generator=gen, device="cuda") + 0.5).bfloat16()
    w_next = (torch.rand(k, generator=gen, device="cuda") + 0.5).bfloat16() if with_next else None
    scalar = torch.tensor([0.75], device="cuda").bfloat16() if with_scalar else None
    aux = torch.randn(n, generator=gen, device="cuda").bfloat16() if epi == 2 else None
    outs = []
    for cuda in (True, False):
        h_out = torch.full_like(h, float("nan"))
        got = w4_gemv_after_residual(y, h, w_post, 1e-6, packed, scales, h_out, scalar=scalar,
                                     w_next=w_next, epi=epi, aux=aux, half2=False, cuda=cuda)  # fmt: skip
        outs.append((got.float(), h_out.float()))
    (got, h1), (want, h2) = outs
    assert torch.allclose(h1, h2, rtol=1e-2, atol=2e-2)
    assert torch.allclose(got, want, **tol), (got - want).abs().max()


@pytest.mark.gpu
@no_gpu
def test_a_pdl_graph_of_chained_products_equals_the_same_products_run_alone() -> None:
    from engine.kernels.launch import pdl_launches

    gen = torch.Generator(device="cuda").manual_seed(3)
    layers = [_layer(1536, 1536, gen) for _ in range(8)]
    x0 = torch.randn(1536, generator=gen, device="cuda").bfloat16()
    outs = [torch.empty(1536, device="cuda", dtype=torch.bfloat16) for _ in layers]
    t = Tiling(16, 2)

    def chain() -> None:
        src = x0
        for (p, s), y in zip(layers, outs, strict=True):
            w4gemv_cuda.launch(src, p, s, y, t)
            src = y

    chain()
    torch.cuda.synchronize()
    alone = [y.clone() for y in outs]
    for y in outs:
        y.zero_()
    with pdl_launches():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, alone, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@no_gpu
def test_tuning_stores_a_tiling_that_the_next_lookup_reads(tmp_path) -> None:
    tuning.configure(True, tmp_path)
    tuning.forget_memory()
    try:
        dev = torch.device("cuda")
        t = w4gemv_cuda.tiling_for(256, 1536, dev)
        assert t in candidate_tilings(256, 1536) + w4gemv_cuda.bulk_tilings(256, 1536)
        tuning.forget_memory()
        tuning.configure(False, tmp_path)  # read from the file, no timing
        assert w4gemv_cuda.tiling_for(256, 1536, dev) == t
    finally:
        tuning.configure(True, None)
        tuning.forget_memory()


def test_a_row_too_long_for_shared_memory_is_refused_before_building() -> None:
    with pytest.raises(ValueError, match="shared memory"):
        defines(32768, Tiling(32, 2, xs=1), 0, None, "sm_90")
    with pytest.raises(ValueError, match="shared memory"):
        defines(12288, Tiling(32, 2), 0, _PRO, "sm_90")
    assert defines(32768, Tiling(32, 2), 0, None, "sm_90")["XS"] == 0
