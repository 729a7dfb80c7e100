"""Batched decode attention through block tables / per-sequence rings, against the PyTorch
reference and against the single-sequence kernel on each row's gathered contiguous cache."""

from __future__ import annotations

import importlib
import os
import random

import pytest
import torch
from compile_support import compiled_rows

from engine.kernels import attention_paged
from engine.kernels.attention_decode import DecodeAttention

if os.environ.get("TRITON_INTERPRET") == "1":  # imported before conftest set it: rebuild
    attention_paged = importlib.reload(attention_paged)
PagedDecodeAttention = attention_paged.PagedDecodeAttention
paged_attention_reference = attention_paged.paged_attention_reference

H = 8
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# against the single-sequence kernel: the same rounding of the scores, only the slices (and so
# the fp32 summation order) differ: fp32 to rounding, 16-bit to about one output ulp
SAME = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def paged_pool(num_seqs: int, max_blocks: int, block_size: int, dim: int, dtype, device, seed):
    """A pool with one spare block (the last) and shuffled, non-contiguous block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * max_blocks + 1
    table = torch.randperm(num_blocks - 1, generator=gen)[: num_seqs * max_blocks]
    table = table.view(num_seqs, max_blocks).to(torch.int32).to(device)
    k = torch.randn(num_blocks * block_size, dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_blocks * block_size, dim, generator=gen).to(dtype).to(device)
    return k, v, table


def gathered(pool: torch.Tensor, table_row: torch.Tensor, block_size: int) -> torch.Tensor:
    """A sequence's whole cache as one contiguous [max_blocks * block_size, D] tensor."""
    p = torch.arange(table_row.numel() * block_size, device=pool.device)
    return pool[table_row.long()[p // block_size] * block_size + p % block_size]


PAGED = [
    # rows, block_size, window, use_dot, block_s, splits, dtype
    (5, 4, 0, True, 16, 3, torch.float32),  # blocks smaller than a tile: ids gathered per key
    (3, 16, 0, False, 4, 2, torch.bfloat16),  # a tile inside one block: one id per tile
    (1, 1, 0, False, 4, 4, torch.float32),  # one key per block
    (4, 32, 20, True, 16, 5, torch.float16),  # a window on a paged layer
    (2, 8, 13, False, 8, 3, torch.float32),  # a tile exactly one block
]


@pytest.mark.parametrize(("rows", "bsize", "window", "use_dot", "block_s", "splits", "dtype"),
                         PAGED)  # fmt: skip
def test_paged_rows_match_reference_and_single_sequence_kernel(
    device, rows, bsize, window, use_dot, block_s, splits, dtype
):
    rng = random.Random(rows * 100 + bsize)
    dim, num_seqs = 32, 6
    max_blocks = max(2, 96 // bsize)
    ctx = max_blocks * bsize
    k, v, table = paged_pool(num_seqs, max_blocks, bsize, dim, dtype, device, seed=bsize)
    att = PagedDecodeAttention(H, dim, 5, ctx, device, ring=False, window=window,
                               block_size=bsize, scale=0.8, splits=splits, use_dot=use_dot,
                               block_s=block_s)  # fmt: skip
    # length 1, a block's last and a block's first position, the longest, one anywhere
    pos = [0, 2 * bsize - 1, 2 * bsize, ctx - 1, rng.randrange(ctx)][:rows]
    rng.shuffle(pos)
    seqs = rng.sample(range(num_seqs), rows)  # distinct slots, in any order
    positions = torch.tensor(pos, device=device)
    seq_slots = torch.tensor(seqs, dtype=torch.int32, device=device)
    q = torch.randn(rows, H, dim, device=device).to(dtype)
    out = torch.full((rows, H, dim), float("nan"), device=device, dtype=dtype)
    got = att(q, k, v, positions, seq_slots, table, out=out)
    assert got.shape == (rows, H, dim) and got.dtype == dtype
    assert torch.isfinite(got).all()
    want = paged_attention_reference(q.double(), k.double(), v.double(), positions, seq_slots,
                                     table, ring=False, window=window, block_size=bsize,
                                     scale=0.8)  # fmt: skip
    for b in range(rows):
        assert rel_err(got[b], want[b]) < TOL[dtype], (b, pos[b])
        single = DecodeAttention(H, dim, ctx, device, ring=False, window=window, scale=0.8,
                                 splits=2, use_dot=use_dot, block_s=block_s)  # fmt: skip
        kc, vc = gathered(k, table[seqs[b]], bsize), gathered(v, table[seqs[b]], bsize)
        one = single(q[b], kc, vc, positions[b : b + 1])
        assert rel_err(got[b], one) < SAME[dtype], (b, pos[b])


RING = [
    # rows, ring slots, window, use_dot, block_s, splits, dtype
    (5, 64, 64, True, 16, 3, torch.float32),
    (3, 40, 30, False, 4, 2, torch.bfloat16),  # a window shorter than the ring, R not 2^k
    (2, 64, 64, True, 16, 1, torch.float16),
]


@pytest.mark.parametrize(("rows", "ring", "window", "use_dot", "block_s", "splits", "dtype"),
                         RING)  # fmt: skip
def test_ring_rows_match_reference_and_single_sequence_kernel(
    device, rows, ring, window, use_dot, block_s, splits, dtype
):
    rng = random.Random(rows * 100 + ring)
    dim, num_seqs = 32, 7
    gen = torch.Generator().manual_seed(ring)
    k = torch.randn(num_seqs * ring, dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_seqs * ring, dim, generator=gen).to(dtype).to(device)
    att = PagedDecodeAttention(H, dim, 5, 4096, device, ring=True, ring_slots=ring,
                               window=window, scale=0.8, splits=splits, use_dot=use_dot,
                               block_s=block_s)  # fmt: skip
    # length 1, a ring not yet full, just full, wrapped once, wrapped and somewhere
    pos = [0, ring - 2, ring - 1, 3 * ring + 5, rng.randrange(ring, 10 * ring)][:rows]
    if rows == 2:
        pos = [ring // 2, 2 * ring + 3]
    rng.shuffle(pos)
    seqs = rng.sample(range(num_seqs), rows)
    positions = torch.tensor(pos, device=device)
    seq_slots = torch.tensor(seqs, dtype=torch.int64, device=device)  # int64 slots work too
    q = torch.randn(rows, H, dim, device=device).to(dtype)
    got = att(q, k, v, positions, seq_slots)
    assert torch.isfinite(got).all()
    want = paged_attention_reference(q.double(), k.double(), v.double(), positions, seq_slots,
                                     None, ring=True, ring_slots=ring, window=window,
                                     scale=0.8)  # fmt: skip
    for b in range(rows):
        assert rel_err(got[b], want[b]) < TOL[dtype], (b, pos[b])
        single = DecodeAttention(H, dim, ring, device, ring=True, window=window, scale=0.8,
                                 splits=2, use_dot=use_dot, block_s=block_s)  # fmt: skip
        j = seqs[b]
        one = single(q[b], k[j * ring : (j + 1) * ring], v[j * ring : (j + 1) * ring],
                     positions[b : b + 1])  # fmt: skip
        assert rel_err(got[b], one) < SAME[dtype], (b, pos[b])


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the padding row's own NaN
@pytest.mark.parametrize("ring", [False, True])
def test_padding_row_and_invisible_nan_change_nothing(device, ring) -> None:
    """A padding row pointed at a dummy slot full of NaN leaves the real rows bit-identical;
    a negative position sees nothing and gets zeros; keys no row may see (past a row's
    position, in other slots, outside a ring's window) may hold NaN without leaking."""
    dim, bsize, max_blocks, r_slots = 32, 8, 6, 40
    if ring:
        k = torch.randn(5 * r_slots, dim, device=device)
        v = torch.randn(5 * r_slots, dim, device=device)
        table = None
        att = PagedDecodeAttention(H, dim, 4, 1000, device, ring=True, ring_slots=r_slots,
                                   window=24, splits=3, use_dot=False, block_s=4)  # fmt: skip
        pos = [5, 100, 30]
    else:
        k, v, table = paged_pool(5, max_blocks, bsize, dim, torch.float32, device, seed=3)
        att = PagedDecodeAttention(H, dim, 4, 48, device, ring=False, block_size=bsize,
                                   splits=3, use_dot=False, block_s=4)  # fmt: skip
        pos = [0, 17, 47]
    seqs = [2, 0, 3]
    positions = torch.tensor(pos, device=device)
    seq_slots = torch.tensor(seqs, dtype=torch.int32, device=device)
    q = torch.randn(4, H, dim, device=device)
    want = paged_attention_reference(q[:3], k, v, positions, seq_slots, table, ring=ring,
                                     ring_slots=r_slots, window=24 if ring else 0,
                                     block_size=bsize)  # fmt: skip
    # NaN everywhere no real row may look
    seen = torch.zeros(k.shape[0], dtype=torch.bool, device=device)
    for p, j in zip(pos, seqs, strict=True):
        if ring:
            s = torch.arange(r_slots, device=device)
            sp = p - (p - s) % r_slots
            seen[j * r_slots + s[(sp >= 0) & (p - sp < 24)]] = True
        else:
            t = torch.arange(p + 1, device=device)
            seen[table[j].long()[t // bsize] * bsize + t % bsize] = True
    k[~seen], v[~seen] = float("nan"), float("nan")
    three = att(q[:3], k, v, positions, seq_slots, table).clone()
    assert torch.isfinite(three).all()
    assert rel_err(three, want) < 1e-5
    # a fourth (padding) row on dummy slot 4, whose keys are all NaN: the others unchanged
    positions4 = torch.tensor([*pos, 9], device=device)
    seq_slots4 = torch.tensor([*seqs, 4], dtype=torch.int32, device=device)
    four = att(q, k, v, positions4, seq_slots4, table)
    assert torch.equal(four[:3], three)
    # a negative position reads nothing: zeros, not NaN, and the others unchanged again
    positions4[3] = -1
    four = att(q, k, v, positions4, seq_slots4, table)
    assert torch.equal(four[:3], three)
    assert torch.equal(four[3], torch.zeros_like(four[3]))


def test_batch_argument_uses_leading_rows_of_fixed_buffers(device) -> None:
    # a CUDA-graph bucket's buffers are max_batch long; `batch` picks the live rows
    dim, bsize = 32, 16
    k, v, table = paged_pool(4, 4, bsize, dim, torch.float32, device, seed=5)
    att = PagedDecodeAttention(H, dim, 4, 64, device, ring=False, block_size=bsize, splits=2,
                               use_dot=False, block_s=8)  # fmt: skip
    q = torch.randn(4, H, dim, device=device)
    positions = torch.tensor([63, 4, 99999, 99999], device=device)  # rows 2, 3 never read
    seq_slots = torch.tensor([1, 3, 0, 0], dtype=torch.int32, device=device)
    out = torch.full((4, H, dim), 7.0, device=device)
    got = att(q, k, v, positions, seq_slots, table, out=out, batch=2)
    want = paged_attention_reference(q[:2], k, v, positions[:2], seq_slots[:2], table,
                                     ring=False, block_size=bsize)  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out[:2], want) < 1e-5
    assert torch.equal(out[2:], torch.full_like(out[2:], 7.0))


def test_bad_arguments_are_refused(device) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        PagedDecodeAttention(H, 96, 2, 64, device, ring=False)
    with pytest.raises(ValueError, match="block_size"):
        PagedDecodeAttention(H, 32, 2, 64, device, ring=False, block_size=24)
    with pytest.raises(ValueError, match="ring_slots"):
        PagedDecodeAttention(H, 32, 2, 64, device, ring=True)
    att = PagedDecodeAttention(H, 32, 2, 64, device, ring=False, use_dot=False)
    q = torch.zeros(3, H, 32, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="max_batch"):
        att(q, q[0], q[0], pos, pos, pos.view(3, 1).int())
    with pytest.raises(ValueError, match="block_tables"):
        att(q[:2], q[0], q[0], pos, pos)


def test_default_splits_fill_the_gpu_over_the_batch() -> None:
    cpu = torch.device("cpu")  # the CPU counts as 4 SMs
    assert attention_paged.default_paged_splits(1, 8192, cpu) == 8
    assert attention_paged.default_paged_splits(16, 8192, cpu) == 1
    assert attention_paged.default_paged_splits(1, 100, cpu) == 2
    att = PagedDecodeAttention(H, 32, 3, 512, cpu, ring=True, ring_slots=64, use_dot=False)
    assert att.splits == 1 and att.partial_o.shape == (3, 1, H, 32)


# ---- the GPU at Gemma 4 E2B shapes -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("use_dot", [True, False])
@pytest.mark.parametrize(("ring", "dim"), [(True, 256), (False, 512)])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_e2b_shapes_on_the_gpu(ring, dim, rows, use_dot) -> None:
    dev, dtype, bsize, r_slots = torch.device("cuda"), torch.bfloat16, 16, 512
    rng = random.Random(rows + dim)
    torch.manual_seed(rows + dim)
    ctx = 8192
    num_seqs = 20
    if ring:
        k = torch.randn(num_seqs * r_slots, dim, device=dev).to(dtype)
        v = torch.randn(num_seqs * r_slots, dim, device=dev).to(dtype)
        table = None
    else:
        k, v, table = paged_pool(num_seqs, ctx // bsize, bsize, dim, dtype, dev, seed=rows)
    att = PagedDecodeAttention(H, dim, 16, ctx, dev, ring=ring, ring_slots=r_slots,
                               window=r_slots if ring else 0, block_size=bsize, scale=1.0,
                               use_dot=use_dot)  # fmt: skip
    pos = [0, 15, 16, 511, 512, 4095, ctx - 1] + [rng.randrange(ctx) for _ in range(rows)]
    pos = pos[:rows]
    seqs = rng.sample(range(num_seqs), rows)
    positions = torch.tensor(pos, device=dev)
    seq_slots = torch.tensor(seqs, dtype=torch.int32, device=dev)
    # q scaled as Gemma's q/k norms leave it (scores O(1)); unscaled random q at width 512
    # gives scores ~20 whose bf16 rounding (the reference's, mirrored here) dominates
    q = (torch.randn(rows, H, dim, device=dev) * dim**-0.5).to(dtype)
    got = att(q, k, v, positions, seq_slots, table)
    want = paged_attention_reference(q, k, v, positions, seq_slots, table, ring=ring,
                                     ring_slots=r_slots, window=r_slots if ring else 0,
                                     block_size=bsize)  # fmt: skip
    single = DecodeAttention(H, dim, r_slots if ring else ctx, dev, ring=ring,
                             window=r_slots if ring else 0, use_dot=use_dot)  # fmt: skip
    for b in range(rows):
        err = rel_err(got[b], want[b].float())
        assert err < 3e-2, (b, pos[b], err)  # scores rounded to bf16, as the reference does
        j = seqs[b]
        if ring:
            kc, vc = k[j * r_slots : (j + 1) * r_slots], v[j * r_slots : (j + 1) * r_slots]
        else:
            kc, vc = gathered(k, table[j], bsize), gathered(v, table[j], bsize)
        one = single(q[b], kc, vc, positions[b : b + 1])
        same = rel_err(got[b], one)  # the same rounding: only the fp32 summation order differs
        assert same < 1e-2, (b, pos[b], same)
    # replayed in a CUDA graph with new positions: nothing captured a Python int
    static_pos = positions.clone()
    out = torch.empty_like(got)
    att(q, k, v, static_pos, seq_slots, table, out=out)  # warm (compiled) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        att(q, k, v, static_pos, seq_slots, table, out=out)
    new = torch.tensor([rng.randrange(ctx) for _ in range(rows)], device=dev)
    static_pos.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = paged_attention_reference(q, k, v, new, seq_slots, table, ring=ring,
                                     ring_slots=r_slots, window=r_slots if ring else 0,
                                     block_size=bsize)  # fmt: skip
    assert rel_err(out, want.float()) < 3e-2


# ---- compiled for each GPU generation (Triton's own ptxas, no GPU needed) ----------------

_SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}  # T4, A100, H100/H200


def _compile_for_targets(targets: list[int]) -> None:
    """Print one JSON line per (target, layer kind, block size): the split kernel compiled as
    PagedDecodeAttention configures it on that target. Run as a script (no interpreter)."""
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.attention_decode import dot_for_capability, split_tiling

    for sm in targets:
        use_dot = dot_for_capability((sm // 10, sm % 10))
        for dim, ring, block_kv in ((512, False, 16), (512, False, 64), (256, True, 16)):
            block_s, heads_padded, warps = split_tiling(dim, H, use_dot)
            sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")}
            sig |= {n: "*fp32" for n in ("po_ptr", "pm_ptr", "pl_ptr")}
            sig |= {"pos_ptr": "*i64", "seq_ptr": "*i32", "bt_ptr": "*i32", "scale": "fp32"}
            sig |= {n: "i32" for n in ("R", "window", "max_keys", "stride_qb", "stride_qh",
                                       "stride_ks", "stride_vs", "stride_bt")}  # fmt: skip
            consts = {"H": H, "HP": heads_padded, "D": dim, "BLOCK_S": block_s,
                      "BLOCK_KV": block_kv, "RING": ring, "USE_DOT": use_dot, "PDL": sm >= 90}  # fmt: skip
            sig |= {n: "constexpr" for n in consts}
            compiled = triton.compile(
                ASTSource(fn=attention_paged._paged_split_kernel, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", sm, 32),
                options={"num_warps": warps, "num_stages": 2},
            )
            print(json.dumps({"sm": sm, "dim": dim, "use_dot": use_dot,
                              "shared": compiled.metadata.shared,
                              "mma": "mma" in compiled.asm["ptx"]}), flush=True)  # fmt: skip


def test_split_kernel_fits_each_gpu_and_uses_its_tensor_cores() -> None:
    rows = compiled_rows(__file__, list(_SMEM_LIMIT))
    assert len(rows) == 3 * len(_SMEM_LIMIT)
    for row in rows:
        assert row["shared"] <= _SMEM_LIMIT[row["sm"]], row
        assert row["use_dot"] == (row["sm"] >= 80) == row["mma"], row


def test_ring_layers_take_one_short_tile_a_slice_with_the_tensor_cores() -> None:
    """A ring with tl.dot: 16-key tiles for one or two rows, 32 above, and a slice per tile as
    far as two programs per SM allow (the CPU counts as 4 SMs); paged layers and rings without
    tl.dot keep the split defaults."""
    cpu = torch.device("cpu")
    for rows, tile in ((1, 16), (2, 16), (4, 32), (16, 32)):
        att = PagedDecodeAttention(H, 256, rows, 4096, cpu, ring=True, ring_slots=512,
                                   use_dot=True)  # fmt: skip
        assert att.block_s == tile and att.num_warps == 4
        assert att.splits == max(1, min(8 // rows, 512 // tile))
    assert attention_paged.default_paged_splits(1, 512, cpu, slice_keys=16) == 8
    assert attention_paged.default_paged_splits(1, 48, cpu, slice_keys=16) == 3
    paged = PagedDecodeAttention(H, 512, 1, 4096, cpu, ring=False, use_dot=True)
    assert paged.block_s == 32 and paged.splits == 8
    plain = PagedDecodeAttention(H, 256, 1, 4096, cpu, ring=True, ring_slots=512, use_dot=False)
    assert plain.block_s == 8


if __name__ == "__main__":
    import sys

    _compile_for_targets([int(a) for a in sys.argv[1:]])
