"""Decode attention for one new token: H query heads over ONE shared key/value head.

Gemma 4 E2B has 8 query heads and a single KV head, so each cached key and value is read once
for all 8 heads (a GEMV-like pass over the cache, bound by read bandwidth). The cache is cut into
slices, one program per slice, spread across the GPU; each program keeps an online softmax
(running max m, running sum l, unnormalised output o) and writes them for its slice. A second
small kernel combines the slices, one program per (head, 32 columns of head_dim): it loads the
maxima and sums of all slices as one vector, takes the global max and the weights
w_i = exp(m_i - max), then loads the partial outputs as [slices x columns] blocks (up to 256
slices at a time) and sums w_i o_i over the slices axis, divided by sum_i w_i l_i; no
per-slice loop of dependent loads (up to 264 slices on an H200, two per SM). Both kernels read
the current position from a device tensor: nothing depends on a Python integer, so the launch
can live inside a CUDA graph replayed for every token. The number of programs is fixed at
capture; how many cache slots each covers follows the live length, so a short context costs
little even in a graph sized for 131,072 tokens.

Two cache shapes:
* full: slot s holds position s; slots 0..pos are valid (minus a window, if one is given);
* ring (sliding window): R slots, position p in slot p % R; the slot s holds position
  pos - ((pos - s) mod R), valid when >= 0 and within the window.

Two inner loops: `tl.dot` (tensor cores; 8 heads padded to 16 rows) and a multiply-and-sum
without `tl.dot`, picked by compute capability: on a Turing TU117 (no tensor cores) Triton's
16-bit dot ran at 24 GB/s against 65 GB/s for the multiply-and-sum. Triton lowers a 16-bit dot
to tensor-core `mma` only from Ampere (sm_80) on; for Turing and Volta it compiles an FMA loop
staged through shared memory that needs 80-96 KB per program at these tiles (compiled here for
sm_75), more than a T4's 64 KB: those cards take the multiply-and-sum
(tests/kernels/test_kernels_attention.py compiles both for each target and checks).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs

# The combine: BLOCK_D head_dim columns per program (8 heads x 256 / 32 = 64 programs) and at
# most COMBINE_TILE fp32 partial outputs in registers at a time (64 a thread at 4 warps), so up
# to 256 slices go in one block. Measured on an H200 (8 heads, D 256, 264 slices, CUDA graph):
# 2.8 us a call against 35 us for the former one-slice-at-a-time loop; BLOCK_D 64 with 64-slice
# blocks took 6 us (each dependent block adds its load latency).
COMBINE_BLOCK_D = 32
COMBINE_TILE = 8192


@triton.jit
def _span(pos, S, window, RING: tl.constexpr):
    """First and one-past-last cache slot that can hold a visible key."""
    if RING:
        lo = pos * 0
        hi = tl.minimum(pos + 1, S)
    else:
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        hi = tl.minimum(pos + 1, S)
    return lo, hi


@triton.jit
def _my_slice(pos_ptr, S, window, BLOCK_S: tl.constexpr, RING: tl.constexpr):
    """(position, first slot, one past the last slot) of this program's slice of the live
    range (the position is filled by the host before the step)."""
    pos = tl.load(pos_ptr).to(tl.int32)
    lo, hi = _span(pos, S, window, RING)
    chunk = tl.cdiv(tl.cdiv(hi - lo, tl.num_programs(0)), BLOCK_S) * BLOCK_S
    start = lo + tl.program_id(0) * chunk
    return pos, start, tl.minimum(start + chunk, hi)


@triton.jit
def tile_scores(q, k, valid, scale, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
                 SC_DT: tl.constexpr):  # fmt: skip
    """Scores of q [HP, D] against one tile of keys [BLOCK_S, D]: -inf where not `valid`."""
    if USE_DOT and IEEE:  # fp32 caches: full-precision products, not tf32
        sc = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32)
    elif USE_DOT:
        sc = tl.dot(q, tl.trans(k)).to(tl.float32)
    else:
        sc = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    # the reference multiplies q and k in the activation dtype: its scores are rounded there
    sc = sc.to(SC_DT).to(tl.float32)
    return tl.where(valid[None, :], sc * scale, float("-inf"))


@triton.jit
def softmax_update(sc, m, l_sum):
    """One tile into the online softmax: (new max, rescale of the old terms, probabilities,
    new sum)."""
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    return m_new, alpha, p, l_sum * alpha + tl.sum(p, axis=1)


@triton.jit
def tile_values(p, v, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """p [HP, BLOCK_S] @ v [BLOCK_S, D] in fp32."""
    if USE_DOT and IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
    elif USE_DOT:
        pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return pv


@triton.jit
def _split_slice(
    q, k_ptr, v_ptr, kpos_ptr, po_ptr, pm_ptr, pl_ptr, pos, start, end, S, window, scale,
    stride_ks, stride_vs, pid, rh, rd, h_mask,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    RING: tl.constexpr, USE_DOT: tl.constexpr, HAS_KPOS: tl.constexpr, SC_DT: tl.constexpr,
):  # fmt: skip
    """Online softmax of q [HP, D] over cache slots [start, end); stores the slice's max, sum
    and unnormalised output (nothing when the slice is empty)."""
    IEEE: tl.constexpr = k_ptr.dtype.element_ty == tl.float32
    m = tl.full([HP], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([HP], dtype=tl.float32)
    acc = tl.zeros([HP, D], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        inb = rs < end
        valid = inb
        if HAS_KPOS:  # the cache records each slot's position (-1 = empty): trust it
            slot_pos = tl.load(kpos_ptr + rs, mask=inb, other=-1).to(tl.int32)
            valid = valid & (slot_pos >= 0) & (slot_pos <= pos)
            valid = valid & ((window <= 0) | (pos - slot_pos < window))
        elif RING:
            slot_pos = pos - ((pos - rs + S) % S)
            valid = valid & (slot_pos >= 0) & ((window <= 0) | (pos - slot_pos < window))
        # keys are read under the bounds mask only, not the validity one: their load then
        # need not wait for the slot positions (one dependent load fewer, which is what a
        # short context pays for); an invalid slot's score is -inf whatever its key holds.
        # Values keep the validity mask: zeroing them after the load instead would move the
        # dot's operand through registers (measured 6-16% slower at 32k-131k slots)
        k = tl.load(k_ptr + rs[:, None].to(tl.int64) * stride_ks + rd[None, :],
                    mask=inb[:, None], other=0.0)  # fmt: skip
        sc = tile_scores(q, k, valid, scale, USE_DOT, IEEE, SC_DT)
        m_new, alpha, p, l_sum = softmax_update(sc, m, l_sum)
        v = tl.load(v_ptr + rs[:, None].to(tl.int64) * stride_vs + rd[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tile_values(p, v, USE_DOT, IEEE)
        m = m_new
    # a slice past the live range (a short context in a graph sized for a long one) stores
    # nothing: the combine reads only the slices that got work
    base = pid * H + rh
    out_mask = h_mask & (start < end)
    tl.store(pm_ptr + base, m, mask=out_mask)
    tl.store(pl_ptr + base, l_sum, mask=out_mask)
    tl.store(po_ptr + base[:, None] * D + rd[None, :], acc, mask=out_mask[:, None])


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, kpos_ptr, po_ptr, pm_ptr, pl_ptr,
    S, window, scale, stride_qh, stride_ks, stride_vs,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    RING: tl.constexpr, USE_DOT: tl.constexpr, HAS_KPOS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_inputs(PDL)
    pid = tl.program_id(0)
    pos, start, end = _my_slice(pos_ptr, S, window, BLOCK_S, RING)

    rh = tl.arange(0, HP)
    rd = tl.arange(0, D)
    h_mask = rh < H
    q = tl.load(q_ptr + rh[:, None] * stride_qh + rd[None, :], mask=h_mask[:, None], other=0.0)
    _split_slice(q, k_ptr, v_ptr, kpos_ptr, po_ptr, pm_ptr, pl_ptr, pos, start, end, S, window,
                 scale, stride_ks, stride_vs, pid, rh, rd, h_mask, H, HP, D, BLOCK_S, RING,
                 USE_DOT, HAS_KPOS, q_ptr.dtype.element_ty)  # fmt: skip


@triton.jit
def combine_slices(po_ptr, pm_ptr, pl_ptr, row0, used, h, rd, H: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                    CHUNK_P: tl.constexpr):  # fmt: skip
    """Head h's output columns rd from the `used` slices whose partial results start at slice
    row0: sum_i w_i o_i / sum_i w_i l_i, w_i = exp(m_i - max_j m_j), fp32."""
    # every slice's max and sum at once; slices past `used` (no work this step) are -inf / 0
    rp = tl.arange(0, BLOCK_P)
    p_mask = rp < used
    m_all = tl.load(pm_ptr + (row0 + rp) * H + h, mask=p_mask, other=float("-inf"))
    l_all = tl.load(pl_ptr + (row0 + rp) * H + h, mask=p_mask, other=0.0)
    m_max = tl.max(m_all, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # no visible key at all: weights 0
    w_all = tl.where(m_all == float("-inf"), 0.0, tl.exp(m_all - m_safe))
    l_tot = tl.sum(w_all * l_all, axis=0)
    # the weighted sum of the partial outputs: [slices, BLOCK_D] blocks summed over the slices
    # axis, at most CHUNK_P x BLOCK_D fp32 in registers at a time
    if CHUNK_P >= BLOCK_P:  # every slice in one block: reuse the weights above
        o_all = tl.load(po_ptr + ((row0 + rp)[:, None] * H + h) * D + rd[None, :],
                        mask=p_mask[:, None], other=0.0)  # fmt: skip
        acc = tl.sum(w_all[:, None] * o_all, axis=0)
    else:  # CHUNK_P slices a step, each step's weights recomputed from its maxima
        rc = tl.arange(0, CHUNK_P)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for p0 in range(0, used, CHUNK_P):
            ri = p0 + rc
            c_mask = ri < used
            m_c = tl.load(pm_ptr + (row0 + ri) * H + h, mask=c_mask, other=float("-inf"))
            w_c = tl.where(m_c == float("-inf"), 0.0, tl.exp(m_c - m_safe))
            o_c = tl.load(po_ptr + ((row0 + ri)[:, None] * H + h) * D + rd[None, :],
                          mask=c_mask[:, None], other=0.0)  # fmt: skip
            acc += tl.sum(w_c[:, None] * o_c, axis=0)
    return acc / tl.where(l_tot > 0, l_tot, 1.0)


@triton.jit
def _attn_combine_kernel(
    po_ptr, pm_ptr, pl_ptr, pos_ptr, o_ptr, S, window, P, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr, CHUNK_P: tl.constexpr, RING: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One program per (head, BLOCK_D columns): out = sum_i w_i o_i / sum_i w_i l_i, with
    w_i = exp(m_i - max_j m_j) over the `used` slices that got work (fp32 throughout).

    The maxima and sums of all slices come in one vector load of BLOCK_P (>= P) lanes; the
    partial outputs in blocks of CHUNK_P slices x BLOCK_D columns, weighted and summed over
    the slices axis. No dependent scalar load per slice: a handful of wide loads in all.
    """
    wait_inputs(PDL)
    h = tl.program_id(0)
    pid_d = tl.program_id(1)
    pos = tl.load(pos_ptr).to(tl.int32)
    lo, hi = _span(pos, S, window, RING)
    chunk = tl.cdiv(tl.cdiv(hi - lo, P), BLOCK_S) * BLOCK_S
    used = tl.cdiv(hi - lo, chunk)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    out = combine_slices(po_ptr, pm_ptr, pl_ptr, 0, used, h, rd, H, D, BLOCK_D, BLOCK_P,
                          CHUNK_P)  # fmt: skip
    tl.store(o_ptr + h * stride_oh + rd, out.to(o_ptr.dtype.element_ty))


