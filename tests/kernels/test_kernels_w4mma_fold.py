"""The residual+norm folded into the int4 mma product's last program
(engine/kernels/w4mma_residual.py) against the two launches it replaces, `w4_gemm` then
`residual_norm`: on the CPU interpreter (programs run one after another, so a tail run by any
program but the last would read y tiles not yet written) and on a GPU (the E2B shapes, and inside
a replayed CUDA graph, where the ticket must be back at 0 between replays); then a whole batched
decode step with the fold on and off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.kernels import w4gemm
from engine.kernels.fused import residual_norm
from engine.kernels.w4gemm import w4_gemm, w4_gemm_residual
from engine.kernels.w4mma_residual import rows_per_chunk, spread_ok, ticket
from engine.options import EngineOptions

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _operands(m, n, k, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.05 + 0.005).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    h = torch.randn(m, n, generator=gen).to(dtype)
    w_post, w_next = torch.randn(2, n, generator=gen).to(dtype)
    scalar = torch.tensor([0.7]).to(dtype)
    return [t.to(device) for t in (packed, scales, x, h, w_post, w_next, scalar)]


def _both(device, m, n, k, dtype, cfg, *, with_scalar, with_next, seed=0):
    """(fold's h, fold's x) and (the two launches' h, x) from the same operands."""
    packed, scales, x, h, w_post, w_next, scalar = _operands(m, n, k, dtype, device, seed)
    sc, nx = scalar if with_scalar else None, w_next if with_next else None
    h_fold, h_two = h.clone(), h.clone()
    x_fold = w4_gemm_residual(x, packed, scales, h_fold, w_post, 1e-6, scalar=sc, w_next=nx,
                              config=cfg)  # fmt: skip
    y = w4_gemm(x, packed, scales, config=cfg)
    _, x_two = residual_norm(h_two, y, w_post, 1e-6, scalar=sc, w_next=nx, h_out=h_two)
    assert not torch.equal(h_fold, h)  # the residual was added
    return (h_fold, x_fold), (h_two, x_two)


def _assert_same(fold, two, dtype, exact: bool):
    for a, b in zip(fold, two, strict=True):
        if b is None:
            assert a is None
        elif exact:
            assert torch.equal(a, b)
        else:  # a GPU's norm sums in another order: one 16-bit rounding apart at most
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg", "with_scalar", "with_next"),
    [
        (8, 64, 256, {"NWN": 1, "NWK": 1}, True, True),  # 4 programs, one chunk of 8 rows
        (11, 96, 128, {"NWN": 1, "NWK": 1, "RB": 4}, False, True),  # chunks of 4: 4, 4, 3
        (3, 48, 256, {"NWN": 1, "NWK": 2, "RB": 1}, True, False),  # row by row, N cut at 48
        (16, 64, 128, {"NWN": 2, "NWK": 1, "MT": 2}, False, False),  # one program, both tiles
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fold_equals_the_two_launches(device, m, n, k, cfg, with_scalar, with_next, dtype):
    fold, two = _both(device, m, n, k, dtype, cfg, with_scalar=with_scalar, with_next=with_next)
    _assert_same(fold, two, dtype, exact=device.type == "cpu")
    assert ticket(device).tolist() == [0, 0]  # put back for the next launch


def test_fold_refuses_what_it_cannot_take(device) -> None:
    packed, scales, x, h, w_post, w_next, _ = _operands(4, 64, 128, torch.bfloat16, device, 1)
    with pytest.raises(ValueError, match="h must be a contiguous"):
        w4_gemm_residual(x, packed, scales, h.t().contiguous().t(), w_post, 1e-6)
    with pytest.raises(ValueError, match="h must be a contiguous"):
        w4_gemm_residual(x, packed, scales, h.float(), w_post, 1e-6)
    with pytest.raises(ValueError, match="norm weights must be"):
        w4_gemm_residual(x, packed, scales, h, w_post[:32], 1e-6)


def test_fp32_and_one_row_keep_the_two_launches(device) -> None:
    """No mma kernel for fp32 rows or a single row: the same result by w4_gemm + residual_norm."""
    for dtype, m in ((torch.float32, 4), (torch.bfloat16, 1)):
        packed, scales, x, h, w_post, w_next, scalar = _operands(m, 64, 128, dtype, device, 2)
        h_two = h.clone()
        x_fold = w4_gemm_residual(x, packed, scales, h, w_post, 1e-6, scalar=scalar,
                                  w_next=w_next)  # fmt: skip
        y = w4_gemm(x, packed, scales)
        _, x_two = residual_norm(h_two, y, w_post, 1e-6, scalar=scalar, w_next=w_next,
                                 h_out=h_two)  # fmt: skip
        assert torch.equal(h, h_two) and torch.equal(x_fold, x_two)


def test_the_interpreter_never_takes_the_grid_barrier(interpreted) -> None:
    """Its programs run one after another: a barrier waiting for the others would never open."""
    if not interpreted:
        pytest.skip("the interpreter's case")
    assert not spread_ok(4, torch.device("cpu"))


def test_rows_per_chunk_keeps_about_32_values_a_thread() -> None:
    assert rows_per_chunk(16, 1536, 16) == 8  # 16 warps: 8 rows x 2,048 columns
    assert rows_per_chunk(16, 1536, 2) == 1
    assert rows_per_chunk(3, 64, 1) == 4  # never more rows than the next power of two of M
    assert rows_per_chunk(16, 1536, 8) == 4


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tail", ["spread", "last"])
@pytest.mark.parametrize("k", [256, 2048, 4096, 6144, 12288])
@pytest.mark.parametrize("m", [2, 8, 16])
def test_e2b_shapes_on_the_gpu(m, k, tail, monkeypatch) -> None:
    """Both tails: the grid barrier (every program folds its rows) and the last program's."""
    if tail == "last":
        monkeypatch.setenv("GPURIG_FOLD_TAIL", "last")
    grid = 1536 // 16  # at most: NWN = MT = 1
    assert spread_ok(grid, torch.device("cuda")) is (tail == "spread")
    fold, two = _both(torch.device("cuda"), m, 1536, k, torch.bfloat16, None, with_scalar=True,
                      with_next=True, seed=m + k)  # fmt: skip
    _assert_same(fold, two, torch.bfloat16, exact=False)
    assert ticket(torch.device("cuda")).tolist() == [0, 0]


@gpu
@pytest.mark.gpu
def test_replayed_in_a_cuda_graph() -> None:
    """Three replays of a captured fold, each after fresh h: each equals the two launches."""
    dev = torch.device("cuda")
    packed, scales, x, h, w_post, w_next, scalar = _operands(8, 1536, 2048, torch.bfloat16, dev, 7)
    w4_gemm_residual(x, packed, scales, h.clone(), w_post, 1e-6, scalar=scalar, w_next=w_next)
    h_graph = h.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x_graph = w4_gemm_residual(x, packed, scales, h_graph, w_post, 1e-6, scalar=scalar,
                                   w_next=w_next)  # fmt: skip
    for i in range(3):
        start = h * (1 + i)
        h_graph.copy_(start)
        graph.replay()
        h_two = start.clone()
        _, x_two = residual_norm(h_two, w4_gemm(x, packed, scales), w_post, 1e-6, scalar=scalar,
                                 w_next=w_next, h_out=h_two)  # fmt: skip
        _assert_same((h_graph, x_graph), (h_two, x_two), torch.bfloat16, exact=False)
    torch.cuda.synchronize()
    assert ticket(dev).tolist() == [0, 0]


# every product before a residual takes the mma kernel: o (2 x 64 and 2 x 128 wide heads),
# down (K 256) and the per-layer projection (K 128) all have K a multiple of 128; four layers
# (two sliding, a full one, one sharing the full one's cache) keep the interpreter's time down
FOLD_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64,
              "global_head_dim": 128, "hidden_size_per_layer_input": 128,
              "num_hidden_layers": 4, "num_kv_shared_layers": 1,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                              "full_attention"]}  # fmt: skip


