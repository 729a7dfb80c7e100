"""The int4 matrix product for a few activation rows (Triton): Y[M, N] = X[M, K] @ dequant(W).T
with M = 2..16, each packed weight word read ONCE for all M rows.

Here: the kernels, their launch and the default tiling. The Python API is
engine/kernels/w4gemm.py; tile tuning engine/kernels/w4gemm_tune.py.

Layout (as the GEMV, engine/kernels/w4gemv_kernel.py): ``packed`` int32 [N, K/8], element k of
a row in word k//8 at bits 4*(k%8), stored as q+8; ``scales`` [N, K/32].
``w[n, k] = (code - 8) * scales[n, k // 32]``.

Why it is written this way: the GEMV's grid is (N tiles, M), so M rows read the weights M times;
here one program owns BLOCK_N weight rows and ALL the activation rows, so a decode step of 8 or
16 sequences reads the weights once, as one sequence does. Two inner paths:

* TC (sm_80 on): the [BLOCK_N, 8*BLOCK_KW] weight tile is unpacked in registers (the magic
  number 2^23 OR'd with each 4-bit field gives 2^23 + code exactly in fp32), times its group
  scale, rounded to the activations' 16-bit dtype (fp32 activations keep fp32 and an "ieee"
  dot: no tf32) and multiplied on the tensor cores against the activation tile padded to 16
  rows (masked loads), accumulating in fp32.
* FMA (Turing and older: tl.dot there is an FMA loop through too much shared memory): the
  unpacked fp32 tile times every activation row, broadcast over a [rows, BLOCK_N, BLOCK_K]
  accumulator that is summed over K once, at the end.

Split-K (narrow N, long K: N=1536 with K=6144 has few tiles for 132 SMs): program (n, s) sums
its K slice into an fp32 workspace [SPLIT, M, N]; the reduction is deterministic either way:
the last program of an N tile to finish (a ticket counter; no value is ever added atomically)
sums the SPLIT partials in split order and runs the epilogue (FUSED), or a second small kernel
does the same. Nothing is allocated per call: the workspace and the tickets are held per device
(`workspace` below), and every ticket is back at 0 when a launch ends, so a CUDA graph replays it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels.fused import gelu_tanh, round_to
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs
from engine.kernels.w4gemv_kernel import ws_loads  # one K step's words and scales (fp32)
from engine.options import triton_interpreted

KERNEL_NAME = "w4gemm"
KERNEL_VERSION = 1  # bump when the kernel changes: stored tilings of older versions are ignored


@triton.jit
def _dequant(w, s, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """[BN, BKW] words and their group scales (fp32) -> fp32 [BN, 8*BKW] in element order."""
    sh = tl.arange(0, 8) * 4
    c = ((w[:, :, None] >> sh[None, None, :]) & 0xF) | 0x4B000000  # 2^23 + code, as fp32 bits
    v = (c.to(tl.float32, bitcast=True) - 8388616.0) * s[:, :, None]  # (code - 8) * scale
    return tl.reshape(v, [BLOCK_N, BLOCK_KW * 8])


@triton.jit
def _loads(w_ptrs, s_ptrs, x_ptrs, rk, rkk, m_mask, kw0, KW, EVEN_K: tl.constexpr):
    """One K step's words, scales and activations [BM, 8*BKW]."""
    w, s = ws_loads(w_ptrs, s_ptrs, rk, kw0, KW, EVEN_K)
    if EVEN_K:
        x = tl.load(x_ptrs + kw0 * 8, mask=m_mask[:, None], other=0.0)
    else:
        xm = m_mask[:, None] & ((kw0 * 8 + rkk) < KW * 8)[None, :]
        x = tl.load(x_ptrs + kw0 * 8, mask=xm, other=0.0)
    return w, s, x