@functools.cache
def use_tensor_core_dot(device_index: int) -> bool:
    """tl.dot for this GPU? See `dot_for_capability`."""
    return dot_for_capability(torch.cuda.get_device_capability(device_index))


def dot_for_capability(capability: tuple[int, int]) -> bool:
    """tl.dot only where Triton turns it into tensor-core instructions: sm_80 and newer. On
    Volta and Turing (a T4, a GTX 16xx) it would be an FMA loop through more shared memory than
    a Turing block may use; the multiply-and-sum is both faster and fits there."""
    return capability[0] >= 8


def split_tiling(head_dim: int, num_heads: int, use_dot: bool) -> tuple[int, int, int]:
    """(BLOCK_S cache slots per step, heads padded to, warps) of the split kernel."""
    if use_dot:  # the dot wants 16 rows: the 8 query heads padded
        return (64 if head_dim <= 256 else 32), max(16, triton.next_power_of_2(num_heads)), 4
    return (8 if head_dim <= 256 else 4), triton.next_power_of_2(num_heads), 8


def default_splits(slots: int, device: torch.device) -> int:
    """Programs per cache: about two per SM for a long cache, fewer for a short ring."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    return max(1, min(2 * sms, triton.cdiv(slots, 64)))


class DecodeAttention:
    """Scratch buffers for one cache shape, allocated once so a CUDA graph can replay them."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        slots: int,
        device: torch.device,
        *,
        ring: bool,
        window: int = 0,
        scale: float = 1.0,
        splits: int | None = None,
        use_dot: bool | None = None,
        block_s: int | None = None,
    ) -> None:
        if head_dim & (head_dim - 1):
            raise ValueError(f"head_dim {head_dim} must be a power of two")
        self.num_heads, self.head_dim, self.slots = num_heads, head_dim, slots
        self.ring, self.window, self.scale = ring, int(window), float(scale)
        self.splits = splits or default_splits(slots, device)
        if use_dot is None:
            use_dot = device.type == "cuda" and use_tensor_core_dot(device.index or 0)
        self.use_dot = use_dot
        default_block_s, self.heads_padded, self.num_warps = split_tiling(head_dim, num_heads,
                                                                          use_dot)  # fmt: skip
        self.block_s = block_s or default_block_s
        self.partial_o = torch.empty(self.splits, num_heads, head_dim, device=device,
                                     dtype=torch.float32)  # fmt: skip
        self.partial_m = torch.empty(self.splits, num_heads, device=device, dtype=torch.float32)
        self.partial_l = torch.empty(self.splits, num_heads, device=device, dtype=torch.float32)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: torch.Tensor,
        out: torch.Tensor | None = None,
        slot_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [H, D] (or [1, H, D]); caches [slots, D] (row stride free); pos: int tensor [1].

        `slot_pos` (optional, int [slots], -1 = empty) is the position each slot holds; without
        it the slot of a position is the position itself (full) or position % slots (ring).
        """
        h, d = self.num_heads, self.head_dim
        q2 = q.reshape(h, d)
        if q2.stride(-1) != 1:
            q2 = q2.contiguous()
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("cache rows must be contiguous along head_dim")
        if out is None:
            out = torch.empty(h, d, device=q.device, dtype=q.dtype)
        o2 = out.view(h, d)
        num_warps = self.num_warps
        run_kernel(_attn_split_kernel, (self.splits,),
            q2, k_cache, v_cache, pos, slot_pos if slot_pos is not None else pos,
            self.partial_o, self.partial_m, self.partial_l,
            self.slots, self.window, self.scale, q2.stride(0), k_cache.stride(0),
            v_cache.stride(0),
            H=h, HP=self.heads_padded, D=d, BLOCK_S=self.block_s, RING=self.ring,
            USE_DOT=self.use_dot, HAS_KPOS=slot_pos is not None, num_warps=num_warps,
            num_stages=2,
        )  # fmt: skip
        self._combine(pos, o2)
        return out.view(q.shape)

    def _combine(self, pos: torch.Tensor, o2: torch.Tensor) -> None:
        h, d = self.num_heads, self.head_dim
        block_d = min(d, COMBINE_BLOCK_D)
        block_p = triton.next_power_of_2(self.splits)
        run_kernel(_attn_combine_kernel, (h, d // block_d),
            self.partial_o, self.partial_m, self.partial_l, pos, o2, self.slots, self.window,
            self.splits, o2.stride(0),
            H=h, D=d, BLOCK_D=block_d, BLOCK_S=self.block_s, BLOCK_P=block_p,
            CHUNK_P=min(block_p, COMBINE_TILE // block_d), RING=self.ring, num_warps=4,
        )  # fmt: skip


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    *,
    ring: bool,
    window: int = 0,
    scale: float = 1.0,
) -> torch.Tensor:
    """PyTorch ground truth: the same visibility rules, softmax in fp32, one KV head."""
    slots = k_cache.shape[0]
    s = torch.arange(slots, device=k_cache.device)
    if ring:
        slot_pos = pos - ((pos - s) % slots)
        valid = (slot_pos >= 0) & (s < min(pos + 1, slots))
        if window > 0:
            valid &= (pos - slot_pos) < window
    else:
        valid = s <= pos
        if window > 0:
            valid &= s > pos - window
    h, d = q.shape[-2], q.shape[-1]
    qf = q.reshape(h, d).float()
    scores = (qf @ k_cache.float().T) * scale
    scores = scores.masked_fill(~valid[None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v_cache.float()).to(q.dtype).view(q.shape)
