"""A batch decode step's attention made straight from the q|k|v product's output: each split
program of the paged kernel (engine/kernels/attention_paged.py) norms and rotates its row's
query itself, and the program whose slice holds the new key norms, rotates and writes that key
and value into the pool. One launch per layer instead of two (no `qkv_rope_rows` before the
split), and, what matters more under programmatic dependent launch (engine/kernels/pdl.py):
everything the split needs except this step's q|k|v row is read BEFORE the wait, while the
q|k|v product still runs:

* the row's position, sequence slot and block-table entry (the host wrote them before the
  replay), its cos / sin row and the rows it writes in the pool (made at the start of the step,
  many launches back), the norm weights;
* its first tile of keys from the pool (values are read after the scores, as the split kernel
  reads them). The one pool row this step writes (the new key's) may be stale there; after the
  wait the program makes the new key and value in registers and puts them into every tile in
  place of that row, so the tile equals the pool after the write without reading it back.

After the wait a program's dependent chain is one trip to memory (the q|k|v row) and its
arithmetic, where the two kernels had a trip each, a launch between them, and the split's own
position -> block table -> key chain. (v4 measured the fused launch alone, without PDL, equal
to the two: bench/NOTES.md.)

Every value is rounded where `qkv_rope_rows` rounds it, so the query, key and value equal that
kernel's up to the order of a norm's fp32 sum, and the attention equals the split kernel's on
them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_decode import softmax_update, tile_scores, tile_values
from engine.kernels.attention_paged import PagedDecodeAttention, row_chunk, tile_rows
from engine.kernels.fused import round_to
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs


@triton.jit
def _norm_rope_heads(x, xp, w, wp, cos, sin, sign, D: tl.constexpr, eps, DT: tl.constexpr):
    """Heads x [rows, D] (xp: x at each lane's NeoX partner) normed with the weights w (wp at
    the partner lanes), then rotated; rounded as fused._norm_rope rounds one head."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    xn = round_to(x * inv[:, None] * w[None, :], DT)
    xpn = round_to(xp * inv[:, None] * wp[None, :], DT)
    rot = round_to(sign[None, :] * xpn * sin[None, :], DT)
    return round_to(round_to(xn * cos[None, :], DT) + rot, DT)


@triton.jit
def _attend_tile(q, k, v_ptr, rows, valid, m, l_sum, acc, scale, stride_vs, rd, new_row, v_new,
                 OWN_KV: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
                 SC_DT: tl.constexpr):  # fmt: skip
    """One tile into the online softmax (m, l_sum, acc): its keys given, its values read after
    the scores (as the split kernel reads them: the load's latency hides behind the softmax),
    the new row's value in place of the pool's (OWN_KV)."""
    sc = tile_scores(q, k, valid, scale, USE_DOT, IEEE, SC_DT)
    m_new, alpha, p, l_sum = softmax_update(sc, m, l_sum)
    v = tl.load(v_ptr + rows[:, None] * stride_vs + rd[None, :], mask=valid[:, None], other=0.0)
    if OWN_KV:
        v = tl.where((rows == new_row)[:, None], v_new, v)
    acc = acc * alpha[:, None] + tile_values(p, v, USE_DOT, IEEE)
    return m_new, l_sum, acc


