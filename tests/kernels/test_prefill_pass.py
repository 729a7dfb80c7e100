"""A prompt pass with every segment's attention and cache writes in one launch per layer
(engine/fast/prefill_attention.py) against the same pass segment by segment, on the real
Triton kernels (the GPU, or the CPU interpreter in CI) and a real pool: fresh prompts,
continuing chunks over a filled prefix and over a ring, a chunk longer than the ring."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.fast.prefill_attention import PassAttention
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