@triton.jit
def _step(acc, w, s, x, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, TC: tl.constexpr,
          SWAP: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """acc + this K step's products (TC: [BM, BN] or, SWAP, [BN, BM]; FMA: [BM, BN, BK])."""
    v = _dequant(w, s, BLOCK_N, BLOCK_KW)
    if TC:
        acc = _dot_acc(acc, v, x, SWAP, IEEE)
    else:
        acc += v[None, :, :] * x.to(tl.float32)[:, None, :]
    return acc


@triton.jit
def _dot_acc(acc, v, x, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """acc + x v^T (SWAP: v x^T) on tensor cores, the fp32 weights v first rounded to x's
    dtype, as the reference rounds its dequantised weights."""
    v = v.to(x.dtype)
    if IEEE and x.dtype != tl.float32:  # the CPU interpreter's bf16 dot is wrong: the
        v = v.to(tl.float32)  # same products (exact in fp32) through its fp32 dot
        x = x.to(tl.float32)
    if SWAP:  # the weight tile as the dot's A operand (its rows on the wide side)
        if IEEE:
            acc = tl.dot(v, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(v, tl.trans(x), acc)
    else:
        if IEEE:
            acc = tl.dot(x, tl.trans(v), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(v), acc)
    return acc


@triton.jit
def _epilogue(y, rm, m_mask, pid_n, N, y_ptr, stride_ym, aux_ptr, stride_am,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPI: tl.constexpr):  # fmt: skip
    """Store y [BM, BN] (fp32) of rows rm and columns pid_n*BN.. as the GEMV's epilogues do:
    0 plain; 1 GLU over interleaved (gate, up) columns -> [M, N/2]; 2 gelu(y) * aux[m, n].
    Intermediates round to the output's dtype where the reference rounds."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPI == 1:
        g, u = tl.split(tl.reshape(round_to(y, DT), [BLOCK_M, BLOCK_N // 2, 2]))
        act = round_to(round_to(gelu_tanh(g), DT) * u, DT)
        rp = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = m_mask[:, None] & (rp < N // 2)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rp[None, :], act.to(DT), mask=mask)
    elif EPI == 2:
        mask = m_mask[:, None] & (rn < N)[None, :]
        a = tl.load(aux_ptr + rm[:, None] * stride_am + rn[None, :], mask=mask, other=0.0)
        out = round_to(round_to(gelu_tanh(round_to(y, DT)), DT) * a.to(tl.float32), DT)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(DT), mask=mask)
    else:
        mask = m_mask[:, None] & (rn < N)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(DT), mask=mask)


@triton.jit
def _sum_partials(ws_ptr, rm, m_mask, rn, M, N, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """The SPLIT fp32 partials of one tile, summed in split order (deterministic). .cg: read
    from L2, where the other programs' stores are, never a stale L1 line of an earlier call."""
    mask = m_mask[:, None] & (rn < N)[None, :]
    offs = rm[:, None] * N + rn[None, :]
    y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        y += tl.load(ws_ptr + i * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def _w4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, tk_ptr, aux_ptr,
    M, N, KW, G, stride_xm, stride_ym, stride_am, chunk_kw,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    EVEN_K: tl.constexpr, TC: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, EPI: tl.constexpr, PIPE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (n, s): rows pid_n*BLOCK_N.. of the weight over K words [s*chunk_kw, +chunk_kw)
    against all M activation rows. SPLIT == 1: the epilogue straight away; else the partial
    goes to the workspace and (FUSED) the tile's last program reduces it."""
    wait_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_KW)
    rkk = tl.arange(0, BLOCK_KW * 8)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rn_safe = tl.where(rn < N, rn, 0).to(tl.int64)
    w_ptrs = w_ptr + rn_safe[:, None] * KW + rk[None, :]
    s_ptrs = s_ptr + rn_safe[:, None] * G + rk[None, :] // 4
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rkk[None, :]
    k0 = pid_k * chunk_kw
    k1 = tl.minimum(k0 + chunk_kw, KW)
    if TC:
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_KW * 8], dtype=tl.float32)
    w, s, x = _loads(w_ptrs, s_ptrs, x_ptrs, rk, rkk, m_mask, k0, KW, EVEN_K)
    for kn in range(k0 + BLOCK_KW, k1, BLOCK_KW):  # kn: the NEXT step's first word
        # PIPE: the next step's operands are requested before this step's arithmetic (a
        # software pipeline in registers, as in the GEMV); else after it
        if PIPE:
            nw, ns, nx = _loads(w_ptrs, s_ptrs, x_ptrs, rk, rkk, m_mask, kn, KW, EVEN_K)
            acc = _step(acc, w, s, x, BLOCK_N, BLOCK_KW, TC, SWAP, IEEE)
        else:
            acc = _step(acc, w, s, x, BLOCK_N, BLOCK_KW, TC, SWAP, IEEE)
            nw, ns, nx = _loads(w_ptrs, s_ptrs, x_ptrs, rk, rkk, m_mask, kn, KW, EVEN_K)
        w, s, x = nw, ns, nx
    acc = _step(acc, w, s, x, BLOCK_N, BLOCK_KW, TC, SWAP, IEEE)
    if TC:  # noqa: SIM108 - constexpr branches
        y = tl.trans(acc) if SWAP else acc
    else:
        y = tl.sum(acc, axis=2)
    _finish(y, rm, m_mask, rn, pid_n, pid_k, M, N, y_ptr, stride_ym, ws_ptr, tk_ptr, aux_ptr,
            stride_am, BLOCK_M, BLOCK_N, SPLIT, FUSED, EPI)  # fmt: skip


@triton.jit
def _finish(y, rm, m_mask, rn, pid_n, pid_k, M, N, y_ptr, stride_ym, ws_ptr, tk_ptr, aux_ptr,
            stride_am, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
            FUSED: tl.constexpr, EPI: tl.constexpr):  # fmt: skip
    """y [BM, BN] of K slice pid_k: the epilogue (SPLIT 1), else the workspace, and (FUSED)
    the reduction by the tile's last program."""
    if SPLIT == 1:
        _epilogue(y, rm, m_mask, pid_n, N, y_ptr, stride_ym, aux_ptr, stride_am, BLOCK_M,
                  BLOCK_N, EPI)  # fmt: skip
    else:
        mask = m_mask[:, None] & (rn < N)[None, :]
        tl.store(ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], y, mask=mask)
        if FUSED:
            # every thread's partial is stored before the ticket is taken (barrier, then a
            # release at GPU scope); the program that draws the last ticket sees them all
            tl.debug_barrier()
            ticket = tl.atomic_add(tk_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                tl.debug_barrier()
                y = _sum_partials(ws_ptr, rm, m_mask, rn, M, N, SPLIT, BLOCK_M, BLOCK_N)
                _epilogue(y, rm, m_mask, pid_n, N, y_ptr, stride_ym, aux_ptr, stride_am,
                          BLOCK_M, BLOCK_N, EPI)  # fmt: skip
                tl.atomic_xchg(tk_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # for the next


@triton.jit
def _slab_loads(w_ptrs, s_ptrs, x_ptrs, rk, m_mask, kw0, KW, EVEN_K: tl.constexpr):
    """One K step for the slab form: words, scales, and the 8 activation slabs [BM, BKW]
    (slab j: x[m, (kw0 + i) * 8 + j], the activations of nibble j of every word)."""
    w, s = ws_loads(w_ptrs, s_ptrs, rk, kw0, KW, EVEN_K)
    xm = m_mask[:, None] if EVEN_K else m_mask[:, None] & (kw0 + rk < KW)[None, :]
    p = x_ptrs + kw0 * 8
    x0 = tl.load(p, mask=xm, other=0.0)
    x1 = tl.load(p + 1, mask=xm, other=0.0)
    x2 = tl.load(p + 2, mask=xm, other=0.0)
    x3 = tl.load(p + 3, mask=xm, other=0.0)
    x4 = tl.load(p + 4, mask=xm, other=0.0)
    x5 = tl.load(p + 5, mask=xm, other=0.0)
    x6 = tl.load(p + 6, mask=xm, other=0.0)
    x7 = tl.load(p + 7, mask=xm, other=0.0)
    return w, s, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _slab_dot(acc, w, s, xj, J: tl.constexpr, TC: tl.constexpr, SWAP: tl.constexpr,
              IEEE: tl.constexpr):  # fmt: skip
    """acc + nibble J of every word of the tile, dequantized, against its activation slab: an
    elementwise function of the loaded words, so Triton can load them straight in the dot
    operand's layout (no shared-memory round trip of the 16-bit weights)."""
    c = ((w >> (4 * J)) & 0xF) | 0x4B000000
    v = (c.to(tl.float32, bitcast=True) - 8388616.0) * s
    if not TC:  # multiply-and-sum: [BM, BN, BKW] products of the exact fp32 weights
        acc += v[None, :, :] * xj.to(tl.float32)[:, None, :]
    else:
        acc = _dot_acc(acc, v, xj, SWAP, IEEE)
    return acc


@triton.jit
def _slab_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, TC: tl.constexpr, SWAP: tl.constexpr,
               IEEE: tl.constexpr):  # fmt: skip
    acc = _slab_dot(acc, w, s, x0, 0, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x1, 1, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x2, 2, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x3, 3, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x4, 4, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x5, 5, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x6, 6, TC, SWAP, IEEE)
    acc = _slab_dot(acc, w, s, x7, 7, TC, SWAP, IEEE)
    return acc


@triton.jit
def _w4_gemm_slab_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, tk_ptr, aux_ptr,
    M, N, KW, G, stride_xm, stride_ym, stride_am, chunk_kw,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    EVEN_K: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, EPI: tl.constexpr, PIPE: tl.constexpr = True,
    TC: tl.constexpr = True,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """The tensor-core path with K taken nibble by nibble: each K step is 8 dots of K=BLOCK_KW
    (nibble j of every word against the activations at k = 8i + j), which sums the same
    products as one dot over the unpacked tile. Grid and epilogue as _w4_gemm_kernel."""
    wait_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_KW)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rn_safe = tl.where(rn < N, rn, 0).to(tl.int64)
    w_ptrs = w_ptr + rn_safe[:, None] * KW + rk[None, :]
    s_ptrs = s_ptr + rn_safe[:, None] * G + rk[None, :] // 4
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * 8
    k0 = pid_k * chunk_kw
    k1 = tl.minimum(k0 + chunk_kw, KW)
    if not TC:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_KW], dtype=tl.float32)
    elif SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PIPE:  # the next step's operands are requested before this step's dots
        w, s, x0, x1, x2, x3, x4, x5, x6, x7 = _slab_loads(w_ptrs, s_ptrs, x_ptrs, rk, m_mask,
                                                            k0, KW, EVEN_K)  # fmt: skip
        for kn in range(k0 + BLOCK_KW, k1, BLOCK_KW):
            nw, ns, n0, n1, n2, n3, n4, n5, n6, n7 = _slab_loads(w_ptrs, s_ptrs, x_ptrs, rk,
                                                                 m_mask, kn, KW, EVEN_K)  # fmt: skip
            acc = _slab_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, TC, SWAP, IEEE)
            w, s, x0, x1, x2, x3, x4, x5, x6, x7 = nw, ns, n0, n1, n2, n3, n4, n5, n6, n7
        acc = _slab_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, TC, SWAP, IEEE)
    else:  # loads and their use in one iteration: Triton's own pipeliner may stage them
        for kn in range(k0, k1, BLOCK_KW):
            w, s, x0, x1, x2, x3, x4, x5, x6, x7 = _slab_loads(w_ptrs, s_ptrs, x_ptrs, rk,
                                                                m_mask, kn, KW, EVEN_K)  # fmt: skip
            acc = _slab_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, TC, SWAP, IEEE)
    if not TC:  # noqa: SIM108 - constexpr branches
        y = tl.sum(acc, axis=2)
    else:
        y = tl.trans(acc) if SWAP else acc
    _finish(y, rm, m_mask, rn, pid_n, pid_k, M, N, y_ptr, stride_ym, ws_ptr, tk_ptr, aux_ptr,
            stride_am, BLOCK_M, BLOCK_N, SPLIT, FUSED, EPI)  # fmt: skip