def _align(model) -> None:
    """Weights read in place from a safetensors file on the CPU can sit 8 bytes off the 16
    the mma kernel's vector loads need (a GPU copy never does): copies, for the products that
    fold."""
    for layer in model.layers:
        for name in ("o", "down", "ple_proj"):
            w = getattr(layer, name)
            setattr(layer, name, dataclasses.replace(w, packed=w.packed.clone()))


def test_batched_step_with_the_fold_equals_the_step_without(tmp_path, device, monkeypatch):
    """One engine, one prefill, then the same step without and with the fold (the step writes
    only the rows of its own tokens, the same from both): the same logits, 12 folds."""
    path = tmp_path / "fold"
    make_checkpoint(path, preset="tiny", seed=3, overrides=FOLD_SHAPE)
    folds = []  # the mma launches that folded a residual (a spy around the real launch)
    real_launch = w4gemm.mma_launch

    def spy(*args, res=None, **kwargs):
        folds.append(res is not None)
        return real_launch(*args, res=res, **kwargs)

    monkeypatch.setattr(w4gemm, "mma_launch", spy)
    # the per-layer gate by the mma kernel in both steps (not the GEMV prologue at <= 8 rows):
    # the fold must change nothing else
    opts = EngineOptions(fast="force", cuda_graph=False, fold_residual=False, batch_prologue=False)
    eng = engine.load(path, device=device, max_context=64, dtype=torch.bfloat16, options=opts,
                      max_num_seqs=4, warm_up=False)  # fmt: skip
    logits = []
    try:
        runner, pool, model = eng.runner, eng.pool, eng.model
        _align(model)
        decoder = runner._step.__self__
        assert runner.batched and decoder.fold_residual is False
        slots = []
        for n in (5, 19, 9):  # 19: past the sliding window of 16
            slot = pool.blocks.open_slot()
            pool.apply((slot,), (pool.blocks.grow(slot, n + 1),))
            ids = torch.arange(3, 3 + n, device=model.device) % 500
            model.prefill_chunk(ids[:-1], 0, pool.view(slot), False)
            slots.append(slot)
        tokens = torch.tensor([7, 11, 13], device=model.device)
        positions = torch.tensor([4, 18, 8], device=model.device)
        slot_t = torch.tensor(slots, dtype=torch.int32, device=model.device)
        for fold in (False, True):
            decoder.fold_residual = fold
            folds.clear()
            logits.append(runner.step(tokens, positions, slot_t).float().cpu())
            # o, down and the per-layer projection of each of the 4 layers
            assert sum(folds) == (12 if fold else 0), folds
    finally:
        eng.close()
    if device.type == "cpu":
        assert torch.equal(logits[0], logits[1])
    else:
        torch.testing.assert_close(logits[0], logits[1], rtol=0.05, atol=0.05)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


