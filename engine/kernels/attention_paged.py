"""Decode attention for a BATCH of sequences of different lengths, their keys and values read
through block tables (a paged KV cache) or per-sequence rings; one new token per sequence.

The same design as the single-sequence kernel (engine/kernels/attention_decode.py), one more grid
axis: program (split i, batch row b) takes the i-th of `splits` slices of row b's live range,
keeps an online softmax over it (H query heads against the one KV head, each key and value
read once for all heads) and stores its max, sum and unnormalised output; a combine kernel,
one program per (head, 32 columns, row), merges a row's slices with one vector load of their
maxima and sums and a blocked weighted sum of the partial outputs. Row b's query position and
sequence slot come from device tensors, so nothing depends on a Python integer that changes per
step: the launch lives in a CUDA graph per batch size, its program count fixed at construction
(`splits` per row x rows); how many keys each program covers follows that row's live length, so
a short row costs little beside a long one, and programs past a row's end store nothing.

Two pool layouts (one KV head per layer, as in Gemma 4 E2B):
* paged (full-attention layers): k_pool / v_pool [num_blocks * block_size, D]; position p of
  the sequence in slot j lives in row block_tables[j, p // block_size] * block_size
  + p % block_size; visible keys are positions 0..pos (minus a window, if given). The slices
  start on multiples of BLOCK_S, so when block_size >= BLOCK_S a tile lies inside one block and
  its block id is one scalar load; a smaller block size gathers the id of every key of the tile
  with one vector load of the table row.
* ring (sliding layers): R rows per sequence slot, k_pool / v_pool [num_seq_slots * R, D]; slot
  j's ring is rows j*R .. j*R + R - 1, position p in row j*R + p % R; ring slot s holds position
  pos - ((pos - s) mod R), visible when >= 0 and within the window (as the single-sequence ring).

Stale data in a reused block or ring is never read as a visible key: only positions <= pos of
the row's own sequence are visible, and that sequence wrote all of them. A row whose position is
negative sees no key and gets zeros (a cheap padding row for a CUDA-graph batch bucket).

Scores are rounded to the activation dtype before the softmax, as the single-sequence kernel
and the engine's reference do, so a row's result matches that kernel on the row's gathered
cache. Both inner loops of that kernel: `tl.dot` from sm_80, the multiply-and-sum before
(`dot_for_capability`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_decode import (
    COMBINE_BLOCK_D,
    COMBINE_TILE,
    combine_slices,
    softmax_update,
    split_tiling,
    tile_scores,
    tile_values,
    use_tensor_core_dot,
)
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs


@triton.jit
def _row_chunk(pos, R, window, max_keys, P, BLOCK_S: tl.constexpr, RING: tl.constexpr):
    """(first visible key, first tile start, one past the last key, keys per slice) of a row.

    The tiles start on multiples of BLOCK_S (so a tile never straddles a block of BLOCK_S or
    more keys); `chunk` is a multiple of BLOCK_S and at least one tile, so a row without keys
    (hi == lo) has zero slices in use rather than a division by zero."""
    if RING:
        lo = pos * 0
        hi = tl.minimum(pos + 1, R)
    else:
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        hi = tl.minimum(pos + 1, max_keys)
    hi = tl.maximum(hi, lo)
    lo_tile = (lo // BLOCK_S) * BLOCK_S
    chunk = tl.maximum(tl.cdiv(tl.cdiv(hi - lo_tile, P), BLOCK_S), 1) * BLOCK_S
    return lo, lo_tile, hi, chunk


@triton.jit
def _tile_rows(s0, pos, seq, lo, end, R, window, bt_ptr, stride_bt, BLOCK_S: tl.constexpr,
              BLOCK_KV: tl.constexpr, RING: tl.constexpr):  # fmt: skip
    """The pool rows of the tile of BLOCK_S keys at s0, which of them lie in the slice (inb:
    keys are read under it) and which are visible (values are read under it). A tile at or
    past `end` reads no table entry."""
    rs = s0 + tl.arange(0, BLOCK_S)
    if RING:
        inb = rs < end
        slot_pos = pos - ((pos - rs + R) % R)
        valid = inb & (slot_pos >= 0) & ((window <= 0) | (pos - slot_pos < window))
        rows = seq * R + rs
    else:
        # keys before the window's start are masked out of every load, the table's too:
        # a block that the window left behind may have been freed and its id be stale
        inb = (rs < end) & (rs >= lo)
        valid = inb
        if BLOCK_S <= BLOCK_KV:  # the tile lies inside one block: one scalar id
            blk = tl.load(bt_ptr + seq * stride_bt + s0 // BLOCK_KV, mask=s0 < end,
                          other=0).to(tl.int64)  # fmt: skip
        else:  # the id of each key's block, one vector load of the table row
            blk = tl.load(bt_ptr + seq * stride_bt + rs // BLOCK_KV, mask=inb,
                          other=0).to(tl.int64)  # fmt: skip
        rows = blk * BLOCK_KV + rs % BLOCK_KV
    return rows, inb, valid


@triton.jit
def _paged_split_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, seq_ptr, bt_ptr, po_ptr, pm_ptr, pl_ptr,
    R, window, max_keys, scale, stride_qb, stride_qh, stride_ks, stride_vs, stride_bt,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_KV: tl.constexpr, RING: tl.constexpr, USE_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (split, row): online softmax of the row's q [HP, D] over its slice of keys.
    The row's position, slot and slice come before the wait (the host wrote them)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    P = tl.num_programs(0)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    lo, lo_tile, hi, chunk = _row_chunk(pos, R, window, max_keys, P, BLOCK_S, RING)
    start = lo_tile + pid * chunk
    end = tl.minimum(start + chunk, hi)
    wait_inputs(PDL)

    rh = tl.arange(0, HP)
    rd = tl.arange(0, D)
    h_mask = rh < H
    q = tl.load(q_ptr + b * stride_qb + rh[:, None] * stride_qh + rd[None, :],
                mask=h_mask[:, None], other=0.0)  # fmt: skip
    SC_DT: tl.constexpr = q_ptr.dtype.element_ty
    IEEE: tl.constexpr = k_ptr.dtype.element_ty == tl.float32
    m = tl.full([HP], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([HP], dtype=tl.float32)
    acc = tl.zeros([HP, D], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        rows, inb, valid = _tile_rows(s0, pos, seq, lo, end, R, window, bt_ptr, stride_bt,
                                     BLOCK_S, BLOCK_KV, RING)  # fmt: skip
        # keys under the bounds mask only (an invalid ring slot's score is -inf whatever its
        # key holds); values under the validity mask, as in the single-sequence kernel
        k = tl.load(k_ptr + rows[:, None] * stride_ks + rd[None, :], mask=inb[:, None],
                    other=0.0)  # fmt: skip
        sc = tile_scores(q, k, valid, scale, USE_DOT, IEEE, SC_DT)
        m_new, alpha, p, l_sum = softmax_update(sc, m, l_sum)
        v = tl.load(v_ptr + rows[:, None] * stride_vs + rd[None, :], mask=valid[:, None],
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tile_values(p, v, USE_DOT, IEEE)
        m = m_new
    # a slice past the row's live range stores nothing: the combine reads only used slices
    base = (b * P + pid) * H + rh
    out_mask = h_mask & (start < end)
    tl.store(pm_ptr + base, m, mask=out_mask)
    tl.store(pl_ptr + base, l_sum, mask=out_mask)
    tl.store(po_ptr + base[:, None] * D + rd[None, :], acc, mask=out_mask[:, None])


@triton.jit
def _paged_combine_kernel(
    po_ptr, pm_ptr, pl_ptr, pos_ptr, o_ptr, R, window, max_keys, P, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr, CHUNK_P: tl.constexpr, RING: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (head, BLOCK_D columns, row): out = sum_i w_i o_i / sum_i w_i l_i over the row's
    used slices, w_i = exp(m_i - max_j m_j); fp32 throughout (see attention_decode's combine).
    The row's position and slice count come before the wait (the host wrote the position)."""
    h = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    lo, lo_tile, hi, chunk = _row_chunk(pos, R, window, max_keys, P, BLOCK_S, RING)
    used = tl.cdiv(hi - lo_tile, chunk)
    wait_inputs(PDL)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    out = combine_slices(po_ptr, pm_ptr, pl_ptr, b * P, used, h, rd, H, D, BLOCK_D, BLOCK_P,
                          CHUNK_P)  # fmt: skip
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rd, out.to(o_ptr.dtype.element_ty))


