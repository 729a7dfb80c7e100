"""int4 GEMV: y = x @ dequant(W).T straight from the packed int32 words (decode, batch 1).

Layout (compressed-tensors "pack-quantized", symmetric, group 32): ``packed`` int32 [N, K/8],
element k of a row in word k//8 at bits 4*(k%8), stored unsigned as q+8; ``scales`` [N, K/32]
in fp16/bf16. ``w[n, k] = (code - 8) * scales[n, k // 32]``.

Why it is written this way: at batch 1 every weight is read once per token, so the kernel must
stream the packed words at the card's read bandwidth and never write a 16-bit copy. On a fast
card (an H200 reads 4+ TB/s, i.e. 8e12 codes/s) the unpacking arithmetic itself becomes the
limit, so each code costs one logic instruction and two float ones:

* the magic-number conversion: OR a 4-bit field into the mantissa of 2^23 (0x4B000000) and the
  fp32 bit pattern reads 2^23 + field, exactly; subtracting 2^23 + 8 gives code - 8. This skips
  the integer-to-float conversion (slow on Turing) and the shift before it.
* nibbles 0..4 are masked in place (the field may sit anywhere in the 23 mantissa bits, so
  nibble j reads 2^23 + code * 16^j); the 16^-j is folded into the activation, which is loaded
  once per tile and shared by all BLOCK_N rows. Nibbles 5..7 are shifted once by 20 bits.
  Every step is exact in fp32 (powers of two), so the result is the true dot product.
* one program owns BLOCK_N whole rows and walks K; no split-K, no atomics, no second pass:
  small BLOCK_N gives the parallelism instead. The tiling is chosen per (N, K) on the device.
* PIPE: each K step's words, scales and activations are requested before the previous step's
  arithmetic (held in registers, a software pipeline), so a program waits on memory once, not
  once per step; Triton's own pipeliner only stages loads that feed a tl.dot.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels import tuning
from engine.kernels.fused import _gelu_tanh, _inv_rms, _rms, _round, _scale_w
from engine.kernels.pdl import pdl_enter, pdl_kwargs, prefetch_l2, prefetch_on

KERNEL_NAME = "w4gemv"
_log = logging.getLogger(__name__)
_MAGIC = 0x4B000000
_TWO23 = 8388608.0

# (BLOCK_N, BLOCK_KW, num_warps, num_stages); BLOCK_KW counts int32 words (8 codes each).
# Tiles with several rows per thread let one thread reuse its activations across rows, which is
# what keeps the unpacking arithmetic (not the memory) from being the limit on a fast card.
_CANDIDATE_TILES = [
    (1, 64, 1, 2),
    (1, 128, 1, 2),
    (1, 256, 2, 2),
    (2, 128, 2, 2),
    (2, 256, 2, 2),
    (4, 64, 1, 3),
    (4, 128, 2, 2),
    (4, 256, 4, 2),
    (4, 256, 8, 3),
    (4, 128, 4, 3),
    (8, 32, 1, 2),
    (8, 64, 1, 2),
    (8, 64, 2, 2),
    (8, 128, 2, 2),
    (8, 128, 4, 2),
    (8, 256, 4, 2),
    (8, 256, 8, 2),
    (16, 32, 1, 2),
    (16, 64, 1, 2),
    (16, 64, 2, 2),
    (16, 128, 2, 2),
    (16, 128, 4, 2),
    (16, 256, 4, 2),
    (16, 256, 8, 2),
    (16, 64, 4, 2),
    (32, 32, 1, 2),
    (32, 64, 2, 2),
    (32, 128, 4, 2),
    (32, 256, 8, 2),
    (32, 64, 4, 2),
    (64, 32, 2, 2),
    (64, 64, 4, 2),
    # more warps on narrow rows: the residual epilogue's last program (a whole-vector norm)
    # runs with the kernel's warps, and one warp makes it the slowest step of a layer
    (8, 32, 4, 2),
    (16, 32, 4, 2),
    (32, 32, 4, 2),
    (64, 32, 8, 2),
    (16, 64, 8, 2),
]


@triton.jit
def _nibble_dot(w, xj, MASK: tl.constexpr, OFFSET: tl.constexpr, XSCALE: tl.constexpr,
                USE_ASM: tl.constexpr):  # fmt: skip
    """(code_j - 8) * x_j for one nibble position j of every word in the tile (exact)."""
    xj = xj * XSCALE
    if USE_ASM:  # (w & MASK) | 2^23 in ONE lop3 (ptxas emits two LOP3s for the plain form)
        bits = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
            [w, tl.full(w.shape, MASK, tl.int32), tl.full(w.shape, 0x4B000000, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        bits = (w & MASK) | 0x4B000000
    v = bits.to(tl.float32, bitcast=True) - OFFSET
    return v * xj[None, :]


_H2_WORD = tl.constexpr(
    # one int32 word (8 codes) against four half2 activation pairs -> fp32 dot of the 8 codes:
    # pairs (0,4) and (1,5) sit in place under masks 0x000F000F / 0x00F000F0, (2,6) and (3,7)
    # after one shift by 8; OR-ing 0x6400 (fp16 1024) gives 1024 + c (or 1024 + 16c), exact;
    # subtracting 1032 (1152) leaves c - 8 (16(c - 8), whose 1/16 is in the activation)
    "{ .reg .b32 w8, t0, t1, t2, t3, h, k0, k1, m0, m1, mg; .reg .b16 lo, hi; .reg .f32 fl, fh;"
    " mov.b32 k0, 0x64086408; mov.b32 k1, 0x64806480; mov.b32 m0, 0x000F000F;"
    " mov.b32 m1, 0x00F000F0; mov.b32 mg, 0x64006400; shr.b32 w8, $1, 8;"
    " lop3.b32 t0, $1, m0, mg, 0xEA; lop3.b32 t1, $1, m1, mg, 0xEA;"
    " lop3.b32 t2, w8, m0, mg, 0xEA; lop3.b32 t3, w8, m1, mg, 0xEA;"
    " sub.f16x2 t0, t0, k0; sub.f16x2 t1, t1, k1; sub.f16x2 t2, t2, k0; sub.f16x2 t3, t3, k1;"
    " mul.f16x2 h, t0, $2; fma.rn.f16x2 h, t1, $3, h; fma.rn.f16x2 h, t2, $4, h;"
    " fma.rn.f16x2 h, t3, $5, h;"
    " mov.b32 {lo, hi}, h; cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi; add.f32 $0, fl, fh; }"
)


@triton.jit
def _pack_h2(lo, hi):
    """Two fp32 tensors -> one int32 tensor of fp16 pairs (lo in the low half)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 l, h; cvt.rn.f16.f32 l, $1; cvt.rn.f16.f32 h, $2; mov.b32 $0, {l, h}; }",
        "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _x_at(x_ptr, off, m, EVEN_K: tl.constexpr, PRO: tl.constexpr, py_ptr, ph_ptr, pwp_ptr,
          pwn_ptr, inv1, inv2, sc, PRO_SCALAR: tl.constexpr, PRO_NEXT: tl.constexpr,
          DT: tl.constexpr):  # fmt: skip
    """Activations at element offsets `off` (fp32). PRO: not read but made here, exactly as
    the residual+norm kernel makes them: h' = round(h + rms(y) * w_post) [* scalar], then
    rms(h') * w_next (inv1, inv2: the two norms' factors, from the prologue)."""
    if PRO:
        y = tl.load(py_ptr + off, mask=m, other=0.0).to(tl.float32)
        h = tl.load(ph_ptr + off, mask=m, other=0.0).to(tl.float32)
        h = _round(h + _scale_w(y, inv1, pwp_ptr, off, m, True, DT), DT)
        if PRO_SCALAR:
            h = _round(h * sc, DT)
        if PRO_NEXT:
            h = _scale_w(h, inv2, pwn_ptr, off, m, True, DT)
        return h
    elif EVEN_K:
        return tl.load(x_ptr + off).to(tl.float32)
    else:
        return tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _tile_loads(w_ptrs, s_ptrs, x_ptr, rk, kw0, KW, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr,
                PRO: tl.constexpr, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
                PRO_SCALAR: tl.constexpr, PRO_NEXT: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """One K step's operands: the tile's words and scales and its 8 x BLOCK_KW activations
    (as fp32). Returned as values so the caller decides when they are requested (PIPE: one
    step ahead of the arithmetic).

    EVEN_K (BLOCK_KW divides KW): no masks. Otherwise columns at or past KW are masked to
    zero."""
    w, s = _ws_loads(w_ptrs, s_ptrs, rk, kw0, KW, EVEN_K)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_loads(x_ptr, rk, kw0, KW, EVEN_K, PRO, py_ptr, ph_ptr,
                                              pwp_ptr, pwn_ptr, inv1, inv2, sc, PRO_SCALAR,
                                              PRO_NEXT, DT)  # fmt: skip
    return w, s, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _ws_loads(w_ptrs, s_ptrs, rk, kw0, KW, EVEN_K: tl.constexpr):
    """One K step's words and scales."""
    if EVEN_K:
        w = tl.load(w_ptrs + kw0)
        s = tl.load(s_ptrs + kw0 // 4).to(tl.float32)
    else:
        m = (kw0 + rk) < KW
        w = tl.load(w_ptrs + kw0, mask=m[None, :], other=0)
        s = tl.load(s_ptrs + kw0 // 4, mask=m[None, :], other=0.0).to(tl.float32)
    return w, s


@triton.jit
def _x_loads(x_ptr, rk, kw0, KW, EVEN_K: tl.constexpr, PRO: tl.constexpr, py_ptr, ph_ptr,
             pwp_ptr, pwn_ptr, inv1, inv2, sc, PRO_SCALAR: tl.constexpr,
             PRO_NEXT: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """One K step's activations, as 8 vectors: nibble position j of every word."""
    m = (kw0 + rk) < KW
    off = (kw0 + rk) * 8
    x0 = _x_at(x_ptr, off + 0, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x1 = _x_at(x_ptr, off + 1, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x2 = _x_at(x_ptr, off + 2, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x3 = _x_at(x_ptr, off + 3, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x4 = _x_at(x_ptr, off + 4, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x5 = _x_at(x_ptr, off + 5, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x6 = _x_at(x_ptr, off + 6, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    x7 = _x_at(x_ptr, off + 7, m, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr, pwn_ptr, inv1, inv2, sc,
               PRO_SCALAR, PRO_NEXT, DT)  # fmt: skip
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _prologue(py_ptr, ph_ptr, pwp_ptr, psc_ptr, ph_out_ptr, K, eps, write,
              BLOCK_P: tl.constexpr, PRO_SCALAR: tl.constexpr, PRO_NEXT: tl.constexpr,
              DT: tl.constexpr):  # fmt: skip
    """The residual+norm that precedes this GEMV, done by every program over the whole vector
    (K values, from L2) instead of by a kernel of its own: returns the two norms' factors and
    the layer scalar; the program told to `write` stores h' for the kernels after this one."""
    offs = tl.arange(0, BLOCK_P)
    m = offs < K
    y = tl.load(py_ptr + offs, mask=m, other=0.0).to(tl.float32)
    inv1 = _inv_rms(y, m, K, eps)
    h = tl.load(ph_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = _round(h + _scale_w(y, inv1, pwp_ptr, offs, m, True, DT), DT)
    if PRO_SCALAR:
        sc = tl.load(psc_ptr).to(tl.float32)
        h = _round(h * sc, DT)
    else:
        sc = 1.0
    tl.store(ph_out_ptr + offs, h.to(ph_out_ptr.dtype.element_ty), mask=m & write)
    if PRO_NEXT:  # noqa: SIM108 - a constexpr branch
        inv2 = _inv_rms(h, m, K, eps)
    else:
        inv2 = 1.0
    return inv1, inv2, sc


@triton.jit
def _h2_tile_dot(w, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_j (code_j - 8) * x_j for every word of the tile, the products and the sum of each
    word's 8 terms in half2 arithmetic (2 codes per instruction): (w [BN, BKW] int32) ->
    (fp32 [BN, BKW], fp32 [BKW] factor to multiply it by).

    fp16 range: each column's 8 activations are scaled by a power of two that puts their
    largest magnitude in [512, 1024), so no product (|c - 8| <= 8) or 4-term sum can overflow
    whatever the activations' range (bf16 spans far more than fp16); the factor undoes it."""
    mx = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                    tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))  # fmt: skip
    e = (mx.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the largest
    e = tl.minimum(tl.maximum(e, 10), 254)
    sc = ((263 - e) << 23).to(tl.float32, bitcast=True)  # 2^(136 - e): max -> [512, 1024)
    inv = ((e - 9) << 23).to(tl.float32, bitcast=True)  # 2^(e - 136)
    s16 = sc * 0.0625
    p0 = _pack_h2(x0 * sc, x4 * sc)
    p1 = _pack_h2(x1 * s16, x5 * s16)
    p2 = _pack_h2(x2 * sc, x6 * sc)
    p3 = _pack_h2(x3 * s16, x7 * s16)
    dot = tl.inline_asm_elementwise(
        _H2_WORD, "=r,r,r,r,r,r",
        [w, p0[None, :], p1[None, :], p2[None, :], p3[None, :]],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip
    return dot, inv


@triton.jit
def _tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2: tl.constexpr,
               USE_ASM: tl.constexpr):  # fmt: skip
    """acc + every word's dot with its 8 activations, times its group scale."""
    if H2:  # half2 arithmetic: ~2 instructions per code instead of ~4.4
        part, inv = _h2_tile_dot(w, x0, x1, x2, x3, x4, x5, x6, x7)
        acc += part * (s * inv[None, :])
    else:
        part = _nibble_dot(w, x0, 0xF, 8388616.0, 1.0, USE_ASM)
        part += _nibble_dot(w, x1, 0xF0, 8388736.0, 0.0625, USE_ASM)
        part += _nibble_dot(w, x2, 0xF00, 8390656.0, 0.00390625, USE_ASM)
        part += _nibble_dot(w, x3, 0xF000, 8421376.0, 0.000244140625, USE_ASM)
        part += _nibble_dot(w, x4, 0xF0000, 8912896.0, 0.0000152587890625, USE_ASM)
        wh = w >> 20
        part += _nibble_dot(wh, x5, 0xF, 8388616.0, 1.0, USE_ASM)
        part += _nibble_dot(wh, x6, 0xF0, 8388736.0, 0.0625, USE_ASM)
        part += _nibble_dot(wh, x7, 0xF00, 8390656.0, 0.00390625, USE_ASM)
        acc += part * s
    return acc


@triton.jit
def _w4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K, KW, G, stride_xm, stride_ym,
    aux_ptr, h_ptr, w_post_ptr, scalar_ptr, w_next_ptr, h_out_ptr, x_out_ptr, counter_ptr, eps,
    py_ptr, ph_ptr, pwp_ptr, psc_ptr, pwn_ptr, ph_out_ptr,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr = False, EPI: tl.constexpr = 0, HAS_SCALAR: tl.constexpr = False,
    HAS_NEXT: tl.constexpr = False, BLOCK_H: tl.constexpr = 16,
    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, H2: tl.constexpr = False,
    PIPE: tl.constexpr = True, PRO: tl.constexpr = False, PRO_SCALAR: tl.constexpr = False,
    PRO_NEXT: tl.constexpr = False, BLOCK_P: tl.constexpr = 16,
):  # fmt: skip
    """EPI 0: y = x W^T. 1: GLU over interleaved (gate, up) rows -> gelu(gate) * up, N/2 wide.
    2: gelu(y) * aux[row]. 3: y, then the LAST program to finish adds rms_norm(y) * w_post to
    the residual h (times a scalar), and writes rms_norm(h) * w_next: one launch instead of a
    GEMV plus a norm kernel (programs count themselves on an atomic counter, which the last one
    resets for the next call / graph replay). Intermediates round where the reference rounds.

    PRO (one token): the activations are not read from x but made from the previous GEMV's
    output y (py), the residual h (ph) and the norm weights, as `residual_norm` makes them;
    every program computes the two norms itself and program 0 writes h' (ph_out, never ph:
    the other programs still read it). One launch fewer per residual+norm in the decode step.

    PREFETCH: the program's rows (codes and scales, contiguous) are pulled into L2 first, so all
    of a matrix is requested at once instead of a tile per loop step. PDL: that happens while
    the previous kernel still runs; the activations are read only after `pdl_enter`."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    # KW (= K/8 words) and G (= K/32 scales) come as arguments, not K // 8: Triton then knows
    # their divisibility and loads 16 bytes of a row at a time
    if PREFETCH:
        rows = tl.minimum(BLOCK_N, N - pid_n * BLOCK_N)
        r0 = (pid_n * BLOCK_N).to(tl.int64)
        prefetch_l2(w_ptr + r0 * KW, rows * KW * 4, True)
        SB: tl.constexpr = s_ptr.dtype.element_ty.primitive_bitwidth // 8
        prefetch_l2(s_ptr + r0 * G, rows * G * SB, True)
    pdl_enter(PDL)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_KW)
    n_mask = rn < N
    rn_safe = tl.where(n_mask, rn, 0).to(tl.int64)
    w_ptrs = w_ptr + rn_safe[:, None] * KW + rk[None, :]
    s_ptrs = s_ptr + rn_safe[:, None] * G + rk[None, :] // 4
    xm_ptr = x_ptr + pid_m * stride_xm
    DTA: tl.constexpr = x_ptr.dtype.element_ty
    # the first step's weights are requested before the prologue's reductions: its latency
    # hides behind the weight loads
    w, s = _ws_loads(w_ptrs, s_ptrs, rk, 0, KW, EVEN_K)
    if PRO:
        inv1, inv2, sc = _prologue(py_ptr, ph_ptr, pwp_ptr, psc_ptr, ph_out_ptr, K, eps,
                                   pid_n == 0, BLOCK_P, PRO_SCALAR, PRO_NEXT, DTA)  # fmt: skip
    else:
        inv1 = 1.0
        inv2 = 1.0
        sc = 1.0
    acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_loads(xm_ptr, rk, 0, KW, EVEN_K, PRO, py_ptr, ph_ptr,
                                              pwp_ptr, pwn_ptr, inv1, inv2, sc, PRO_SCALAR,
                                              PRO_NEXT, DTA)  # fmt: skip
    for kn in range(BLOCK_KW, KW, BLOCK_KW):  # kn: the NEXT step's first word
        # PIPE: the next step's operands are requested before this step's arithmetic, so the
        # memory latency of step i+1 overlaps the unpacking of step i (one wait per kernel,
        # not per step); else after it
        if PIPE:
            nw, ns, n0, n1, n2, n3, n4, n5, n6, n7 = _tile_loads(
                w_ptrs, s_ptrs, xm_ptr, rk, kn, KW, BLOCK_KW, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr,
                pwn_ptr, inv1, inv2, sc, PRO_SCALAR, PRO_NEXT, DTA)  # fmt: skip
            acc = _tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)
        else:
            acc = _tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)
            nw, ns, n0, n1, n2, n3, n4, n5, n6, n7 = _tile_loads(
                w_ptrs, s_ptrs, xm_ptr, rk, kn, KW, BLOCK_KW, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr,
                pwn_ptr, inv1, inv2, sc, PRO_SCALAR, PRO_NEXT, DTA)  # fmt: skip
        w, s, x0, x1, x2, x3, x4, x5, x6, x7 = nw, ns, n0, n1, n2, n3, n4, n5, n6, n7
    acc = _tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)  # the last step
    y = tl.sum(acc, axis=1)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    if EPI == 1:
        g, u = tl.split(tl.reshape(_round(y, DT), [BLOCK_N // 2, 2]))
        act = _round(_round(_gelu_tanh(g), DT) * u, DT)
        rp = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + pid_m * stride_ym + rp, act, mask=rp < N // 2)
    elif EPI == 2:
        a = tl.load(aux_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        out = _round(_round(_gelu_tanh(_round(y, DT)), DT) * a, DT)
        tl.store(y_ptr + pid_m * stride_ym + rn, out, mask=n_mask)
    else:
        tl.store(y_ptr + pid_m * stride_ym + rn, y.to(DT), mask=n_mask)
        if EPI == 3:
            if USE_ASM:  # every thread's stores visible GPU-wide before the count goes up
                tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [rn],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(0) - 1:
                offs = tl.arange(0, BLOCK_H)
                m = offs < N
                yv = tl.load(y_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
                h = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
                h = _round(h + _rms(yv.to(tl.float32), w_post_ptr, offs, m, N, eps, True, DT), DT)
                if HAS_SCALAR:
                    h = _round(h * tl.load(scalar_ptr).to(tl.float32), DT)
                tl.store(h_out_ptr + offs, h, mask=m)
                if HAS_NEXT:
                    tl.store(x_out_ptr + offs, _rms(h, w_next_ptr, offs, m, N, eps, True, DT),
                             mask=m)  # fmt: skip
                tl.atomic_xchg(counter_ptr, 0)


def w4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The PyTorch ground truth: dequantize to fp32 and multiply (any device)."""
    return (x.float() @ dequantize_reference(packed, scales).T).to(x.dtype)


def dequantize_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from packed int32 [N, K/8] and scales [N, K/32]."""
    n, kw = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    q = codes.reshape(n, kw * 8).float() - 8.0
    return q * scales.float().repeat_interleave(32, dim=1)


def _default_config(n: int, k: int) -> dict[str, Any]:
    """A reasonable tiling when nothing is tuned (CPU interpreter, capture, tuning off)."""
    kw = k // 8
    if n >= 4096 and kw >= 64:  # several rows per thread: the activations are reused
        return {"BLOCK_N": 8, "BLOCK_KW": 64, "num_warps": 2, "num_stages": 2, "PIPE": True}
    block_kw = 256 if kw >= 256 else triton.next_power_of_2(max(kw, 16))
    return {"BLOCK_N": 4, "BLOCK_KW": block_kw, "num_warps": 4, "num_stages": 2, "PIPE": True}


KERNEL_VERSION = 5  # bump when the kernel changes: stored tilings of older versions are ignored


def _shape_key(n: int, k: int, dtype: torch.dtype, m: int, epi: int = 0, h2: bool = False) -> str:
    key = f"v{KERNEL_VERSION}_N{n}_K{k}_{str(dtype).removeprefix('torch.')}_M{min(m, 4)}"
    return key + (f"_E{epi}" if epi else "") + ("_h2" if h2 else "")


_ASM = {"ok": True}  # cleared if the inline-PTX variant ever fails to build on this machine


def _use_asm(t: torch.Tensor) -> bool:
    """The inline-PTX lop3 runs on NVIDIA GPUs only (not in the CPU interpreter)."""
    return _asm_on(t.device)


def _asm_on(device: torch.device) -> bool:
    return (
        _ASM["ok"]
        and device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
    )


H2_ENV = "GPURIG_GEMV_H2"


def use_h2(t: torch.Tensor) -> bool:
    """Half2 arithmetic for 16-bit activations on NVIDIA GPUs (GPURIG_GEMV_H2=0 turns it off).
    fp32 models keep the exact fp32 unpack: their fast path equals the reference token for
    token."""
    return _h2_on(t.dtype, t.device)


def _h2_on(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        dtype in (torch.float16, torch.bfloat16)
        and _asm_on(device)
        and os.environ.get(H2_ENV, "1") != "0"
    )


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """One int32 per device for EPI 3: kernels on one stream run one after another, and the
    last program of each resets it, so a single counter serves every call site."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _launch(x2, packed, scales, y, cfg: dict[str, Any], epi: int = 0, aux=None, h=None,
            w_post=None, scalar=None, w_next=None, h_out=None, x_out=None,
            eps: float = 1e-6, pro: tuple | None = None) -> None:  # fmt: skip
    m, k = x2.shape
    n = packed.shape[0]
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), m)
    # pro: (y, h, w_post, scalar, w_next, h_out) of the residual+norm made in the prologue
    py, ph, pwp, psc, pwn, ph_out = pro if pro is not None else (y,) * 6
    _w4_gemv_kernel[grid](
        x2, packed, scales, y, n, k, k // 8, k // 32, x2.stride(0), y.stride(0),
        aux if aux is not None else y, h if h is not None else y,
        w_post if w_post is not None else y, scalar if scalar is not None else y,
        w_next if w_next is not None else y, h_out if h_out is not None else y,
        x_out if x_out is not None else y, _counter(x2.device) if epi == 3 else y, eps,
        py, ph, pwp, psc if psc is not None else py, pwn if pwn is not None else py, ph_out,
        PRO=pro is not None, PRO_SCALAR=psc is not None and pro is not None,
        PRO_NEXT=pwn is not None and pro is not None,
        BLOCK_P=triton.next_power_of_2(max(k, 16)) if pro is not None else 16,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=cfg["BLOCK_KW"], PIPE=cfg.get("PIPE", True),
        EVEN_K=(k // 8) % cfg["BLOCK_KW"] == 0,
        USE_ASM=_use_asm(x2), EPI=epi, HAS_SCALAR=scalar is not None, H2=use_h2(x2),
        HAS_NEXT=w_next is not None, BLOCK_H=triton.next_power_of_2(max(n, 16)) if epi == 3 else 16,
        PREFETCH=prefetch_on(x2), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_kwargs(x2),
    )  # fmt: skip


def candidate_configs(n: int, k: int, epi: int = 0) -> list[dict[str, Any]]:
    """The tilings worth timing for one shape (BLOCK_KW no wider than the row; the GLU epilogue
    needs whole (gate, up) row pairs, so an even BLOCK_N)."""
    kw = k // 8
    out = []
    for bn, bkw, warps, stages in _CANDIDATE_TILES:
        if bkw > max(32, triton.next_power_of_2(kw)) or (epi == 1 and bn % 2):
            continue
        tile = {"BLOCK_N": bn, "BLOCK_KW": bkw, "num_warps": warps, "num_stages": stages}
        out.append(dict(tile, PIPE=True))
        if kw > bkw:  # several K steps: loading after the arithmetic is the other choice
            out.append(dict(tile, PIPE=False))
    return out


def tune(
    n: int,
    k: int,
    dtype: torch.dtype,
    m: int = 1,
    device: torch.device | None = None,
    epi: int = 0,
    candidates: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], float, list[tuple[dict[str, Any], float]]]:
    """Time every candidate tiling on random data of this shape, with the epilogue it will run
    with (the residual epilogue's serial tail favours other tiles); returns (best, us, all)."""
    device = device or torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    one = n * k // 2 + n * k // 16  # bytes of codes + scales
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    copies = max(2, min(64, math.ceil(3 * l2 / one)))
    sets = []
    for _ in range(copies):
        p = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=device, dtype=torch.int32,
                          generator=gen)  # fmt: skip
        s = (torch.rand(n, k // 32, device=device, generator=gen) * 0.02 + 0.001).to(dtype)
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        y = torch.empty(m, n // 2 if epi == 1 else n, device=device, dtype=dtype)
        sets.append((x, p, s, y))
    vec = torch.rand(n, device=device, generator=gen).to(dtype) + 0.5  # norm weights, aux
    h = torch.zeros(n, device=device, dtype=dtype)
    x_out = torch.empty(n, device=device, dtype=dtype)
    extra: dict[str, Any] = {}
    if epi == 2:
        extra = {"aux": vec}
    elif epi == 3:
        extra = {"h": h, "w_post": vec, "w_next": vec, "h_out": h, "x_out": x_out}

    def make_calls(cfg):
        return [lambda a=a, cfg=cfg: _launch(a[0], a[1], a[2], a[3], cfg, epi=epi, **extra)
                for a in sets]  # fmt: skip

    candidates = candidates or candidate_configs(n, k, epi)
    try:
        best, us, results = tuning.pick_fastest(candidates, make_calls)
    except RuntimeError:  # nothing built: retry with the plain (two-instruction) unpack
        if not _ASM["ok"]:
            raise
        _ASM["ok"] = False
        best, us, results = tuning.pick_fastest(candidates, make_calls)
    return best, us, results


_TILES_ONLY = ("BLOCK_N", "BLOCK_KW", "num_warps", "num_stages", "PIPE")


def config_for(
    n: int, k: int, dtype: torch.dtype, m: int, device: torch.device, epi: int = 0
) -> dict[str, Any]:
    """Stored config for this shape (and epilogue) on this GPU; tune now if allowed and
    possible, else default.

    The GLU and GELU epilogues (1, 2) add a few instructions per output and use the plain
    GEMV's tiling. The residual epilogue (3) ends in one program normalising the whole vector,
    whose speed depends on the warps: it is tuned on its own, over the plain GEMV's best tiles
    and the wider-warp ones (a short list: every candidate is a compile)."""
    if device.type != "cuda":  # the CPU interpreter: few, big programs run fastest
        return {"BLOCK_N": 64, "BLOCK_KW": min(128, _default_config(n, k)["BLOCK_KW"]),
                "num_warps": 4, "num_stages": 1}  # fmt: skip
    if epi in (1, 2):
        epi = 0
    gpu = tuning.gpu_key(device)
    key = _shape_key(n, k, dtype, m, epi, _h2_on(dtype, device))
    cfg = tuning.lookup(KERNEL_NAME, key, gpu)
    if cfg is not None:
        return cfg
    if not tuning.autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return _default_config(n, k)
    candidates = None
    if epi == 3:
        plain = config_for(n, k, dtype, m, device, 0)
        ranked = _RANKED.get(key.replace("_E3", ""), [plain])
        candidates = [{t: c[t] for t in _TILES_ONLY} for c in ranked[:4]]
        for extra in candidate_configs(n, k):
            if extra["num_warps"] >= 4 and extra not in candidates:
                candidates.append(extra)
        candidates = candidates[:10]
    try:
        best, us, results = tune(n, k, dtype, m, device, epi=epi, candidates=candidates)
    except torch.OutOfMemoryError:  # a capped card: tune another time, run the default now
        torch.cuda.empty_cache()
        return _default_config(n, k)
    if epi == 0:
        _RANKED[key] = [c for c, _ in sorted(results, key=lambda r: r[1])]
    best = dict(best, us=round(us, 3))
    _log.info("w4gemv: tuned N=%d K=%d %s on %s: %s (%.2f us)", n, k, dtype, gpu,
              {t: best[t] for t in _TILES_ONLY if t in best}, us)  # fmt: skip
    no_pipe = [t for c, t in results if not c.get("PIPE", True)]
    if no_pipe:  # kept beside the choice: what the software pipeline gained on this shape
        best["us_no_pipe"] = round(min(no_pipe), 3)
    tuning.store(KERNEL_NAME, key, gpu, best)
    return best


_RANKED: dict[str, list[dict[str, Any]]] = {}  # this process's tuning results, best first


def w4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """y[..., N] = x[..., K] @ dequant(packed, scales).T, accumulated in fp32, in x's dtype.

    `out` (optional) receives the result; its dtype may differ from x's (e.g. fp32 logits).
    """
    x2, n, k = _prepare(x, packed, scales)
    m = x2.shape[0]
    y = out.view(m, n) if out is not None else torch.empty(m, n, device=x.device, dtype=x.dtype)
    cfg = config or config_for(n, k, x.dtype, m, x.device)
    _launch(x2, packed.contiguous(), scales.contiguous(), y, cfg)
    return y.view(*x.shape[:-1], n)


def _prepare(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor):
    k = x.shape[-1]
    n = packed.shape[0]
    if packed.shape[1] * 8 != k or scales.shape != (n, k // 32) or k % 32:
        raise ValueError(
            f"w4_gemv: x has K={k}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}; "
            "expected packed [N, K/8] and scales [N, K/32] with K a multiple of 32"
        )
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, n, k


def w4_gemv_glu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up from ONE GEMV over a gate|up matrix whose rows are interleaved
    (row 2i = gate_i, row 2i+1 = up_i): [..., N/2], rounded as the reference rounds."""
    x2, n, k = _prepare(x, packed, scales)
    cfg = dict(config_for(n, k, x.dtype, x2.shape[0], x.device, epi=1))
    if cfg["BLOCK_N"] % 2:  # a one-row tiling tuned for the plain GEMV: whole row pairs
        cfg["BLOCK_N"] = 2
    y = torch.empty(x2.shape[0], n // 2, device=x.device, dtype=x.dtype)
    _launch(x2, packed.contiguous(), scales.contiguous(), y, cfg, epi=1)
    return y.view(*x.shape[:-1], n // 2)


def w4_gemv_gelu_mul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     aux: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """gelu_tanh(x W^T) * aux (aux: N values), in one launch."""
    x2, n, k = _prepare(x, packed, scales)
    cfg = config_for(n, k, x.dtype, x2.shape[0], x.device, epi=2)
    y = torch.empty(x2.shape[0], n, device=x.device, dtype=x.dtype)
    _launch(x2, packed.contiguous(), scales.contiguous(), y, cfg, epi=2, aux=aux.contiguous())
    return y.view(*x.shape[:-1], n)


def w4_gemv_residual(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    h: torch.Tensor,
    w_post: torch.Tensor,
    eps: float,
    scalar: torch.Tensor | None = None,
    w_next: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One token: h <- h + rms_norm(x W^T, w_post) [then * scalar], in place, in the GEMV's last
    program; returns rms_norm(h, w_next) when w_next is given (the next block's input)."""
    x2, n, k = _prepare(x, packed, scales)
    if x2.shape[0] != 1 or h.numel() != n:
        raise ValueError("w4_gemv_residual takes one token whose residual has N values")
    cfg = config_for(n, k, x.dtype, 1, x.device, epi=3)
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    x_out = torch.empty_like(h) if w_next is not None else None
    _launch(x2, packed.contiguous(), scales.contiguous(), y, cfg, epi=3, h=h, w_post=w_post,
            scalar=scalar, w_next=w_next, h_out=h, x_out=x_out, eps=eps)  # fmt: skip
    return x_out


def w4_gemv_after_residual(
    y: torch.Tensor,
    h: torch.Tensor,
    w_post: torch.Tensor,
    eps: float,
    packed: torch.Tensor,
    scales: torch.Tensor,
    h_out: torch.Tensor,
    scalar: torch.Tensor | None = None,
    w_next: torch.Tensor | None = None,
    epi: int = 0,
    aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token: `residual_norm(h, y, w_post, eps, scalar, w_next)` and the GEMV that reads
    its output, in ONE launch. h' = h + rms_norm(y, w_post) [* scalar] goes to h_out (a buffer
    other than h: every program reads h while one writes h'); the GEMV reads
    x = rms_norm(h', w_next), or h' itself without w_next. epi 1: GLU over interleaved gate|up
    rows ([1, N/2]); epi 2: gelu(.) * aux; 0: plain."""
    k = h.numel()
    n = packed.shape[0]
    if (y.numel() != k or packed.shape[1] * 8 != k or scales.shape != (n, k // 32)
            or h_out.numel() != k or h_out.data_ptr() in (h.data_ptr(), y.data_ptr())
            or not y.dtype == h.dtype == h_out.dtype):  # fmt: skip
        raise ValueError(
            "w4_gemv_after_residual: y, h, h_out and the GEMV's K must agree (one token, one "
            "dtype), and h_out must be a buffer other than h and y"
        )
    y2 = y.reshape(1, k)
    cfg = dict(config_for(n, k, y.dtype, 1, y.device, epi=epi))
    if epi == 1 and cfg["BLOCK_N"] % 2:
        cfg["BLOCK_N"] = 2
    out = torch.empty(1, n // 2 if epi == 1 else n, device=y.device, dtype=y.dtype)
    _launch(y2, packed.contiguous(), scales.contiguous(), out, cfg, epi=epi,
            aux=aux.contiguous() if aux is not None else None, eps=eps,
            pro=(y2, h.reshape(-1), w_post, scalar, w_next, h_out.reshape(-1)))  # fmt: skip
    return out