# ---- compiled for each GPU generation (Triton's own ptxas, no GPU needed) ----------------


def _compile_for_targets(targets: list[int]) -> None:
    """One JSON line per (target, tail): the mma kernel with the fold at an o-projection's
    shape (8 rows, N 1,536, 4 warps along K), whether its barrier spins on an acquire load,
    and ptxas's spill report. Run as a script (no interpreter)."""
    import json

    from compile_support import mma_ptx, ptxas_report

    for sm in targets:
        for spread in (False, True):
            ptx = mma_ptx(sm, 4, RES=True, HAS_SCALAR=True, HAS_NEXT=True, RB=2, BLOCK_D=2048,
                          SPREAD=spread, AHEAD=True, PDL=sm >= 90)  # fmt: skip
            report = ptxas_report(ptx, sm)
            print(json.dumps({"sm": sm, "spread": spread,
                              "acquire_spin": "ld.global.gpu.acquire" in ptx,
                              "tickets": ptx.count("atom.global.gpu.acq_rel.add"),
                              "spills": [ln for ln in report.splitlines() if "spill" in ln]}),
                  flush=True)  # fmt: skip


def test_fold_compiles_for_each_gpu_without_spills() -> None:
    """Both tails compile for sm_80 and sm_90 with nothing spilled; the spread tail's barrier
    spins on an acquire load and takes two tickets (arrive, leave), the serial tail one."""
    import re

    from compile_support import compiled_rows

    rows = compiled_rows(__file__, [80, 90])
    assert len(rows) == 4
    for row in rows:
        assert row["acquire_spin"] is row["spread"], row
        assert row["tickets"] == (2 if row["spread"] else 1), row
        stores = [int(re.search(r"(\d+) bytes spill stores", s).group(1)) for s in row["spills"]]
        assert stores and max(stores) == 0, row


if __name__ == "__main__":
    import sys

    _compile_for_targets([int(a) for a in sys.argv[1:]])
