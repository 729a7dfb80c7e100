"""The CUDA chain probe's parts that need no GPU: NVRTC builds its kernels for Hopper from the
committed source (every K of the E2B chain), a broken source fails with the compiler's log, and
the tilings it tries fit the shapes."""

from __future__ import annotations

import pytest
import torch

from bench.engine.cuda_chain_probe import RT_ROWS, SOURCE, WARPS, product_table, tilings_for
from engine.kernels.cuda_build import CudaBuildError, compile_cubin
from bench.engine.persistent_probe import Chain, Product, layer_products

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC comes with a CUDA build of torch")


def _nvrtc_works() -> bool:
    try:
        compile_cubin('extern "C" __global__ void k() {}', {}, "sm_90")
    except Exception:  # noqa: BLE001 - any failure to load libnvrtc means: skip
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_works(), reason="libnvrtc cannot be loaded here")


@needs_nvrtc
def test_every_k_of_the_e2b_chain_builds_for_hopper_with_its_widest_tiling() -> None:
    source = SOURCE.read_text(encoding="utf-8")
    for k in sorted({p.k for p in layer_products("e2b")}):
        t = max(tilings_for(k), key=lambda t: (t.kt, t.rpt))
        cubin = compile_cubin(source, {"KC": k // 32, "KT": t.kt, "RPT": t.rpt,
                                       "WARPS": WARPS, "PF": t.pf}, "sm_90")  # fmt: skip
        assert cubin[:4] == b"\x7fELF", k  # machine code, not PTX


@needs_nvrtc
def test_the_links_build_without_a_shape() -> None:
    cubin = compile_cubin(SOURCE.read_text(encoding="utf-8"), {}, "sm_90")
    assert b"null_link" in cubin and b"copy_link" in cubin
    assert b"w4_rt_launch" in cubin and b"w4_rt_flow" in cubin  # the generic tile: K at run time
    assert b"w4_gemv" not in cubin  # the GEMV needs its shape's constants


@needs_nvrtc
def test_a_broken_source_fails_with_the_compilers_log() -> None:
    with pytest.raises(CudaBuildError, match="undefined_name"):
        compile_cubin('extern "C" __global__ void k() { undefined_name = 1; }', {}, "sm_90")


def test_tilings_cover_k_and_keep_the_loads_ahead_within_the_register_budget() -> None:
    for k in (256, 1536, 2048, 12288):
        tilings = tilings_for(k)
        assert tilings
        for t in tilings:
            assert t.kt in (8, 16, 32) and t.kt <= max(8, k // 32)
            assert 1 <= t.pf * t.rpt <= 16
            assert t.pf <= -(-(k // 32) // t.kt)
    assert {t.kt for t in tilings_for(256)} == {8}  # 8 chunks a row: no wider K split


def test_the_product_table_lays_each_product_out_as_the_kernels_struct() -> None:
    chain = Chain([Product("a", 64, 256), Product("b", 24, 64)], torch.device("cpu"))
    table = product_table(chain).tolist()
    assert len(table) == 2 and all(len(row) == 6 for row in table)  # 48 bytes a product
    x, w, s, y, n_kc, tiles = table[1]
    assert x == chain.outs[0].data_ptr() and y == chain.outs[1].data_ptr()
    assert (w, s) == (chain.weights[1][0].data_ptr(), chain.weights[1][1].data_ptr())
    assert n_kc & 0xFFFFFFFF == 24 and n_kc >> 32 == 64 // 32
    assert tiles == -(-24 // RT_ROWS)
    assert table[0][0] == chain.x0.data_ptr() and table[0][4] >> 32 == 256 // 32
