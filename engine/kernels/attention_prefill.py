"""Attention of a prompt pass: every sequence's chunk in one launch per layer, flash-style.

Why: a pass that reads several prompts at once (the scheduler packs up to its token budget)
used to attend segment by segment with plain PyTorch ops: concatenate the cache and the chunk,
score, mask, softmax, multiply, for every segment of every KV-producing layer, about twenty
launches each. At eight 512-token prompts that was over a thousand launches per pass, each
costing the host more than the GPU spends on it (lab/journal.md, v15). Here one program owns
BLOCK_M query rows of one segment and one query head, walks the keys that segment can see with
an online softmax and writes its rows; no scores reach memory.

Each segment sees two key sources, read in place:
* its cache (what earlier chunks left): rows of the pool's layer tensors named by `cache_rows`
  (a full layer's filled prefix through the block table; a sliding layer's ring), their
  positions read from the pool's position tensor, so a ring's stale or empty slots mask
  themselves as in the reference (-1 = empty; only positions <= the query's and inside the
  window are visible);
* its own chunk's keys, rows cu_q[b] .. cu_q[b+1] of `k` / `v` with the queries' positions,
  walked only as far as causality and the window allow.

Same function as `engine.ops._attend` on each segment's concatenated keys: scores rounded to
the activation dtype, softmax in fp32, probabilities in the activation dtype for the value
product (as the decode kernels, whose helpers it shares). Normalisation happens after the value
product, so results agree to rounding, not bit for bit. tl.dot only: sm_80 and newer (see
`attention_decode.dot_for_capability`); older GPUs keep the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_decode import softmax_update, tile_scores, tile_values
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs


@triton.jit
def _keys_into(
    q, qp, m, l_sum, acc, k_ptr, v_ptr, rows_ptr, kpos_ptr, n0, n1, window, stride_k, stride_v,
    kvh, stride_kh, stride_vh, rd, D: tl.constexpr, BLOCK_N: tl.constexpr,
    INDIRECT: tl.constexpr, WINDOW: tl.constexpr, SC_DT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Keys n0..n1-1 of one source into the online softmax of q [BLOCK_M, D] (positions qp).
    INDIRECT: key j is row rows_ptr[j] of the tensors (the cache); else row j (the chunk)."""
    for s0 in range(n0, n1, BLOCK_N):
        rn = s0 + tl.arange(0, BLOCK_N)
        live = rn < n1
        if INDIRECT:  # noqa: SIM108 (a constexpr branch of the kernel)
            rows = tl.load(rows_ptr + rn, mask=live, other=0)
        else:
            rows = rn
        kp = tl.load(kpos_ptr + rows, mask=live, other=-1)
        k = tl.load(k_ptr + rows[:, None] * stride_k + kvh * stride_kh + rd[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        visible = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
        if WINDOW:
            visible = visible & (kp[None, :] > qp[:, None] - window)
        sc = tile_scores(q, k, live, 1.0, True, IEEE, SC_DT)
        sc = tl.where(visible, sc, float("-inf"))
        m, alpha, p, l_sum = softmax_update(sc, m, l_sum)
        v = tl.load(v_ptr + rows[:, None] * stride_v + kvh * stride_vh + rd[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tile_values(p, v, True, IEEE)
    return m, l_sum, acc


@triton.jit(do_not_specialize=["segments"])  # one compile for one segment and for several
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, ck_ptr, cv_ptr, cpos_ptr, crows_ptr, cu_q_ptr, cu_c_ptr,
    out_ptr, window, segments,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckt, stride_ckh, stride_cvt, stride_cvh, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, HAS_CACHE: tl.constexpr, FLAT: tl.constexpr = False,
    SEGS: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (row block, segment, query head): rows of one segment, one head. FLAT: program
    (g, 0, head) takes the g-th row block of the pass, segment after segment (SEGS a power of
    two above `segments`), and programs past the last block do nothing."""
    wait_inputs(PDL)
    h = tl.program_id(2)
    if FLAT:
        g = tl.program_id(0)
        offs = tl.arange(0, SEGS)
        inside = offs < segments
        first_rows = tl.load(cu_q_ptr + offs, mask=inside, other=0)
        end_rows = tl.load(cu_q_ptr + offs + 1, mask=inside, other=0)
        blocks = (end_rows - first_rows + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, 0)
        seg = tl.sum((ends <= g).to(tl.int32), 0)
        first = tl.sum(tl.where(offs == seg, ends - blocks, 0), 0)
        blk = tl.where(seg < segments, g - first, 1 << 24)  # past the last block: no rows
        seg = tl.minimum(seg, segments - 1)
    else:
        blk, seg = tl.program_id(0), tl.program_id(1)
    q0 = tl.load(cu_q_ptr + seg)
    q1 = tl.load(cu_q_ptr + seg + 1)
    m0 = q0 + blk * BLOCK_M
    if m0 < q1:
        kvh = h // GROUP
        SC_DT: tl.constexpr = q_ptr.dtype.element_ty
        IEEE: tl.constexpr = q_ptr.dtype.element_ty == tl.float32
        rm = m0 + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, D)
        live = rm < q1
        qp = tl.load(qpos_ptr + rm, mask=live, other=0)
        q = tl.load(q_ptr + rm[:, None] * stride_qt + h * stride_qh + rd[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        if HAS_CACHE:
            c0 = tl.load(cu_c_ptr + seg)
            c1 = tl.load(cu_c_ptr + seg + 1)
            m, l_sum, acc = _keys_into(
                q, qp, m, l_sum, acc, ck_ptr, cv_ptr, crows_ptr, cpos_ptr, c0, c1, window,
                stride_ckt, stride_cvt, kvh, stride_ckh, stride_cvh, rd, D, BLOCK_N, True,
                WINDOW, SC_DT, IEEE,
            )  # fmt: skip
        hi = tl.minimum(q1, m0 + BLOCK_M)  # causal: no key after the block's last row
        lo = q0
        if WINDOW:  # the block's first row sees nothing at or before m0 - window
            lo = tl.maximum(q0, m0 - window + 1)
            lo = q0 + ((lo - q0) // BLOCK_N) * BLOCK_N  # tiles aligned to the segment
        m, l_sum, acc = _keys_into(
            q, qp, m, l_sum, acc, k_ptr, v_ptr, k_ptr, qpos_ptr, lo, hi, window, stride_kt,
            stride_vt, kvh, stride_kh, stride_vh, rd, D, BLOCK_N, False, WINDOW, SC_DT, IEEE,
        )  # fmt: skip
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        tl.store(out_ptr + rm[:, None] * stride_ot + h * stride_oh + rd[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])  # fmt: skip


def tiling(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M query rows, BLOCK_N keys per step, warps, stages). The query tile and the fp32
    accumulator [BLOCK_M, D] stay in registers, so they set the budget: these are the largest
    tiles that compile without spilling for sm_80, sm_86 and sm_90 (checked by
    tests/kernels/test_kernels_attention_prefill.py with Triton's ptxas; 64 x 64 on 4 warps
    spilled 4.5 KB at D = 256)."""
    if head_dim >= 512:
        return 32, 32, 8, 1
    if head_dim >= 256:
        return 64, 16, 8, 2
    return 64, 64, 4, 2


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    max_rows: int,
    window: int | None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    tiles: tuple[int, int, int, int] | None = None,
    flat: bool = False,
) -> torch.Tensor:
    """Attention of every segment of a pass: [T, Hq, D].

    q [T, Hq, D]; k / v [T, Hkv, D] the pass's own keys and values (positions q_pos [T],
    int64); cu_q int32 [B+1] the segments' first rows (cu_q[B] = T); max_rows the longest
    segment; window None for a full layer. cache: (k_pool, v_pool, pos_pool, rows, cu_rows), the
    layer's pool tensors [R, Hkv, D] / [R], then int64 rows of them per segment, concatenated,
    and int32 [B+1] their offsets; None when no segment has cached keys. tiles: (BLOCK_M,
    BLOCK_N, warps, stages) instead of `tiling`'s (tests, benchmarks). flat: one program per row
    block of the pass whatever the segments' lengths (a grid of T / BLOCK_M + B row blocks
    instead of max_rows / BLOCK_M x B): for a CUDA graph, whose grid is fixed at capture while
    its segments vary (engine/fast/prefill_graph.py); max_rows is then not read."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if d & (d - 1) or hq % hkv or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"prefill_attention: unsupported shapes q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)} (head width a power of two, rows contiguous)")  # fmt: skip
    out = torch.empty_like(q)
    segments = cu_q.shape[0] - 1
    block_m, block_n, warps, stages = tiles or tiling(d)
    if cache is None:
        ck, cv, cpos, rows, cu_rows = k, v, q_pos, q_pos, cu_q
    else:
        ck, cv, cpos, rows, cu_rows = cache
    if flat:
        grid = (t // block_m + segments, 1, hq)
        flags = {"FLAT": True, "SEGS": triton.next_power_of_2(segments + 1)}
    else:
        grid = (triton.cdiv(max(max_rows, 1), block_m), segments, hq)
        flags = {}
    run_kernel(
        _prefill_attention_kernel, grid, q, k, v, q_pos, ck, cv, cpos, rows, cu_q, cu_rows, out,
        0 if window is None else int(window), segments,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=window is not None,
        HAS_CACHE=cache is not None, num_warps=warps, num_stages=stages, **flags,
    )  # fmt: skip
    return out