def default_paged_splits(max_batch: int, keys: int, device: torch.device,
                         slice_keys: int = 64) -> int:  # fmt: skip
    """Slices per row: about two programs per SM over a full batch, at least one, and no more
    than one per `slice_keys` keys of the longest row (`keys`: the max context, or the ring
    size)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if (
        device.type == "cuda") else 4  # fmt: skip
    return max(1, min(2 * sms // max(1, max_batch), triton.cdiv(keys, slice_keys)))


def ring_block_s(max_batch: int) -> int:
    """Keys per tile (and per slice: a ring of R slots gets R / this slices, within the
    split default's two programs per SM) of a ring layer's split kernel with tl.dot. A ring
    holds at most its window (512 on E2B), so a slice is one tile: 16 keys for one or two
    rows, 32 above. Shorter slices start more programs on a short ring, and ptxas spills
    nothing at these tiles where the 64-key tile spills (measured: lab/journal.md v21)."""
    return 16 if max_batch <= 2 else 32


def _is_pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


class PagedDecodeAttention:
    """Scratch buffers for one layer kind and batch bound, allocated once so a CUDA graph can
    replay the launch. The grid is (splits, B) with B = the call's batch (<= max_batch)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        max_batch: int,
        max_context: int,
        device: torch.device | str,
        *,
        ring: bool,
        ring_slots: int = 0,
        window: int = 0,
        block_size: int = 16,
        scale: float = 1.0,
        splits: int | None = None,
        use_dot: bool | None = None,
        block_s: int | None = None,
    ) -> None:
        device = torch.device(device)
        if not _is_pow2(head_dim):
            raise ValueError(f"head_dim {head_dim} must be a power of two")
        if not ring and not _is_pow2(block_size):
            raise ValueError(f"block_size {block_size} must be a power of two (>= 1)")
        if ring and ring_slots < 1:
            raise ValueError("a ring layer needs ring_slots >= 1 (the ring's rows per sequence)")
        if max_batch < 1 or max_context < 1:
            raise ValueError("max_batch and max_context must be >= 1")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.max_batch, self.max_context = max_batch, max_context
        self.ring, self.ring_slots, self.window = ring, int(ring_slots), int(window)
        self.block_size, self.scale = int(block_size), float(scale)
        if use_dot is None:
            use_dot = device.type == "cuda" and use_tensor_core_dot(device.index or 0)
        self.use_dot = use_dot
        default_block_s, self.heads_padded, self.num_warps = split_tiling(head_dim, num_heads,
                                                                          use_dot)  # fmt: skip
        slice_keys = 64
        if ring and use_dot and block_s is None:
            default_block_s = slice_keys = ring_block_s(max_batch)
        self.block_s = block_s or default_block_s
        self.num_stages = 2  # the single-sequence kernel's; a bench may try others
        if not _is_pow2(self.block_s) or (use_dot and self.block_s < 16):
            raise ValueError(f"block_s {self.block_s}: a power of two, >= 16 with tl.dot")
        keys = min(self.ring_slots, max_context) if ring else max_context
        self.splits = splits or default_paged_splits(max_batch, keys, device, slice_keys)
        shape = (max_batch, self.splits, num_heads)
        self.partial_o = torch.empty(*shape, head_dim, device=device, dtype=torch.float32)
        self.partial_m = torch.empty(shape, device=device, dtype=torch.float32)
        self.partial_l = torch.empty(shape, device=device, dtype=torch.float32)

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        positions: torch.Tensor,
        seq_slots: torch.Tensor,
        block_tables: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        batch: int | None = None,
    ) -> torch.Tensor:
        """q [B', H, D] (rows 0..batch-1 used; batch defaults to B'); pools [rows, D], row
        stride free; positions int [>= batch] (negative: the row sees nothing, gets zeros);
        seq_slots int [>= batch]; block_tables int32 [seq slots, max blocks] (paged layers).
        Returns out [batch, H, D] in q's dtype (`out` filled when given)."""
        h, d = self.num_heads, self.head_dim
        b = q.shape[0] if batch is None else int(batch)
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"batch {b} outside 1..{self.max_batch} (max_batch)")
        if q.dim() != 3 or q.shape[1:] != (h, d) or q.shape[0] < b:
            raise ValueError(f"q must be [>= {b}, {h}, {d}], got {tuple(q.shape)}")
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
            raise ValueError("pool rows must be contiguous along head_dim")
        if self.ring:
            bt, stride_bt, max_keys = positions, 0, 0  # the table is not read
        else:
            if block_tables is None:
                raise ValueError("a paged (non-ring) layer needs block_tables")
            bt, stride_bt = block_tables, block_tables.stride(0)
            max_keys = block_tables.shape[1] * self.block_size
        if out is None:
            out = torch.empty(b, h, d, device=q.device, dtype=q.dtype)
        o3 = out.view(-1, h, d)
        if o3.stride(-1) != 1:
            raise ValueError("out must be contiguous along head_dim")
        run_kernel(_paged_split_kernel, (self.splits, b),
            q, k_pool, v_pool, positions, seq_slots, bt,
            self.partial_o, self.partial_m, self.partial_l,
            self.ring_slots, self.window, max_keys, self.scale, q.stride(0), q.stride(1),
            k_pool.stride(0), v_pool.stride(0), stride_bt,
            H=h, HP=self.heads_padded, D=d, BLOCK_S=self.block_s, BLOCK_KV=self.block_size,
            RING=self.ring, USE_DOT=self.use_dot, num_warps=self.num_warps,
            num_stages=self.num_stages,
        )  # fmt: skip
        block_d = min(d, COMBINE_BLOCK_D)
        block_p = triton.next_power_of_2(self.splits)
        run_kernel(_paged_combine_kernel, (h, d // block_d, b),
            self.partial_o, self.partial_m, self.partial_l, positions, o3, self.ring_slots,
            self.window, max_keys, self.splits, o3.stride(0), o3.stride(1),
            H=h, D=d, BLOCK_D=block_d, BLOCK_S=self.block_s, BLOCK_P=block_p,
            CHUNK_P=min(block_p, COMBINE_TILE // block_d), RING=self.ring, num_warps=4,
        )  # fmt: skip
        return out


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    seq_slots: torch.Tensor,
    block_tables: torch.Tensor | None,
    *,
    ring: bool,
    ring_slots: int = 0,
    window: int = 0,
    block_size: int = 16,
    scale: float = 1.0,
) -> torch.Tensor:
    """PyTorch ground truth, one row at a time: gather the row's visible keys and values by
    the layout rules above, softmax in fp32 (fp64 for fp64 inputs). [B, H, D] in q's dtype."""
    ct = torch.promote_types(q.dtype, torch.float32)
    outs = []
    for b in range(q.shape[0]):
        pos, seq = int(positions[b]), int(seq_slots[b])
        if ring:
            s = torch.arange(ring_slots, device=k_pool.device)
            slot_pos = pos - ((pos - s) % ring_slots)
            keep = (slot_pos >= 0) & (slot_pos <= pos)
            if window > 0:
                keep &= (pos - slot_pos) < window
            rows = seq * ring_slots + s[keep]
        else:
            p = torch.arange(max(pos + 1, 0), device=k_pool.device)
            if window > 0:
                p = p[p > pos - window]
            blk = block_tables[seq].long()[p // block_size]
            rows = blk * block_size + p % block_size
        if rows.numel() == 0:
            outs.append(torch.zeros(q.shape[1:], device=q.device, dtype=q.dtype))
            continue
        k, v = k_pool[rows].to(ct), v_pool[rows].to(ct)
        probs = torch.softmax((q[b].to(ct) @ k.T) * scale, dim=-1)
        outs.append((probs @ v).to(q.dtype))
    return torch.stack(outs)
