"""The decode step's tail (engine/kernels/greedy_tail.py): the logits soft-capped in place as
PyTorch's `tanh(logits / cap) * cap` makes them, and each row's greedy id the first index of
its largest capped value, across chunk and block edges, for one row and many."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.greedy_tail import BLOCK, _chunks, cap_and_pick

CAP = 30.0


def _torch_tail(raw: torch.Tensor) -> torch.Tensor:
    return torch.tanh(raw / CAP) * CAP


@pytest.mark.parametrize(("rows", "vocab"), [(1, 512), (3, 5000), (5, 70001)])
def test_fp32_caps_as_pytorch_and_picks_the_first_largest(device, rows, vocab) -> None:
    gen = torch.Generator().manual_seed(rows)
    raw = (torch.randn(rows, vocab, generator=gen) * 40).to(device)
    got = raw.clone()
    ids = torch.full((rows,), -1, dtype=torch.int64, device=device)
    assert cap_and_pick(got, CAP, ids) is got
    # libdevice's tanh on the GPU; the interpreter's exp-built one within a few units
    torch.testing.assert_close(got, _torch_tail(raw), rtol=4e-7, atol=4e-6)
    assert torch.equal(ids, got.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_round_as_pytorch(device, interpreted, dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    raw = (torch.randn(4, 9000, generator=gen) * 40).to(dtype).to(device)
    got = raw.clone()
    ids = torch.empty(4, dtype=torch.int64, device=device)
    cap_and_pick(got, CAP, ids)
    want = _torch_tail(raw)
    if interpreted:  # numpy's casts to 16 bits truncate: a unit or three at the cap's scale
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.4)
    else:  # the same rounding at every op, so the same values and the same ties
        assert torch.equal(got, want)
        assert torch.equal(ids, want.argmax(dim=-1))
    assert torch.equal(ids, got.argmax(dim=-1))  # ties among rounded values: the first


def test_ties_across_chunks_go_to_the_first_index(device) -> None:
    rows, vocab = 3, 9 * BLOCK + 17  # several chunks per row, a ragged last block
    chunks, iters = _chunks(rows, vocab)
    assert chunks > 2
    logits = torch.zeros(rows, vocab, device=device)
    last = vocab - 1
    span = iters * BLOCK  # a chunk
    logits[0, [5, span + 3, last]] = 2.0  # the first chunk's wins
    logits[1, [span + 1, span + 2, 2 * span + 9]] = 2.0  # a later chunk, its first
    logits[2, last] = 1.0  # only the ragged end
    ids = torch.empty(rows, dtype=torch.int64, device=device)
    cap_and_pick(logits, None, ids)  # no cap: the logits stay as they are
    assert ids.tolist() == [5, span + 1, last]
    assert logits[0, 5] == 2.0


def test_no_cap_leaves_the_logits_and_still_picks(device) -> None:
    raw = torch.randn(2, 3000, generator=torch.Generator().manual_seed(1)).to(device)
    got = raw.clone()
    ids = torch.empty(2, dtype=torch.int64, device=device)
    cap_and_pick(got, 0.0, ids)
    assert torch.equal(got, raw)
    assert torch.equal(ids, raw.argmax(dim=-1))


def test_cap_without_ids(device) -> None:
    raw = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2)).to(device) * 50
    got = cap_and_pick(raw.clone(), CAP, None)
    torch.testing.assert_close(got, _torch_tail(raw), rtol=4e-7, atol=4e-6)


def test_chunks_cover_the_vocabulary_with_few_programs() -> None:
    for rows in (1, 2, 8, 16, 64):
        for vocab in (512, 2049, 262144):
            chunks, iters = _chunks(rows, vocab)
            blocks = -(-vocab // BLOCK)
            assert chunks * iters >= blocks > (chunks - 1) * iters  # every block, no empty chunk
            assert rows * chunks <= max(256, rows)


def test_bad_arguments_are_refused(device) -> None:
    logits = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="contiguous rows"):
        cap_and_pick(logits.t(), CAP, None)
    with pytest.raises(ValueError, match="int64"):
        cap_and_pick(logits, CAP, torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="int64"):
        cap_and_pick(logits, CAP, torch.zeros(3, dtype=torch.int64, device=device))
