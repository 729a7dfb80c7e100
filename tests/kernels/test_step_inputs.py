"""The decode step's token pick (engine/kernels/step_inputs.py) against PyTorch ops, and on a GPU
the decode graphs that use it: a row continuing its previous step reads that step's id on the
device, including a sampled row's draw written over the greedy id."""

from __future__ import annotations

import threading

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.kernels.step_inputs import pick_tokens, step_tables
from engine.options import EngineOptions
from engine.sampling import SamplingParams


def _reference(inputs: torch.Tensor, ids: torch.Tensor):
    src, fresh, positions, slots = inputs
    tokens = torch.where(src >= 0, ids[src.clamp(min=0)], fresh)
    return tokens, positions, slots.to(torch.int32)


@pytest.mark.parametrize("rows", [1, 3, 16, 33])
def test_pick_tokens_equals_the_torch_ops(device, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 262_144, (40,), generator=gen)
    src = torch.randint(-1, 40, (rows,), generator=gen)
    src[0] = -1  # at least one fresh row
    fresh = torch.randint(0, 262_144, (rows,), generator=gen)
    positions = torch.randint(0, 131_072, (rows,), generator=gen)
    slots = torch.randint(0, 64, (rows,), generator=gen)
    inputs = torch.stack([src, fresh, positions, slots]).to(device)
    got = pick_tokens(inputs, ids.to(device))
    want = _reference(inputs, ids.to(device))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu())


def test_pick_tokens_refuses_inputs_of_another_shape_or_dtype(device) -> None:
    ids = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"\[4, B\]"):
        pick_tokens(torch.zeros(3, 2, dtype=torch.int64, device=device), ids)
    with pytest.raises(ValueError, match=r"\[4, B\]"):
        pick_tokens(torch.zeros(2, 4, dtype=torch.int64, device=device).t(), ids)
    with pytest.raises(ValueError, match="int64"):
        pick_tokens(torch.zeros(4, 2, dtype=torch.int32, device=device), ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("step_inputs") / "tiny"
    make_checkpoint(path, preset="tiny", seed=7)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_tables_equal_the_models_rope_and_the_pools_rows(tiny, device, dtype) -> None:
    """Against Gemma4Model.rope and KVPool.write_rows of a real engine, at positions up to
    131k (large angles: the approximate cos would be far off there). Equal on the GPU
    (libdevice is what PyTorch's kernels call); within a rounding step under the interpreter
    (numpy's cos)."""
    eng = engine.load(tiny, device=device, dtype=dtype, max_context=256, max_num_seqs=4,
                      options=EngineOptions(fast="force", cuda_graph=False), warm_up=False)  # fmt: skip
    try:
        m, pool = eng.model, eng.pool
        assert len(m.inv_freq) == 2
        gen = torch.Generator().manual_seed(3)
        tables = pool.block_tables
        tables.copy_(torch.randint(0, 50, tables.shape, generator=gen, dtype=torch.int32))
        rows = 7
        slots = torch.randint(0, tables.shape[0], (rows,), generator=gen).to(device)
        span = tables.shape[1] * pool.block_size
        positions = torch.randint(0, span, (rows,), generator=gen).to(device)
        big = torch.tensor([131_071, 100_003, 65_537], device=device)  # rope only: no table
        got, full, ring = step_tables(positions, slots.to(torch.int32), tables, pool.block_size,
                                      pool.ring_slots, list(m.inv_freq.values()), dtype)  # fmt: skip
        want_full, want_ring = pool.write_rows(slots, positions)
        assert torch.equal(full, want_full) and torch.equal(ring, want_ring)
        want = m.rope(positions)
        wide = torch.zeros(1, 131_072 // pool.block_size, dtype=torch.int32, device=device)
        far, _, _ = step_tables(big, torch.zeros(3, dtype=torch.int32, device=device), wide,
                                pool.block_size, pool.ring_slots, list(m.inv_freq.values()),
                                dtype)  # fmt: skip
        want_far = m.rope(big)
        for kind, (cos, sin), (cos_far, sin_far) in zip(m.inv_freq, got, far, strict=True):
            pairs = [(cos, want[kind][0]), (sin, want[kind][1]),
                     (cos_far, want_far[kind][0]), (sin_far, want_far[kind][1])]  # fmt: skip
            for g, w in pairs:
                assert g.dtype == w.dtype and g.shape == w.shape
                if device.type == "cuda":
                    assert torch.equal(g, w)
                else:
                    torch.testing.assert_close(g, w, rtol=2**-7, atol=2**-8)
    finally:
        eng.close()


def test_step_tables_take_one_or_two_kinds(device) -> None:
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    slot = torch.zeros(2, dtype=torch.int32, device=device)
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)
    inv = torch.ones(4, device=device)
    (one,), full, ring = step_tables(pos, slot, table, 16, 8, [inv], torch.float32)
    assert one[0].shape == (2, 8) and torch.equal(one[0].cpu(), torch.ones(2, 8))
    with pytest.raises(ValueError, match="one or two"):
        step_tables(pos, slot, table, 16, 8, [inv] * 3, torch.float32)
    with pytest.raises(ValueError, match="int64"):
        step_tables(pos.int(), slot, table, 16, 8, [inv], torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_graph_steps_continue_from_sampled_and_greedy_ids(tmp_path) -> None:
    """fp32 on the decode graphs: a seeded sampled request and two greedy ones decoding
    together each get the tokens they get alone (a sampled row whose next step read the
    greedy id instead of its draw would part from its alone tokens)."""
    make_checkpoint(tmp_path, preset="tiny", seed=7)
    eng = engine.load(tmp_path, device="cuda", dtype=torch.float32, max_context=256,
                      max_num_seqs=4, options=EngineOptions())  # fmt: skip
    try:
        assert eng.runner.graphs is not None
        prompts = [[2] + [(13 * i + 5 * j) % 400 + 10 for i in range(9 + 7 * j)] for j in range(3)]
        params = [
            SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=77, stop_ids=()),
            SamplingParams(max_tokens=30, stop_ids=()),
            SamplingParams(max_tokens=18, stop_ids=()),
        ]
        alone = [eng.generate(p, q) for p, q in zip(prompts, params, strict=True)]
        got: dict[int, list[int]] = {}

        def run(j: int) -> None:
            got[j] = eng.generate(prompts[j], params[j])

        threads = [threading.Thread(target=run, args=(j,)) for j in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got[j] for j in range(3)] == alone
        assert eng.scheduler.stats().step_rows > eng.scheduler.stats().steps  # rows shared steps
    finally:
        eng.close()
