"""The CUDA chain probe's parts that need no GPU: NVRTC builds its links and generic tile for
Hopper from the committed source, a broken source fails with the compiler's log, and the product
table matches the kernel's struct. (The per-shape GEMV is the engine's: its tests are in
tests/kernels/test_kernels_w4gemv_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from bench.engine import cuda_chain_probe as probe
from bench.engine.cuda_chain_probe import RT_ROWS, SOURCE, flow_table, product_table
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
    assert b"w4_bulk_flow" in cubin  # the persistent chain on bulk-copied tiles (sm_90)


@needs_nvrtc
def test_before_hopper_the_links_build_without_the_bulk_flow() -> None:
    cubin = compile_cubin(SOURCE.read_text(encoding="utf-8"), {"PDL": 0}, "sm_80",
                          w4gemv_cuda.sources()[1])  # fmt: skip
    assert b"w4_rt_flow" in cubin and b"w4_bulk_flow" not in cubin


@needs_nvrtc
def test_the_bulk_flow_streams_weights_while_it_waits() -> None:
    """Its PTX: the copies into the stages and the barrier waits, a ring of them, and the
    shared memory it asks for within a Hopper SM's 227 KB."""
    from engine.kernels.cuda_build import compile_ptx

    ptx = compile_ptx(SOURCE.read_text(encoding="utf-8"), {"PDL": 1}, "sm_90",
                      w4gemv_cuda.sources()[1])  # fmt: skip
    body = ptx[ptx.index(".entry w4_bulk_flow") :]
    body = body[: body.find(".entry", 1) if ".entry" in body[1:] else len(body)]
    assert body.count("cp.async.bulk.shared::cluster.global") >= 4  # words and scales, twice
    assert "mbarrier.try_wait.parity" in body and "ld.acquire.gpu" in body
    assert probe.FLOW_STAGES * probe.FLOW_STAGE + probe.FLOW_X <= 227 * 1024


@needs_nvrtc
def test_every_ring_the_probe_times_builds_and_fits_an_sm() -> None:
    source, headers = SOURCE.read_text(encoding="utf-8"), w4gemv_cuda.sources()[1]
    for stages, kb, per_sm in probe.FLOW_RINGS:
        shared = stages * kb * 1024 + probe.FLOW_X
        assert per_sm * (shared + 1024) <= 228 * 1024, (stages, kb, per_sm)  # Hopper's SM
        cubin = compile_cubin(source, {"PDL": 1, "FS": stages, "FLOW_STAGE": kb * 1024},
                              "sm_90", headers)  # fmt: skip
        assert b"w4_bulk_flow" in cubin


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


def test_the_flow_table_tiles_every_product_within_a_stage() -> None:
    shapes = [("gate_up", 12288, 1536), ("down_wide", 1536, 12288), ("ple", 256, 1536)]
    chain = Chain([Product(*s) for s in shapes], torch.device("cpu"))
    table, tiles = flow_table(chain)
    rows = table.tolist()
    assert all(len(row) == 8 for row in rows)  # 64 bytes a product
    first = 0
    for i, (row, (_, n, k)) in enumerate(zip(rows, shapes, strict=True)):
        x, w, s, y, n_kc, count, rows_first, _ = row
        assert x == chain.input_of(i).data_ptr() and y == chain.outs[i].data_ptr()
        assert (n_kc & 0xFFFFFFFF, n_kc >> 32) == (n, k // 32)
        per_tile, start = rows_first & 0xFFFFFFFF, rows_first >> 32
        assert per_tile * (k // 32) * 18 <= probe.FLOW_STAGE and per_tile <= 16
        assert count == tiles[i] == -(-n // per_tile) and start == first
        first += count
    assert rows[1][6] & 0xFFFFFFFF == 8  # a 12,288-wide row: 8 rows fill a 56 KB stage
