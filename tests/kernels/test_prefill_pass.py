"""A prompt pass with every segment's attention and cache writes in one launch per layer
(engine/fast/prefill_attention.py) against the same pass segment by segment, on the real
Triton kernels (the GPU, or the CPU interpreter in CI) and a real pool: fresh prompts,
continuing chunks over a filled prefix and over a ring, a chunk longer than the ring.

Then the pass as a CUDA graph reads it (engine/fast/prefill_graph.py): fixed buffers, padding
rows, a flat attention grid, write rows computed from the block tables. On the CPU the graph's
body runs eagerly on its fixed buffers and must leave the pool as the plain pass does; on a GPU
the captured graph is replayed and compared the same way."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.fast.prefill_attention import PassAttention
from engine.fast.prefill_graph import PassGraphs, pass_buckets
from engine.options import EngineOptions

CTX = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill_pass") / "tiny"
    make_checkpoint(path, preset="tiny", seed=11)
    return path


def _ids(n: int, salt: int, device) -> torch.Tensor:
    return torch.tensor([2] + [(7 * i + salt) % 300 + 20 for i in range(n - 1)], device=device)


def _read(eng, joint: bool, passes, prompts):
    """Each pass's chunks read into the pool (slots opened and grown as the scheduler would);
    the pool's rows of every layer afterwards, gathered per sequence in position order."""
    pool, reader = eng.pool, eng.runner.reader
    reader.pass_attention = joint
    slots = [pool.blocks.open_slot() for _ in prompts]
    pool.apply(tuple(slots), ())
    done = [0] * len(prompts)
    for chunk in passes:
        segs, grants = [], []
        for seq, n in chunk:
            grants.append(pool.blocks.grow(slots[seq], done[seq] + n))
        pool.apply((), tuple(g for g in grants if g is not None))
        for seq, n in chunk:
            ids = prompts[seq][done[seq] : done[seq] + n]
            segs.append((ids, done[seq], pool.view(slots[seq])))
            done[seq] += n
        reader.chunks(segs)
    out = {}
    for layer in pool.k:
        for s, slot in enumerate(slots):
            lc = pool.view(slot).layers[layer]
            order = torch.argsort(lc.pos)
            order = order[lc.pos[order] >= 0]  # empty slots hold what the last user left
            out[layer, s] = (lc.k[order].clone(), lc.v[order].clone(), lc.pos[order].clone())
    for slot in slots:
        pool.blocks.close_slot(slot)
    return out


def test_one_launch_per_layer_equals_segment_by_segment(checkpoint, device, monkeypatch):
    # the kernel runs 16-bit on a GPU (fp32 keeps the segment path there), fp32 interpreted
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    eng = engine.load(checkpoint, device=device, max_context=CTX, dtype=dtype,
                      options=EngineOptions(fast="force", cuda_graph=False), max_num_seqs=4,
                      warm_up=False)  # fmt: skip
    try:
        assert eng.runner.reader is not None
        window = eng.config.sliding_window
        prompts = [_ids(n, s, eng.model.device) for n, s in ((14, 1), (26, 2), (5, 3))]
        passes = [  # (sequence, tokens) per segment
            [(0, 6), (1, 8)],  # fresh prompts
            [(0, 8), (1, 18), (2, 5)],  # continuing over a prefix and a ring; one fresh
        ]
        assert any(n > window for p in passes for _, n in p)  # a chunk longer than the ring
        used = []
        plan = PassAttention.plan
        with monkeypatch.context() as mp:
            mp.setattr(PassAttention, "plan", lambda *a: used.append(plan(*a)) or used[-1])
            joint = _read(eng, True, passes, prompts)
        assert used and all(p is not None for p in used)  # the pass kernel really ran
        each = _read(eng, False, passes, prompts)
        assert joint.keys() == each.keys()
        if dtype == torch.float32:  # the same sums in the same order: equal to rounding
            for key, (k, v, pos) in joint.items():
                k2, v2, pos2 = each[key]
                assert torch.equal(pos, pos2), key
                torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5, msg=str(key))
                torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5, msg=str(key))
            return
        # 16-bit: the two paths round in different places (online softmax against a full one),
        # and the difference grows layer by layer; each is held to an fp32 reference instead,
        # the pass no further from it than the segment path is (or than bf16's own step).
        ref_eng = engine.load(checkpoint, device=device, max_context=CTX, dtype=torch.float32,
                              options=EngineOptions(fast="force", cuda_graph=False),
                              max_num_seqs=4, warm_up=False)  # fmt: skip
        try:
            ref = _read(ref_eng, False, passes, prompts)
        finally:
            ref_eng.close()
        for key, (k, v, pos) in joint.items():
            k2, v2, pos2 = each[key]
            kr, vr, posr = ref[key]
            assert torch.equal(pos, pos2) and torch.equal(pos, posr), key
            for name, got, seg, want in (("k", k, k2, kr), ("v", v, v2, vr)):
                err = (got.float() - want).abs().max().item()
                seg_err = (seg.float() - want).abs().max().item()
                floor = 1e-2 * max(want.abs().max().item(), 1.0)
                assert err <= max(2 * seg_err, floor), (key, name, err, seg_err, floor)
    finally:
        eng.close()


def test_other_caches_keep_the_segment_path():
    """A cache that is not a view of a pool (the model's own KVCache, say) gets no plan."""
    assert PassAttention.plan([(4, 0, object())], torch.arange(4), torch.float32) is None


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
    """A 16-bit engine on a GPU, fp32 on the CPU interpreter; graphs are captured by hand."""
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


# the bucket's 27 padding rows attend over the padding slot's pool rows, which nothing
# initialises (their writes land in the padding slot alone): the interpreter may overflow there
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
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
