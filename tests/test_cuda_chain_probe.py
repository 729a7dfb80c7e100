"""The CUDA chain probe's parts that need no GPU: NVRTC builds its links and generic tile for
Hopper from the committed source, a broken source fails with the compiler's log, and the product
table matches the kernel's struct. (The per-shape GEMV is the engine's: its tests are in
tests/kernels/test_kernels_w4gemv_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from bench.engine.cuda_chain_probe import RT_ROWS, SOURCE, product_table
from bench.engine.persistent_probe import Chain, Product
from engine.kernels import w4gemv_cuda
from engine.kernels.cuda_build import CudaBuildError, compile_cubin

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC comes with a CUDA build of torch")


def _nvrtc_works() -> bool:
    try:
        compile_cubin('extern "C" __global__ void k() {}', {}, "sm_90")
    except Exception:  # noqa: BLE001 - any failure to load libnvrtc means: skip
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_works(), reason="libnvrtc cannot be loaded here")


@needs_nvrtc
def test_the_links_build_without_a_shape() -> None:
    cubin = compile_cubin(SOURCE.read_text(encoding="utf-8"), {"PDL": 1}, "sm_90",
                          w4gemv_cuda.sources()[1])  # fmt: skip
    assert b"null_link" in cubin and b"copy_link" in cubin
    assert b"w4_rt_launch" in cubin and b"w4_rt_flow" in cubin  # the generic tile: K at run time
    assert b"w4_gemv" not in cubin  # the per-shape GEMV is the engine's


@needs_nvrtc
def test_a_broken_source_fails_with_the_compilers_log() -> None:
    with pytest.raises(CudaBuildError, match="undefined_name"):
        compile_cubin('extern "C" __global__ void k() { undefined_name = 1; }', {}, "sm_90")


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
