"""The reference forward pass over a batch of rows (engine.model.Gemma4Model.decode_rows and
read_chunks): every row equals the same sequence computed alone.

Why these tests: decode_rows runs B sequences' tokens through one layer body together (B is a
tensor dimension) and gathers each row's keys from the block pool; a wrong block-table lookup,
a mask that lets one sequence see another's rows, or a padding row writing into a live block
would all still give plausible logits. So each test holds the batched result against the
row-by-row reference (`decode_step` over `pool.view(slot)`, the ground truth the fused kernels
are tested against too), on the tiny checkpoint whose sliding window (16) is shorter than some
of the sequences and whose last layers reuse other layers' K/V.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.checkpoint import CheckpointReader
from engine.checkpoint_maker import make_checkpoint
from engine.config import FULL as _F
from engine.config import SLIDING as _S
from engine.config import load_config
from engine.kv_pool import KVPool, plan_geometry
from engine.model import Gemma4Model
from engine.paged_attention_ref import segment

CTX = 128
BLOCK = 8  # small blocks: sequences span several, some of them not consecutive
CASES = {
    "tiny": {},  # layers 4 (sliding) and 5 (full) read layers 2 and 3's K/V
    # three KV-shared layers with double-wide MLPs: 3 and 4 (sliding) read layer 1, 5 reads 2
    "shared3": {"num_kv_shared_layers": 3, "layer_types": [_S, _S, _F, _S, _S, _F]},
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    make_checkpoint(path, preset="tiny", seed=0, overrides=CASES[request.param])
    return path


def _model(path, dtype: torch.dtype = torch.float32) -> Gemma4Model:
    reader = CheckpointReader(path)
    try:
        return Gemma4Model.load(reader, load_config(path), torch.device("cpu"), dtype)
    finally:
        reader.close()


@pytest.fixture(scope="module")
def model(checkpoint):
    m = _model(checkpoint)
    assert m.cfg.first_shared_layer < m.cfg.num_hidden_layers  # KV-shared layers are covered
    return m


def _pool(model: Gemma4Model, max_seqs: int) -> KVPool:
    geo = plan_geometry(model.cfg, model.dtype, CTX, 64 << 20, max_seqs, BLOCK)
    return KVPool(model.cfg, geo, model.device, model.dtype)


def _prompt(n: int, salt: int) -> torch.Tensor:
    return torch.tensor([2] + [(7 * i + salt) % 400 + 10 for i in range(n - 1)])


def _open(pool: KVPool, lengths: list[int], extra: int) -> list[int]:
    """Slots for sequences of these prompt lengths (+ extra positions), each grown one block at
    a time in turn, so that all but the first hold blocks that are not consecutive."""
    slots = [pool.blocks.open_slot() for _ in lengths]
    pool.apply(tuple(slots), ())
    for reach in range(BLOCK, CTX + BLOCK, BLOCK):
        for slot, n in zip(slots, lengths, strict=True):
            _grow(pool, slot, min(reach, n + extra))
    return slots


def _grow(pool: KVPool, slot: int, tokens: int) -> None:
    grant = pool.blocks.grow(slot, tokens)
    if grant is not None:
        pool.apply((), (grant,))


def _read(model, pool, parts, chunk: int) -> None:
    """Every (prompt, slot)'s body (all but its last token), `chunk` tokens per pass, all the
    sequences in each pass."""
    start = 0
    while True:
        batch = [(p[start : min(start + chunk, len(p) - 1)], start, s)
                 for p, s in parts if start < len(p) - 1]  # fmt: skip
        if not batch:
            return
        model.read_chunks(batch, pool)
        start += chunk


def _alone(model, pool, tokens, positions, slots) -> torch.Tensor:
    """The row-by-row reference: each row through decode_step over its sequence's view."""
    return torch.cat(
        [
            type(model).decode_step(
                model, tokens[b : b + 1], positions[b : b + 1], pool.view(int(s))
            )  # fmt: skip
            for b, s in enumerate(slots.tolist())
        ]
    )


def _assert_pools_equal(a: KVPool, b: KVPool, atol: float) -> None:
    for i in a.k:
        assert torch.equal(a.pos[i], b.pos[i]), f"layer {i} positions"
        torch.testing.assert_close(a.k[i], b.k[i], atol=atol, rtol=0)
        torch.testing.assert_close(a.v[i], b.v[i], atol=atol, rtol=0)


LENGTHS = [1, 5, 14, 40]  # one token; inside the window; crossing it while decoding; past it


def test_decode_rows_equal_each_row_alone_with_a_padding_row(model):
    pool = _pool(model, max_seqs=4)
    steps = 8
    slots = _open(pool, LENGTHS, steps)
    prompts = [_prompt(n, salt=n) for n in LENGTHS]
    _read(model, pool, list(zip(prompts, slots, strict=True)), chunk=9)
    ref = copy.deepcopy(pool)
    pad = pool.pad_slot
    # padding rows between live ones, one at a position that shares a padding row with another
    order = [0, None, 1, 2, None, 3]
    row_slots = torch.tensor([pad if j is None else slots[j] for j in order])
    live = [b for b, j in enumerate(order) if j is not None]
    tokens = torch.tensor([0 if j is None else int(prompts[j][-1]) for j in order])
    positions = torch.tensor([0 if j is None else LENGTHS[j] - 1 for j in order])
    positions[4] = BLOCK  # same padding row as row 1's position 0
    for _ in range(steps):
        got = model.decode_rows(tokens, positions, pool, row_slots)
        want = _alone(model, ref, tokens[live], positions[live], row_slots[live])
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[live], want, atol=1e-5, rtol=1e-5)
        tokens = torch.where(row_slots == pad, tokens, got.argmax(-1))
        positions = torch.where(row_slots == pad, positions, positions + 1)
    # the padding rows wrote nothing a live sequence reads: both pools hold the same K/V
    # outside the padding slot's rows (its ring, block 0)
    for i in pool.k:
        keep = torch.ones(pool.k[i].shape[0], dtype=torch.bool)
        if model.cfg.is_sliding(i):
            keep[pad * pool.ring_slots : (pad + 1) * pool.ring_slots] = False
        else:
            keep[:BLOCK] = False
        assert torch.equal(pool.pos[i][keep], ref.pos[i][keep])
        torch.testing.assert_close(pool.k[i][keep], ref.k[i][keep], atol=1e-5, rtol=0)


