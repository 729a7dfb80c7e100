"""Decode attention (one KV head, split cache, online softmax) against the PyTorch reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import attention_decode
from engine.kernels.attention_decode import DecodeAttention, decode_attention_reference

CASES = [
    # ring, slots, window, head_dim, use_dot, dtype
    (False, 300, 0, 64, True, torch.float32),
    (False, 300, 0, 64, False, torch.float32),
    (False, 200, 50, 32, True, torch.float32),
    (True, 64, 64, 32, True, torch.float16),
    (True, 64, 48, 32, False, torch.float32),
    (True, 64, 64, 64, False, torch.bfloat16),
]
# 16-bit: the kernel rounds scores to the activation dtype, as the engine's reference does
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(("ring", "slots", "window", "dim", "use_dot", "dtype"), CASES)
def test_decode_attention_matches_reference(device, ring, slots, window, dim, use_dot, dtype):
    if use_dot and dtype == torch.float32 and device.type == "cuda":
        pytest.skip("fp32 on the GPU: covered by the fp32 fast-path tests; 16-bit cases here")
    rng = random.Random()
    att = DecodeAttention(8, dim, slots, device, ring=ring, window=window, scale=0.8,
                          splits=rng.choice([1, 3, 5]), use_dot=use_dot,
                          block_s=16 if use_dot else 4)  # fmt: skip
    k = torch.randn(slots, dim, device=device).to(dtype)
    v = torch.randn(slots, dim, device=device).to(dtype)
    last = 3 * slots if ring else slots - 1
    positions = [0, 1, rng.randrange(2, slots - 1), slots - 1, rng.randrange(0, last + 1), last]
    for pos in positions:
        q = torch.randn(8, dim, device=device).to(dtype)
        out = torch.full((8, dim), float("nan"), device=device, dtype=dtype)
        got = att(q, k, v, torch.tensor([pos], dtype=torch.int32, device=device), out=out)
        want = decode_attention_reference(q.double(), k.double(), v.double(), pos, ring=ring,
                                          window=window, scale=0.8)  # fmt: skip
        assert not torch.isnan(got).any(), pos
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < TOL[dtype], (pos, err)


MANY_SPLITS = [
    # ring, slots, window, head_dim, splits, use_dot, block_s, dtype, combine tile, positions
    # 37 splits (not a power of two), all used at the end; few used at a short position
    (False, 290, 0, 64, 37, False, 4, torch.float32, None, [0, 3, 20, 150, 289]),
    # 150 splits in one [256 x 32] block; head_dim 128: four programs a head
    (False, 600, 0, 128, 150, False, 4, torch.float32, None, [0, 30, 333, 599]),
    # a smaller tile: 150 partial outputs in three blocks of 64 slices (more than 256 splits
    # do that with the default tile), 30 in one
    (False, 600, 0, 128, 150, False, 4, torch.float32, 2048, [0, 30, 120, 599]),
    (False, 600, 0, 32, 150, True, 16, torch.float16, None, [1, 100, 599]),
    (True, 296, 200, 32, 37, False, 4, torch.float16, None, [5, 200, 295, 700, 887]),
    (True, 296, 200, 32, 37, False, 4, torch.float16, 256, [5, 200, 295, 700, 887]),
]


@pytest.mark.parametrize(
    ("ring", "slots", "window", "dim", "splits", "use_dot", "block_s", "dtype", "tile",
     "positions"),
    MANY_SPLITS,
)  # fmt: skip
def test_combine_of_many_splits(
    device, monkeypatch, ring, slots, window, dim, splits, use_dot, block_s, dtype, tile, positions
):
    if tile is not None:
        monkeypatch.setattr(attention_decode, "COMBINE_TILE", tile)
    torch.manual_seed(slots * 1000 + splits)  # the same data every run
    att = DecodeAttention(8, dim, slots, device, ring=ring, window=window, scale=0.8,
                          splits=splits, use_dot=use_dot, block_s=block_s)  # fmt: skip
    k = torch.randn(slots, dim, device=device).to(dtype)
    v = torch.randn(slots, dim, device=device).to(dtype)
    for pos in positions:
        q = (2 * torch.randn(8, dim, device=device)).to(dtype)  # spread maxima across slices
        out = torch.full((8, dim), float("nan"), device=device, dtype=dtype)
        got = att(q, k, v, torch.tensor([pos], dtype=torch.int32, device=device), out=out)
        want = decode_attention_reference(q.double(), k.double(), v.double(), pos, ring=ring,
                                          window=window, scale=0.8)  # fmt: skip
        assert not torch.isnan(got).any(), pos
        err = ((got.double() - want).norm() / want.norm()).item()
        # 16-bit: the kernel rounds the scores (|score| up to ~10 here) to the cache dtype as
        # the model's 16-bit bmm does: ~2^-11 * 10 in the exponent, ~5e-3 in the output
        assert err < (TOL[dtype] if dtype == torch.float32 else 1e-2), (pos, err)


def test_combine_skips_slices_without_visible_keys(device) -> None:
    # slot_pos marks whole slices empty (-1): their partial max is -inf, their weight 0
    slots, dim, splits = 96, 32, 12
    att = DecodeAttention(8, dim, slots, device, ring=False, splits=splits, use_dot=False,
                          block_s=4)  # fmt: skip
    k = torch.randn(slots, dim, device=device)
    v = torch.randn(slots, dim, device=device)
    q = torch.randn(8, dim, device=device)
    pos = torch.tensor([slots - 1], dtype=torch.int32, device=device)
    slot_pos = torch.arange(slots, dtype=torch.int32, device=device)
    keep = torch.zeros(slots, dtype=torch.bool, device=device)
    keep[8:16] = True  # one slice of 8 slots out of 12
    keep[40:44] = True  # half of another
    keep[95] = True
    got = att(q, k, v, pos, slot_pos=torch.where(keep, slot_pos, -1))
    n = int(keep.sum())
    want = decode_attention_reference(q.double(), k[keep].double(), v[keep].double(), n - 1,
                                      ring=False)  # fmt: skip
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    # no visible key at all: every partial is empty and the output is 0, not NaN
    out = torch.full((8, dim), float("nan"), device=device)
    got = att(q, k, v, pos, out=out, slot_pos=torch.full_like(slot_pos, -1))
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("use_dot", [False, True])
def test_empty_slots_holding_nan_do_not_leak(device, interpreted, use_dot) -> None:
    """Keys are read under the bounds mask only: slots the cache marks empty (-1) may hold
    anything a fresh allocation holds, NaN included, and must still count for nothing."""
    if use_dot and interpreted:
        pytest.skip("tl.dot of 16-bit tiles: covered on the GPU")
    dtype = torch.bfloat16 if use_dot else torch.float32
    slots, dim = 64, 32
    att = DecodeAttention(8, dim, slots, device, ring=False, splits=4, use_dot=use_dot,
                          block_s=16 if use_dot else 4)  # fmt: skip
    k = torch.randn(slots, dim, device=device).to(dtype)
    v = torch.randn(slots, dim, device=device).to(dtype)
    q = (torch.randn(8, dim, device=device) * 0.2).to(dtype)
    keep = torch.zeros(slots, dtype=torch.bool, device=device)
    keep[:20] = True
    keep[33] = True
    k[~keep] = float("nan")
    v[~keep] = float("nan")
    slot_pos = torch.where(keep, torch.arange(slots, device=device), -1).to(torch.int32)
    got = att(q, k, v, torch.tensor([slots - 1], device=device), slot_pos=slot_pos)
    assert torch.isfinite(got).all()
    want = decode_attention_reference(q.double(), k[keep].double(), v[keep].double(),
                                      int(keep.sum()) - 1, ring=False)  # fmt: skip
    assert ((got.double() - want).norm() / want.norm()).item() < (1e-2 if use_dot else 1e-5)


def test_cache_rows_may_be_strided(device) -> None:
    # a [slots, kv_heads=1, 2, D] layout: keys and values interleaved in one buffer
    slots, dim = 40, 32
    kv = torch.randn(slots, 2, dim, device=device)
    att = DecodeAttention(8, dim, slots, device, ring=False, splits=2, use_dot=False, block_s=4)
    q = torch.randn(1, 8, dim, device=device)
    pos = torch.tensor([29], device=device)
    got = att(q, kv[:, 0], kv[:, 1], pos)
    want = decode_attention_reference(q.double(), kv[:, 0].double(), kv[:, 1].double(), 29,
                                      ring=False)  # fmt: skip
    assert got.shape == (1, 8, dim)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_head_dim_must_be_power_of_two(device) -> None:
    with pytest.raises(ValueError, match="power of two"):
        DecodeAttention(8, 96, 16, device, ring=False)


# per-block shared memory a kernel may use (opt-in maximum): T4 / A100 / RTX 30xx / H100
_SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}


def test_the_split_kernel_chosen_for_each_gpu_fits_it_and_uses_its_tensor_cores() -> None:
    """Compiled for each target as DecodeAttention configures it there: it must fit the
    target's shared memory (Triton's dot on Turing is an FMA loop needing ~96 KB, more than a
    T4 block has), and where the dot is chosen it must become tensor-core mma."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("_compile_for_target.py")
    proc = subprocess.run([sys.executable, str(script), *map(str, _SMEM_LIMIT)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * len(_SMEM_LIMIT)
    for row in rows:
        assert row["shared"] <= _SMEM_LIMIT[row["sm"]], row
        assert row["use_dot"] == (row["sm"] >= 80), row
        if row["use_dot"]:
            assert row["mma"], row