@triton.jit
def _w4_gemm_reduce_kernel(ws_ptr, y_ptr, aux_ptr, M, N, stride_ym, stride_am,
                           SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           EPI: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """The unfused split-K reduction: the SPLIT partials of one column tile, in order."""
    wait_inputs(PDL)
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = _sum_partials(ws_ptr, rm, m_mask, rn, M, N, SPLIT, BLOCK_M, BLOCK_N)
    _epilogue(y, rm, m_mask, pid_n, N, y_ptr, stride_ym, aux_ptr, stride_am, BLOCK_M, BLOCK_N,
              EPI)  # fmt: skip


def split_plan(k: int, cfg: dict[str, Any]) -> tuple[int, int]:
    """(splits actually launched, words per split): every split gets whole K steps, none is
    empty."""
    kw = k // 8
    steps = triton.cdiv(kw, cfg["BLOCK_KW"])
    split = max(1, min(int(cfg.get("SPLIT", 1)), steps))
    per = triton.cdiv(steps, split)
    return triton.cdiv(steps, per), per * cfg["BLOCK_KW"]


def block_m(m: int, tc: bool) -> int:
    """Activation rows per tile: 16 for the tensor cores (the dot's least), else M rounded up."""
    return 16 if tc else max(2, triton.next_power_of_2(m))


def launch(x2, packed, scales, y, cfg: dict[str, Any], epi: int = 0, aux=None,
           ws=None, tickets=None) -> None:  # fmt: skip
    """One product on prepared operands: x2 [M, K] (unit stride along K), y [M, N or N/2].
    ws: fp32 workspace of at least SPLIT*M*N and tickets: zeroed int32, one per N tile, when
    the config splits K."""
    m, k = x2.shape
    n = packed.shape[0]
    tc = bool(cfg.get("TC", True))
    bm = block_m(m, tc)
    split, chunk = split_plan(k, cfg)
    fused = bool(cfg.get("FUSED", True))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
    if split > 1 and (ws is None or ws.numel() < split * m * n or tickets is None
                      or tickets.numel() < grid[0]):  # fmt: skip
        raise ValueError("w4gemm launch: split-K needs a workspace and tickets of this size")
    ws = ws if ws is not None else y
    tickets = tickets if tickets is not None else y
    aux_t = aux if aux is not None else y
    stride_am = aux.stride(0) if aux is not None else 0
    ieee = x2.dtype == torch.float32 or triton_interpreted()
    even_k = (k // 8) % cfg["BLOCK_KW"] == 0
    if cfg.get("SLAB", False):
        if tc and cfg["BLOCK_KW"] < 16 and not triton_interpreted():  # one dot per nibble: K=BKW
            raise ValueError("w4gemm launch: a tensor-core slab step needs BLOCK_KW >= 16 "
                             "(each of its dots takes K = BLOCK_KW; Triton's minimum is 16)")  # fmt: skip
        run_kernel(_w4_gemm_slab_kernel, grid,
            x2, packed, scales, y, ws, tickets, aux_t,
            m, n, k // 8, k // 32, x2.stride(0), y.stride(0), stride_am, chunk,
            BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=cfg["BLOCK_KW"], EVEN_K=even_k,
            SWAP=bool(cfg.get("SWAP", False)), IEEE=ieee, SPLIT=split, FUSED=fused, EPI=epi,
            PIPE=bool(cfg.get("PIPE", True)), TC=tc, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )  # fmt: skip
    else:
        run_kernel(_w4_gemm_kernel, grid,
            x2, packed, scales, y, ws, tickets, aux_t,
            m, n, k // 8, k // 32, x2.stride(0), y.stride(0), stride_am, chunk,
            BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=cfg["BLOCK_KW"], EVEN_K=even_k, TC=tc,
            SWAP=bool(cfg.get("SWAP", False)), IEEE=ieee, SPLIT=split, FUSED=fused, EPI=epi,
            PIPE=bool(cfg.get("PIPE", True)), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )  # fmt: skip
    if split > 1 and not fused:
        br = 64
        run_kernel(_w4_gemm_reduce_kernel, (triton.cdiv(n, br),),
            ws, y, aux_t, m, n, y.stride(0), stride_am, SPLIT=split, BLOCK_M=bm, BLOCK_N=br,
            EPI=epi, num_warps=4,
        )  # fmt: skip


def default_config(n: int, k: int, m: int, tc: bool, sms: int = 132) -> dict[str, Any]:
    """A reasonable tiling when nothing is tuned (capture before tuning, tuning off, a new
    card): ~2 programs per SM through split-K where N alone gives too few."""
    kw = k // 8
    if tc:
        bn, bkw, warps = (64 if n >= 8192 else 32), 16, 4
    else:  # the [M, BN, BK] accumulator: about 32 fp32 registers per thread
        bn, warps = 4, 4
        bkw = max(2, min(32, 4096 // (block_m(m, False) * bn * 8)))
    bkw = min(bkw, max(2, triton.next_power_of_2(kw)))
    tiles = triton.cdiv(n, bn)
    split = 1
    while tiles * split * 2 <= 2 * sms and kw // (split * 2) >= 4 * bkw:
        split *= 2
    return {"TC": tc, "BLOCK_N": bn, "BLOCK_KW": bkw, "num_warps": warps, "num_stages": 2,
            "SPLIT": split, "FUSED": True, "SWAP": False, "PIPE": True}  # fmt: skip


_WORKSPACE_CACHE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
# outgrown buffers, kept alive: a captured graph may still point at them
_OUTGROWN_CACHE: list[tuple[torch.Tensor, torch.Tensor]] = []


def workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K workspace (fp32, >= floats) and tickets (int32 zeros, >= tiles)."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0": one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    ws, tk = _WORKSPACE_CACHE.get(key, (None, None))
    if ws is not None and ws.numel() >= floats and tk.numel() >= tiles:
        return ws, tk
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "w4_gemm: the split-K workspace is too small inside a CUDA-graph capture; call "
            "w4_gemm (or warm) with this shape and row count once before capturing"
        )
    if ws is not None:
        _OUTGROWN_CACHE.append((ws, tk))
        floats, tiles = max(floats, ws.numel()), max(tiles, tk.numel())
    ws = torch.empty(max(floats, 1 << 16), device=device, dtype=torch.float32)
    tk = torch.zeros(max(tiles, 1024), device=device, dtype=torch.int32)
    _WORKSPACE_CACHE[key] = (ws, tk)
    return ws, tk