@triton.jit
def _rope_split_kernel(
    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, new_ptr, k_ptr, v_ptr, pos_ptr, seq_ptr, bt_ptr,
    po_ptr, pm_ptr, pl_ptr, R, window, max_keys, scale, eps, stride_qkv, stride_ks, stride_vs,
    stride_bt,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_KV: tl.constexpr, RING: tl.constexpr, USE_DOT: tl.constexpr, OWN_KV: tl.constexpr,
    V_FROM_K: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (split, row): the row's q from its q|k|v output, then the paged split kernel's
    online softmax over its slice; OWN_KV: the new key/value made and written by the program
    whose slice holds it (new_ptr: the pool row of each batch row's new key)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    P = tl.num_programs(0)
    DT: tl.constexpr = qkv_ptr.dtype.element_ty
    IEEE: tl.constexpr = k_ptr.dtype.element_ty == tl.float32
    # before the wait: what the host wrote, what earlier kernels made, the first tile
    pos = tl.load(pos_ptr + b).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    lo, lo_tile, hi, chunk = row_chunk(pos, R, window, max_keys, P, BLOCK_S, RING)
    start = lo_tile + pid * chunk
    end = tl.minimum(start + chunk, hi)
    rd = tl.arange(0, D)
    partner = (rd + D // 2) % D
    sign = tl.where(rd < D // 2, -1.0, 1.0)
    cos = tl.load(cos_ptr + b * D + rd).to(tl.float32)
    sin = tl.load(sin_ptr + b * D + rd).to(tl.float32)
    wq = tl.load(qn_ptr + rd).to(tl.float32)
    wqp = tl.load(qn_ptr + partner).to(tl.float32)
    rows, inb, valid = tile_rows(start, pos, seq, lo, end, R, window, bt_ptr, stride_bt, BLOCK_S,
                                 BLOCK_KV, RING)  # fmt: skip
    k = tl.load(k_ptr + rows[:, None] * stride_ks + rd[None, :], mask=inb[:, None], other=0.0)
    new_row = tl.load(new_ptr + b).to(tl.int64) if OWN_KV else -1
    if OWN_KV:
        wk = tl.load(kn_ptr + rd).to(tl.float32)
        wkp = tl.load(kn_ptr + partner).to(tl.float32)
    wait_inputs(PDL)
    # after it: this step's q|k|v row (the product just before wrote it)
    row = qkv_ptr + b.to(tl.int64) * stride_qkv
    rh = tl.arange(0, HP)
    h_mask = rh < H
    x = tl.load(row + rh[:, None] * D + rd[None, :], mask=h_mask[:, None], other=0.0)
    xp = tl.load(row + rh[:, None] * D + partner[None, :], mask=h_mask[:, None], other=0.0)
    q = _norm_rope_heads(x.to(tl.float32), xp.to(tl.float32), wq, wqp, cos, sin, sign, D, eps,
                         DT).to(DT)  # fmt: skip
    if OWN_KV:
        kx = tl.load(row + H * D + rd[None, :]).to(tl.float32)
        kxp = tl.load(row + H * D + partner[None, :]).to(tl.float32)
        k_new = _norm_rope_heads(kx, kxp, wk, wkp, cos, sin, sign, D, eps, DT)
        k_new = k_new.to(k_ptr.dtype.element_ty)
        if V_FROM_K:  # noqa: SIM108 - a constexpr branch
            vx = kx
        else:
            vx = tl.load(row + (H + 1) * D + rd[None, :]).to(tl.float32)
        v_inv = 1.0 / tl.sqrt(tl.sum(vx * vx, axis=1) / D + eps)
        v_new = round_to(vx * v_inv[:, None], DT).to(v_ptr.dtype.element_ty)
        if RING:  # noqa: SIM108 - a constexpr branch (R is 0 for a paged layer)
            new_at = pos % R
        else:
            new_at = pos
        mine = (start <= new_at) & (new_at < end)  # exactly one program of a live row
        tl.store(k_ptr + new_row * stride_ks + rd[None, :], k_new, mask=mine & (rd[None, :] < D))
        tl.store(v_ptr + new_row * stride_vs + rd[None, :], v_new, mask=mine & (rd[None, :] < D))
        k = tl.where((rows == new_row)[:, None], k_new, k)
    else:
        v_new = 0.0
    m = tl.full([HP], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([HP], dtype=tl.float32)
    acc = tl.zeros([HP, D], dtype=tl.float32)
    # the first tile (read before the wait; all masked when the slice is empty: the softmax
    # then keeps m = -inf, l = 0, acc = 0), then the rest as the split kernel reads them
    m, l_sum, acc = _attend_tile(q, k, v_ptr, rows, valid, m, l_sum, acc, scale, stride_vs, rd,
                                 new_row, v_new, OWN_KV, USE_DOT, IEEE, DT)  # fmt: skip
    for s0 in range(start + BLOCK_S, end, BLOCK_S):
        rows, inb, valid = tile_rows(s0, pos, seq, lo, end, R, window, bt_ptr, stride_bt,
                                     BLOCK_S, BLOCK_KV, RING)  # fmt: skip
        k = tl.load(k_ptr + rows[:, None] * stride_ks + rd[None, :], mask=inb[:, None],
                    other=0.0)  # fmt: skip
        if OWN_KV:  # a ring's new slot may lie in any tile of the slice
            k = tl.where((rows == new_row)[:, None], k_new, k)
        m, l_sum, acc = _attend_tile(q, k, v_ptr, rows, valid, m, l_sum, acc, scale, stride_vs,
                                     rd, new_row, v_new, OWN_KV, USE_DOT, IEEE, DT)  # fmt: skip
    base = (b * P + pid) * H + rh
    out_mask = h_mask & (start < end)
    tl.store(pm_ptr + base, m, mask=out_mask)
    tl.store(pl_ptr + base, l_sum, mask=out_mask)
    tl.store(po_ptr + base[:, None] * D + rd[None, :], acc, mask=out_mask[:, None])


def rope_tiling(att: PagedDecodeAttention) -> tuple[int, int]:
    """(keys per tile, warps) of the one-launch kernel. With tl.dot it holds a head row's
    fp32 norm and rotation beside the first key tile, so it takes smaller tiles than the split
    kernel: Triton's ptxas for sm_90 spills nothing at 16 keys x 256 / 4 warps and at
    32 keys x 512 / 8 warps (tests/kernels/test_kernels_attention_rope.py)."""
    if not att.use_dot:
        return att.block_s, att.num_warps
    return (16, 4) if att.head_dim <= 256 else (32, 8)


def rope_attention(
    att: PagedDecodeAttention,
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    seq_slots: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    new_rows: torch.Tensor | None = None,
    v_from_k: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention [B, H, D] of B decode rows from their q|k|v product output qkv [B, width]
    (rows may be strided): q normed with q_norm and rotated by cos / sin [B, D]; with new_rows
    (int [B]: the pool row of each row's new key, `KVPool.write_rows`) the layer owns its
    cache, and each row's key (normed with k_norm, rotated) and value (normed) are written
    there first, exactly as `qkv_rope_rows(..., kv_out=...)` writes them. Without it (a layer
    reading another's cache) qkv holds the queries alone. Pools, positions, slots and tables
    as `PagedDecodeAttention.__call__` takes them."""
    h, d = att.num_heads, att.head_dim
    b = qkv.shape[0]
    own = new_rows is not None
    width = (h + (0 if not own else 1 if v_from_k else 2)) * d
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"rope_attention: qkv must be [B, {width}] with contiguous rows, "
                         f"got {tuple(qkv.shape)}")  # fmt: skip
    if not 1 <= b <= att.max_batch:
        raise ValueError(f"batch {b} outside 1..{att.max_batch} (max_batch)")
    if cos.shape != (b, d) or sin.shape != (b, d) or not (cos.is_contiguous()
                                                          and sin.is_contiguous()):  # fmt: skip
        raise ValueError(f"rope_attention: cos / sin must be contiguous [{b}, {d}]")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("pool rows must be contiguous along head_dim")
    if own and (k_norm is None or not k_pool.dtype == v_pool.dtype == qkv.dtype):
        raise ValueError("rope_attention: writing the cache takes k_norm and pools in qkv's "
                         "dtype")  # fmt: skip
    bt, stride_bt, max_keys = att.table_args(positions, block_tables)
    if out is None:
        out = torch.empty(b, h, d, device=qkv.device, dtype=qkv.dtype)
    o3 = att.output_view(out)
    block_s, warps = rope_tiling(att)
    run_kernel(_rope_split_kernel, (att.splits, b),
        qkv, q_norm, k_norm if k_norm is not None else q_norm, cos, sin, new_rows if own else positions,
        k_pool, v_pool, positions, seq_slots, bt, att.partial_o, att.partial_m, att.partial_l,
        att.ring_slots, att.window, max_keys, att.scale, eps, qkv.stride(0), k_pool.stride(0),
        v_pool.stride(0), stride_bt,
        H=h, HP=att.heads_padded, D=d, BLOCK_S=block_s, BLOCK_KV=att.block_size,
        RING=att.ring, USE_DOT=att.use_dot, OWN_KV=own, V_FROM_K=v_from_k,
        num_warps=warps, num_stages=att.num_stages,
    )  # fmt: skip
    att.combine(positions, o3, b, max_keys, block_s)
    return out
