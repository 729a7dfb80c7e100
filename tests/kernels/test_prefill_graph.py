"""A prompt pass as a CUDA graph reads it (engine/fast/prefill_graph.py): fixed buffers, padding
rows, a flat attention grid, write rows computed from the block tables. On the CPU (CI) the
graph's body runs eagerly on its fixed buffers under Triton's interpreter and must leave the pool
as the plain pass does; on a GPU the captured graph is replayed and compared the same way."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.fast.prefill_graph import PassGraphs, pass_buckets
from engine.options import EngineOptions

CTX = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill_graph") / "tiny"
    make_checkpoint(path, preset="tiny", seed=5)
    return path


def _ids(n: int, salt: int, device) -> torch.Tensor:
    return torch.tensor([2] + [(5 * i + salt) % 300 + 20 for i in range(n - 1)], device=device)


def _open(pool, lengths):
    slots = [pool.blocks.open_slot() for _ in lengths]
    pool.apply(tuple(slots), ())
    grants = [pool.blocks.grow(s, n) for s, n in zip(slots, lengths, strict=True)]
    pool.apply((), tuple(g for g in grants if g is not None))
    return slots


def _rows(pool, slots):
    """Every layer's rows of each slot in position order (empty slots left out)."""
    out = {}
    for layer in pool.k:
        for s, slot in enumerate(slots):
            lc = pool.view(slot).layers[layer]
            order = torch.argsort(lc.pos)
            order = order[lc.pos[order] >= 0]
            out[layer, s] = (lc.k[order].clone(), lc.v[order].clone(), lc.pos[order].clone())
    return out


def _close(pool, slots):
    for slot in slots:
        pool.blocks.close_slot(slot)


def test_buckets_cover_every_pass_size_up_to_the_budget():
    assert pass_buckets(2048) == [64, 128, 256, 512, 1024, 1536, 2048]
    assert pass_buckets(700) == [64, 128, 256, 512, 700]
    assert pass_buckets(40) == [40]


@pytest.fixture(scope="module")
def tiny_engine(checkpoint):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    eng = engine.load(checkpoint, device=dev, max_context=CTX, dtype=dtype, max_num_seqs=4,
                      options=EngineOptions(fast="force", cuda_graph=False, pass_graphs=False),
                      warm_up=False)  # fmt: skip
    yield eng
    eng.close()


def test_passes_a_graph_cannot_read_are_left_to_the_eager_path(tiny_engine):
    eng = tiny_engine
    graphs = PassGraphs(eng.runner.reader, eng.pool, max_tokens=64, max_segments=2)
    dev = eng.model.device
    slots = _open(eng.pool, [40, 40, 40])
    try:
        view = [eng.pool.view(s) for s in slots]
        fresh = [(_ids(10, 1, dev), 0, view[0]), (_ids(20, 2, dev), 0, view[1])]
        assert graphs.bucket_for(fresh) == 64
        assert graphs.bucket_for([(_ids(10, 1, dev), 4, view[0])]) is None  # continuing
        assert graphs.bucket_for([*fresh, (_ids(3, 3, dev), 0, view[2])]) is None  # 3 segments
        assert graphs.bucket_for([(_ids(65, 1, dev), 0, view[0])]) is None  # past the budget
        assert graphs.bucket_for([(_ids(10, 1, dev), 0, object())]) is None  # not a pool view
        assert not graphs.run(fresh)  # nothing captured: the caller reads it eagerly
    finally:
        _close(eng.pool, slots)


def test_the_graphs_pass_leaves_the_pool_as_the_plain_pass(tiny_engine):
    """Three fresh prompts (one longer than the ring of 16 slots, whose tail alone stays) in a
    64-row bucket with a spare segment, beside a fourth sequence whose rows must not change;
    against the same prompts read by `FusedPrefill.chunks` with its own plan."""
    eng = tiny_engine
    pool, reader, dev = eng.pool, eng.runner.reader, eng.model.device
    lengths = (9, 23, 5)
    prompts = [_ids(n, s, dev) for n, s in zip(lengths, (1, 2, 3), strict=True)]
    assert max(lengths) > pool.ring_slots

    other = _open(pool, [12])
    reader.chunks([(_ids(12, 9, dev), 0, pool.view(other[0]))])
    before = _rows(pool, other)

    slots = _open(pool, lengths)
    reader.chunks([(p, 0, pool.view(s)) for p, s in zip(prompts, slots, strict=True)])
    want = _rows(pool, slots)
    _close(pool, slots)

    slots = _open(pool, lengths)
    graphs = PassGraphs(reader, pool, max_tokens=64, max_segments=4)
    size = graphs.stage([(p, 0, pool.view(s)) for p, s in zip(prompts, slots, strict=True)])
    assert size == 64  # 37 rows and 27 of padding
    if dev.type == "cuda":
        assert graphs.capture_all(None, 0)
        assert graphs.run([(p, 0, pool.view(s)) for p, s in zip(prompts, slots, strict=True)])
    else:
        graphs._forward(size)
    got = _rows(pool, slots)
    after = _rows(pool, other)
    _close(pool, slots + other)

    assert got.keys() == want.keys()
    tol = 1e-5 if eng.dtype == torch.float32 else 2e-2
    for key, (k, v, pos) in want.items():
        k2, v2, pos2 = got[key]
        assert torch.equal(pos, pos2), key
        torch.testing.assert_close(k2, k, rtol=tol, atol=tol, msg=str(key))
        torch.testing.assert_close(v2, v, rtol=tol, atol=tol, msg=str(key))
    for key, (k, v, pos) in before.items():  # the padding rows wrote nothing of another's
        k2, v2, pos2 = after[key]
        assert torch.equal(k2, k) and torch.equal(v2, v) and torch.equal(pos2, pos), key