def _greedy_rows(model, pool, prompts, slots, n: int) -> list[list[int]]:
    """n greedy tokens for every sequence, decoded together from the prompt's last token."""
    tokens = torch.tensor([int(p[-1]) for p in prompts])
    positions = torch.tensor([len(p) - 1 for p in prompts])
    rows = torch.tensor(slots)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        tokens = model.decode_rows(tokens, positions, pool, rows).argmax(-1)
        positions = positions + 1
        for b, t in enumerate(tokens.tolist()):
            out[b].append(t)
    return out


def test_greedy_tokens_of_four_together_equal_each_alone(model):
    n = 24
    prompts = [_prompt(m, salt=3 * m + 1) for m in LENGTHS]
    pool = _pool(model, max_seqs=4)
    slots = _open(pool, LENGTHS, n)
    _read(model, pool, list(zip(prompts, slots, strict=True)), chunk=16)
    together = _greedy_rows(model, pool, prompts, slots, n)
    for p, got in zip(prompts, together, strict=True):
        alone_pool = _pool(model, max_seqs=1)  # a single sequence is a pool of one
        (slot,) = _open(alone_pool, [len(p)], n)
        _read(model, alone_pool, [(p, slot)], chunk=16)
        assert _greedy_rows(model, alone_pool, [p], [slot], n) == [got]


def test_read_chunks_of_three_sequences_equal_one_at_a_time(model):
    lengths = [30, 7, 45]  # chunks of 20 are longer than the ring (16); 7 ends in the first pass
    prompts = [_prompt(m, salt=m) for m in lengths]
    together, apart, ref = (_pool(model, max_seqs=3) for _ in range(3))
    slots = [_open(p, lengths, 1) for p in (together, apart, ref)]
    assert slots[0] == slots[1] == slots[2]
    parts = list(zip(prompts, slots[0], strict=True))
    _read(model, together, parts, chunk=20)
    for part in parts:
        _read(model, apart, [part], chunk=20)
    for p, s in parts:  # the reference single-sequence reading over each view
        for start in range(0, len(p) - 1, 20):
            ids = p[start : min(start + 20, len(p) - 1)]
            model.prefill_chunk(ids, start, ref.view(s), last=False)
    _assert_pools_equal(together, apart, atol=1e-5)
    _assert_pools_equal(together, ref, atol=1e-5)
    # and the sequences decode the same from any of them
    tokens = torch.tensor([int(p[-1]) for p in prompts])
    positions = torch.tensor([len(p) - 1 for p in prompts])
    rows = torch.tensor(slots[0])
    torch.testing.assert_close(
        model.decode_rows(tokens, positions, together, rows),
        _alone(model, ref, tokens, positions, rows),
        atol=1e-5,
        rtol=1e-5,
    )


def test_read_chunks_prefix_is_a_view_when_blocks_are_consecutive(model):
    pool = _pool(model, max_seqs=2)
    a, b = _open(pool, [1, 1], 0)
    _grow(pool, a, 2 * BLOCK)
    assert pool.block_tables[a, :2].tolist() == [1, 3]
    assert isinstance(segment(pool, 0, 4, BLOCK, a).prefix, torch.Tensor)  # 1, 3: gathered
    assert isinstance(segment(pool, 0, 4, BLOCK, b).prefix, slice)  # block 2 alone
    fresh = _pool(model, max_seqs=1)  # a sequence alone in its pool: consecutive blocks
    (s,) = _open(fresh, [5 * BLOCK], 0)
    seg = segment(fresh, 0, 1, 4 * BLOCK + 3, s)
    assert isinstance(seg.prefix, slice) and seg.prefix.stop - seg.prefix.start == 4 * BLOCK + 3


def test_decode_rows_in_bf16_within_rounding_of_each_row_alone(checkpoint):
    model = _model(checkpoint, torch.bfloat16)
    pool = _pool(model, max_seqs=4)
    slots = _open(pool, LENGTHS, 4)
    prompts = [_prompt(n, salt=n) for n in LENGTHS]
    _read(model, pool, list(zip(prompts, slots, strict=True)), chunk=9)
    ref = copy.deepcopy(pool)
    tokens = torch.tensor([int(p[-1]) for p in prompts])
    positions = torch.tensor([n - 1 for n in LENGTHS])
    rows = torch.tensor(slots)
    for _ in range(4):
        got = model.decode_rows(tokens, positions, pool, rows).float()
        want = _alone(model, ref, tokens, positions, rows).float()
        # bf16 logits (soft-capped at 30) differ by the products' summation order only
        torch.testing.assert_close(got, want, atol=0.15, rtol=0.02)
        tokens, positions = want.argmax(-1), positions + 1
