"""The int4 few-row product on the tensor cores with the operands built in registers (Triton,
warp-level): Y[M, N] = X[M, K] @ dequant(W).T for M = 1..16 bf16 or fp16 rows, sm_80 on.

Here: the kernel, its launch and its candidate tilings (the choice: engine/kernels/w4mma_tune.py;
measured on the H200: bench/results/engine/gemm_mma_h200_2026-12-02_mt.md); the Python API is
engine/kernels/w4gemm.py,
which sends 2..16 rows here where `mma_ok` allows and to engine/kernels/w4gemm_kernel.py
otherwise. Layout on disk and in memory is the checkpoint's own (compressed-tensors
pack-quantized: int32 [N, K/8], element k of a row at bits 4*(k%8) of word k//8, stored as
code = q + 8; scales [N, K/32]): nothing is repacked.

Why it is written this way: the tl.dot kernel (w4gemm_kernel.py) unpacks a weight tile in a
blocked layout and Triton moves it through shared memory into the tensor cores' operand layout,
about 5 instructions per weight; its time is 2-3.6x the one-row GEMV's on every E2B shape. Here
every tensor holds ONE element per thread (shape [warps * 32]: element i lives in lane i % 32 of
warp i // 32), so `tl.inline_asm_elementwise` can issue warp-level PTX with each lane's own
registers: 16-byte loads, the unpack, and `mma.sync.m16n8k16` itself. A warp owns 16 weight rows
and one K slice; the weights are the mma's A operand (Y^T = W X^T), the activation rows its
8-wide N side (two mmas for 9..16 rows), so one weight load serves every row.

The operand mapping (what makes it work on the stored layout): a dot product does not depend on
the order of its K terms, only on A and B agreeing on it. Lane (g, c) = (lane // 4, lane % 4)
reads 16 bytes of weight row n0 + 2g and of row n0 + 2g + 1 (its mma rows g and g + 8): the
words 4c..4c+3 of the 128-element K step, one 32-element group, one scale per row. For word i,
nibbles (j, j+4) sit at bits 4j and 4j+16, exactly a 16-bit pair: one shift, one lop3 with the
exponent of 128 (bf16; 1024 for fp16) makes 128 + code in both halves, one fma takes 8 off
(exact), one fma times the group scale (rounded once, as the reference's 16-bit dot). Pairs
(0,4), (1,5) are one mma's A registers, (2,6), (3,7) the next's; the activation lane (g, c)
loads x[row g, the same 32 elements] with four 16-byte loads and builds the matching B pairs
with `prmt`. About 2 instructions per weight, independent of the row count. Rows as pairs
(2g, 2g+1) also put a GLU's gate and up in one lane, so the epilogue needs no shuffle.

Warps of a program split K (NWK) and are summed at the end (a tl.sum over the warp axis: fixed
order, deterministic); NWN warps take neighbouring 16-row tiles; MT 2 gives a warp two 16-row
tiles that share each step's activation pairs (per mma the activations are 256 bytes against the
weights' 128, so sharing them is what 16 rows need). Each lane requests step s+1's
words before step s's arithmetic (the loads are inline asm, which Triton's pipeliner skips).

Under the CPU interpreter (no PTX) the same kernel runs with the loads, the unpack and the mma
written in tl ops: the mma is rebuilt from the lanes' fragments (reshape/permute) as a [16, 16]
by [16, 8] product and handed back lane by lane, so the fragment mapping itself is under test.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels.fused import gelu_tanh, round_to
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs
from engine.kernels.w4mma_residual import ResidualFold, residual_tail, rows_per_chunk, spread_ok
from engine.options import triton_interpreted

ASM = {"ok": True}

_LD_V4 = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")  # weights: read-only
# activations: written by the kernel before, which may still run (PDL, engine/kernels/pdl.py):
# a coherent load, kept after the wait (not pure)
_LD_V4_X = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")
# per 16-bit pair: (w >> 4j) & 0x000F000F | exponent of 128 (bf16) -> 128 + code; fma -136 (-8
# net, exact); fma * scale (one rounding). sm_80 has bf16x2 fma but not bf16x2 sub/mul.
_UNPACK_BF16 = tl.constexpr(
    "{ .reg .b32 u1, u2, u3, t0, t1, t2, t3; .reg .b32 one, off, nz, m, e;"
    " mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; mov.b32 nz, 0x80008000;"
    " mov.b32 m, 0x000F000F; mov.b32 e, 0x43004300;"
    " shr.u32 u1, $4, 4; shr.u32 u2, $4, 8; shr.u32 u3, $4, 12;"
    " lop3.b32 t0, $4, m, e, 0xEA; lop3.b32 t1, u1, m, e, 0xEA;"
    " lop3.b32 t2, u2, m, e, 0xEA; lop3.b32 t3, u3, m, e, 0xEA;"
    " fma.rn.bf16x2 t0, t0, one, off; fma.rn.bf16x2 t1, t1, one, off;"
    " fma.rn.bf16x2 t2, t2, one, off; fma.rn.bf16x2 t3, t3, one, off;"
    " fma.rn.bf16x2 $0, t0, $5, nz; fma.rn.bf16x2 $1, t1, $5, nz;"
    " fma.rn.bf16x2 $2, t2, $5, nz; fma.rn.bf16x2 $3, t3, $5, nz; }"
)
# fp16: exponent of 1024 (10 mantissa bits), -1032 = 0xE408
_UNPACK_F16 = tl.constexpr(
    "{ .reg .b32 u1, u2, u3, t0, t1, t2, t3; .reg .b32 off, m, e;"
    " mov.b32 off, 0x64086408; mov.b32 m, 0x000F000F; mov.b32 e, 0x64006400;"
    " shr.u32 u1, $4, 4; shr.u32 u2, $4, 8; shr.u32 u3, $4, 12;"
    " lop3.b32 t0, $4, m, e, 0xEA; lop3.b32 t1, u1, m, e, 0xEA;"
    " lop3.b32 t2, u2, m, e, 0xEA; lop3.b32 t3, u3, m, e, 0xEA;"
    " sub.f16x2 t0, t0, off; sub.f16x2 t1, t1, off; sub.f16x2 t2, t2, off;"
    " sub.f16x2 t3, t3, off;"
    " mul.f16x2 $0, t0, $5; mul.f16x2 $1, t1, $5; mul.f16x2 $2, t2, $5; mul.f16x2 $3, t3, $5; }"
)
_MMA = (
    "mma.sync.aligned.m16n8k16.row.col.f32.{dt}.{dt}.f32 {{$0, $1, $2, $3}}, "
    "{{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};"
)
_MMA_BF16 = tl.constexpr(_MMA.format(dt="bf16"))
_MMA_F16 = tl.constexpr(_MMA.format(dt="f16"))
# (lo16 of a, lo16 of b) and (hi16 of a, hi16 of b)
_PRMT = tl.constexpr("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;")


@triton.jit
def _ld4(ptr, ASM_ON: tl.constexpr, X: tl.constexpr = False):
    """Four consecutive int32 words at each lane's `ptr` (16-byte aligned): one vector load
    (X: of activations)."""
    if ASM_ON:
        return tl.inline_asm_elementwise(
            _LD_V4_X if X else _LD_V4, "=r,=r,=r,=r,l", [ptr.to(tl.int64)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=not X, pack=1,
        )  # fmt: skip
    return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)


@triton.jit
def _bits16(v, F16: tl.constexpr):
    """fp32 -> the 16-bit pattern of its round-to-nearest-even bf16 (or fp16), as int32."""
    if F16:
        return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = v.to(tl.int32, bitcast=True)  # by hand: the interpreter's fp32 -> bf16 truncates
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _half(p, HI: tl.constexpr, F16: tl.constexpr):
    """One 16-bit half of a pair, as fp32."""
    h = (p >> 16) & 0xFFFF if HI else p & 0xFFFF
    if F16:
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (h << 16).to(tl.float32, bitcast=True)


@triton.jit
def _scale_pair(s_ptr, off, F16: tl.constexpr):
    """A group scale in the activations' 16-bit type, in both halves of an int32."""
    s = tl.load(s_ptr + off).to(tl.float32)
    b = _bits16(s, F16)
    return b | (b << 16)


@triton.jit
def _unpack(w, s2, F16: tl.constexpr, ASM_ON: tl.constexpr):
    """One word -> its four pairs (nibble j, nibble j+4), j = 0..3, each (code - 8) * scale in
    16 bits, as int32."""
    if ASM_ON:
        return tl.inline_asm_elementwise(
            _UNPACK_F16 if F16 else _UNPACK_BF16, "=r,=r,=r,=r,r,r", [w, s2],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    s = _half(s2, False, F16)
    p0 = _pair(w, 0, s, F16)
    p1 = _pair(w, 4, s, F16)
    p2 = _pair(w, 8, s, F16)
    p3 = _pair(w, 12, s, F16)
    return p0, p1, p2, p3


@triton.jit
def _pair(w, SH: tl.constexpr, s, F16: tl.constexpr):
    lo = (((w >> SH) & 0xF) - 8).to(tl.float32) * s
    hi = (((w >> (SH + 16)) & 0xF) - 8).to(tl.float32) * s
    return _bits16(lo, F16) | (_bits16(hi, F16) << 16)


@triton.jit
def _prmt(a, b, ASM_ON: tl.constexpr):
    """(lo a, lo b) and (hi a, hi b): activation pairs matched to the weight pairs."""
    if ASM_ON:
        return tl.inline_asm_elementwise(
            _PRMT, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    return (a & 0xFFFF) | (b << 16), ((a >> 16) & 0xFFFF) | (b & -65536)


@triton.jit
def _frag(p, q, NW: tl.constexpr, F16: tl.constexpr):
    """Emulation only: lanes' pairs p (k slots 2c, 2c+1) and q (2c+8, 2c+9) -> [NW, 8, 16]
    (warp, group g, k slot)."""
    pl = tl.reshape(_half(p, False, F16), [NW, 8, 4])
    ph = tl.reshape(_half(p, True, F16), [NW, 8, 4])
    ql = tl.reshape(_half(q, False, F16), [NW, 8, 4])
    qh = tl.reshape(_half(q, True, F16), [NW, 8, 4])
    t = tl.join(tl.join(pl, ph), tl.join(ql, qh))  # [NW, 8, 4 (c), 2 (e), 2 (half)]
    return tl.reshape(tl.permute(t, (0, 1, 4, 2, 3)), [NW, 8, 16])


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW: tl.constexpr, F16: tl.constexpr,
         ASM_ON: tl.constexpr):  # fmt: skip
    """D = A B + C for one m16n8k16 tile per warp, operands and result in the lanes' fragment
    registers (PTX ISA, "Matrix Fragments for mma.m16n8k16")."""
    if ASM_ON:
        return tl.inline_asm_elementwise(
            _MMA_F16 if F16 else _MMA_BF16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    top = _frag(a0, a2, NW, F16)  # A rows g
    bot = _frag(a1, a3, NW, F16)  # A rows g + 8
    a = tl.reshape(tl.permute(tl.join(top, bot), (0, 3, 1, 2)), [NW, 16, 16])
    bt = _frag(b0, b1, NW, F16)  # [NW, 8 (n), 16 (k)]
    d = tl.sum(a[:, :, None, :] * bt[:, None, :, :], axis=3)  # [NW, 16, 8]
    d = tl.permute(tl.reshape(d, [NW, 2, 8, 4, 2]), (0, 2, 3, 1, 4))  # [NW, g, c, h, e]
    e0, e1 = tl.split(tl.reshape(d, [NW * 32, 2, 2]))  # e0: [.., h] at column 2c
    d0, d2 = tl.split(e0)
    d1, d3 = tl.split(e1)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@triton.jit
def _x_pairs(xp, ASM_ON: tl.constexpr):
    """One lane's 32 activations of a step (four 16-byte loads) -> 16 B pairs: for word i,
    (x[8i+j], x[8i+j+4]) for j = 0..3."""
    r0, r1, r2, r3 = _ld4(xp, ASM_ON, True)
    q0, q1 = _prmt(r0, r2, ASM_ON)
    q2, q3 = _prmt(r1, r3, ASM_ON)
    r0, r1, r2, r3 = _ld4(xp + 4, ASM_ON, True)
    q4, q5 = _prmt(r0, r2, ASM_ON)
    q6, q7 = _prmt(r1, r3, ASM_ON)
    r0, r1, r2, r3 = _ld4(xp + 8, ASM_ON, True)
    q8, q9 = _prmt(r0, r2, ASM_ON)
    q10, q11 = _prmt(r1, r3, ASM_ON)
    r0, r1, r2, r3 = _ld4(xp + 12, ASM_ON, True)
    q12, q13 = _prmt(r0, r2, ASM_ON)
    q14, q15 = _prmt(r1, r3, ASM_ON)
    return q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15


@triton.jit
def _word_mma(wa, wb, sa, sb, xa, xb, xc, xd, ya, yb, yc, yd, c0, c1, c2, c3, e0, e1, e2, e3,
              NB: tl.constexpr, NW: tl.constexpr, F16: tl.constexpr,
              ASM_ON: tl.constexpr):  # fmt: skip
    """One word of each of the lane's two rows: two mma k-tiles per batch tile. x*: the four
    activation pairs of this word for batch tile 0, y*: for tile 1."""
    p0, p1, p2, p3 = _unpack(wa, sa, F16, ASM_ON)
    q0, q1, q2, q3 = _unpack(wb, sb, F16, ASM_ON)
    c0, c1, c2, c3 = _mma(p0, q0, p1, q1, xa, xb, c0, c1, c2, c3, NW, F16, ASM_ON)
    c0, c1, c2, c3 = _mma(p2, q2, p3, q3, xc, xd, c0, c1, c2, c3, NW, F16, ASM_ON)
    if NB == 2:
        e0, e1, e2, e3 = _mma(p0, q0, p1, q1, ya, yb, e0, e1, e2, e3, NW, F16, ASM_ON)
        e0, e1, e2, e3 = _mma(p2, q2, p3, q3, yc, yd, e0, e1, e2, e3, NW, F16, ASM_ON)
    return c0, c1, c2, c3, e0, e1, e2, e3


@triton.jit
def _xs(xp0, xp1, NB: tl.constexpr, ASM_ON: tl.constexpr):
    """A step's activation pairs of both batch tiles (tile 1's are tile 0's when NB == 1)."""
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x_pairs(xp0, ASM_ON)
    if NB == 2:
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _x_pairs(
            xp1, ASM_ON)  # fmt: skip
    else:
        y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
        y8, y9, y10, y11, y12, y13, y14, y15 = x8, x9, x10, x11, x12, x13, x14, x15
    return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)  # fmt: skip


@triton.jit
def _step(a0, a1, a2, a3, b0, b1, b2, b3, s_ptr, ra, rb, G, grp,
          x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
          y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
          c0, c1, c2, c3, e0, e1, e2, e3, NB: tl.constexpr, NW: tl.constexpr,
          F16: tl.constexpr, ASM_ON: tl.constexpr):  # fmt: skip
    """One 16-row tile's 128-element K step: the lane's 4 words of each of its two rows (a*,
    b*), their scales and the step's activation pairs (x*: batch tile 0, y*: tile 1)."""
    sa = _scale_pair(s_ptr, ra * G + grp, F16)
    sb = _scale_pair(s_ptr, rb * G + grp, F16)
    c0, c1, c2, c3, e0, e1, e2, e3 = _word_mma(
        a0, b0, sa, sb, x0, x1, x2, x3, y0, y1, y2, y3, c0, c1, c2, c3, e0, e1, e2, e3, NB, NW,
        F16, ASM_ON)  # fmt: skip
    c0, c1, c2, c3, e0, e1, e2, e3 = _word_mma(
        a1, b1, sa, sb, x4, x5, x6, x7, y4, y5, y6, y7, c0, c1, c2, c3, e0, e1, e2, e3, NB, NW,
        F16, ASM_ON)  # fmt: skip
    c0, c1, c2, c3, e0, e1, e2, e3 = _word_mma(
        a2, b2, sa, sb, x8, x9, x10, x11, y8, y9, y10, y11, c0, c1, c2, c3, e0, e1, e2, e3, NB,
        NW, F16, ASM_ON)  # fmt: skip
    c0, c1, c2, c3, e0, e1, e2, e3 = _word_mma(
        a3, b3, sa, sb, x12, x13, x14, x15, y12, y13, y14, y15, c0, c1, c2, c3, e0, e1, e2, e3,
        NB, NW, F16, ASM_ON)  # fmt: skip
    return c0, c1, c2, c3, e0, e1, e2, e3


@triton.jit
def _ksum(v, NWK: tl.constexpr, NWN: tl.constexpr):
    """Sum the K-slice warps' partials: [NWK * NWN * 32] -> [NWN * 32], in warp order."""
    if NWK == 1:
        return v
    return tl.sum(tl.reshape(v, [NWK, NWN * 32]), axis=0)


@triton.jit
def _store_tile(d0, d1, d2, d3, b: tl.constexpr, r0, g_out, c, M, N, y_ptr, stride_ym, aux_ptr,
                stride_am, EPI: tl.constexpr):  # fmt: skip
    """Write one batch tile: lane holds rows r0 (d0, d1) and r0 + 1 (d2, d3) at batch columns
    b*8 + 2c and + 1. EPI 1: r0 is a gate row, r0 + 1 its up row, output row g_out."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    m0 = b * 8 + 2 * c
    m1 = m0 + 1
    ok = r0 < N
    if EPI == 1:
        a0 = round_to(round_to(gelu_tanh(round_to(d0, DT)), DT) * round_to(d2, DT), DT)
        a1 = round_to(round_to(gelu_tanh(round_to(d1, DT)), DT) * round_to(d3, DT), DT)
        tl.store(y_ptr + m0 * stride_ym + g_out, a0, mask=ok & (m0 < M))
        tl.store(y_ptr + m1 * stride_ym + g_out, a1, mask=ok & (m1 < M))
    else:
        ok1 = (r0 + 1) < N
        if EPI == 2:
            u0 = tl.load(aux_ptr + m0 * stride_am + r0, mask=ok & (m0 < M), other=0.0)
            u1 = tl.load(aux_ptr + m1 * stride_am + r0, mask=ok & (m1 < M), other=0.0)
            u2 = tl.load(aux_ptr + m0 * stride_am + r0 + 1, mask=ok1 & (m0 < M), other=0.0)
            u3 = tl.load(aux_ptr + m1 * stride_am + r0 + 1, mask=ok1 & (m1 < M), other=0.0)
            d0 = round_to(round_to(gelu_tanh(round_to(d0, DT)), DT) * u0.to(tl.float32), DT)
            d1 = round_to(round_to(gelu_tanh(round_to(d1, DT)), DT) * u1.to(tl.float32), DT)
            d2 = round_to(round_to(gelu_tanh(round_to(d2, DT)), DT) * u2.to(tl.float32), DT)
            d3 = round_to(round_to(gelu_tanh(round_to(d3, DT)), DT) * u3.to(tl.float32), DT)
        tl.store(y_ptr + m0 * stride_ym + r0, d0.to(DT), mask=ok & (m0 < M))
        tl.store(y_ptr + m1 * stride_ym + r0, d1.to(DT), mask=ok & (m1 < M))
        tl.store(y_ptr + m0 * stride_ym + r0 + 1, d2.to(DT), mask=ok1 & (m0 < M))
        tl.store(y_ptr + m1 * stride_ym + r0 + 1, d3.to(DT), mask=ok1 & (m1 < M))


@triton.jit
def _tile_rows(pid, wn, g, t, N, NWN: tl.constexpr, MT: tl.constexpr):
    """Weight rows of a lane in 16-row tile t of its warp: 2g and 2g + 1 (clamped to N)."""
    n0 = ((pid * NWN + wn) * MT + t) * 16
    return tl.minimum(n0 + 2 * g, N - 1), tl.minimum(n0 + 2 * g + 1, N - 1)


@triton.jit
def _store(c0, c1, c2, c3, e0, e1, e2, e3, t, M, N, y_ptr, stride_ym, aux_ptr, stride_am,
           NWN: tl.constexpr, NWK: tl.constexpr, MT: tl.constexpr, NB: tl.constexpr,
           EPI: tl.constexpr):  # fmt: skip
    """Sum the K-slice warps and write tile t of every N warp."""
    j = tl.arange(0, NWN * 32)
    lo = j % 32
    tile = (tl.program_id(0) * NWN + j // 32) * MT + t
    r0 = tile * 16 + 2 * (lo // 4)
    g_out = tile * 8 + lo // 4
    cc = lo % 4
    _store_tile(_ksum(c0, NWK, NWN), _ksum(c1, NWK, NWN), _ksum(c2, NWK, NWN),
                _ksum(c3, NWK, NWN), 0, r0, g_out, cc, M, N, y_ptr, stride_ym, aux_ptr,
                stride_am, EPI)  # fmt: skip
    if NB == 2:
        _store_tile(_ksum(e0, NWK, NWN), _ksum(e1, NWK, NWN), _ksum(e2, NWK, NWN),
                    _ksum(e3, NWK, NWN), 1, r0, g_out, cc, M, N, y_ptr, stride_ym, aux_ptr,
                    stride_am, EPI)  # fmt: skip


@triton.jit
def _w4_mma_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, aux_ptr, h_ptr, wp_ptr, sc_ptr, wn_ptr, xo_ptr, tk_ptr,
    M, N, KW, G, STEPS, stride_xm, stride_ym, stride_am, eps,
    NWN: tl.constexpr, NWK: tl.constexpr, NB: tl.constexpr, EPI: tl.constexpr,
    F16: tl.constexpr, ASM_ON: tl.constexpr, MT: tl.constexpr = 1, RES: tl.constexpr = False,
    HAS_SCALAR: tl.constexpr = False, HAS_NEXT: tl.constexpr = False, RB: tl.constexpr = 1,
    BLOCK_D: tl.constexpr = 16, SPREAD: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """EPI 0: Y = X W^T. 1: rows interleaved (gate, up) -> gelu_tanh(gate) * up, [M, N/2].
    2: gelu_tanh(Y) * aux. STEPS: 128-element K steps per warp (K = 128 * STEPS * NWK). MT: 16-row
    tiles per warp (2: each step's activation pairs serve twice the weights). RES (EPI 0): the
    residual+norm over Y after the stores (engine/kernels/w4mma_residual.py).

    x is read as int32 pairs of 16-bit values (x_ptr: the same memory as int32, stride_xm in
    int32 words)."""
    NW: tl.constexpr = NWN * NWK
    i = tl.arange(0, NW * 32)
    lane = i % 32
    wn = (i // 32) % NWN
    wk = (i // 32) // NWN
    g = lane // 4
    c = lane % 4
    pid = tl.program_id(0)
    ra, rb = _tile_rows(pid, wn, g, 0, N, NWN, MT)  # the lane's rows (mma rows g, g + 8)
    rc, rd = _tile_rows(pid, wn, g, MT - 1, N, NWN, MT)  # tile 1's (tile 0's again if MT == 1)
    s_begin = wk * STEPS
    kw = s_begin * 16 + 4 * c
    wpa = w_ptr + ra.to(tl.int64) * KW + kw
    wpb = w_ptr + rb.to(tl.int64) * KW + kw
    wpc = w_ptr + rc.to(tl.int64) * KW + kw
    wpd = w_ptr + rd.to(tl.int64) * KW + kw
    xpa = x_ptr + tl.minimum(g, M - 1) * stride_xm + s_begin * 64 + 16 * c  # batch row g
    xpb = x_ptr + tl.minimum(8 + g, M - 1) * stride_xm + s_begin * 64 + 16 * c  # and 8 + g
    c0 = tl.zeros([NW * 32], dtype=tl.float32)
    c1, c2, c3, e0, e1, e2, e3 = c0, c0, c0, c0, c0, c0, c0
    f0, f1, f2, f3, h0, h1, h2, h3 = c0, c0, c0, c0, c0, c0, c0, c0  # tile 1's accumulators
    a0, a1, a2, a3 = _ld4(wpa, ASM_ON)
    b0, b1, b2, b3 = _ld4(wpb, ASM_ON)
    if MT == 2:
        u0, u1, u2, u3 = _ld4(wpc, ASM_ON)
        v0, v1, v2, v3 = _ld4(wpd, ASM_ON)
    else:
        u0, u1, u2, u3 = a0, a1, a2, a3
        v0, v1, v2, v3 = b0, b1, b2, b3
    wait_inputs(PDL)  # the first step's weights are on their way before the wait
    for s in range(0, STEPS):  # the next step's words are requested before this step's math
        sn = tl.minimum(s + 1, STEPS - 1) * 16  # the last step re-requests itself (from L1)
        na0, na1, na2, na3 = _ld4(wpa + sn, ASM_ON)
        nb0, nb1, nb2, nb3 = _ld4(wpb + sn, ASM_ON)
        if MT == 2:
            nu0, nu1, nu2, nu3 = _ld4(wpc + sn, ASM_ON)
            nv0, nv1, nv2, nv3 = _ld4(wpd + sn, ASM_ON)
        else:
            nu0, nu1, nu2, nu3 = na0, na1, na2, na3
            nv0, nv1, nv2, nv3 = nb0, nb1, nb2, nb3
        grp = (s_begin + s) * 4 + c
        (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
         y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15) = _xs(
            xpa + s * 64, xpb + s * 64, NB, ASM_ON)  # fmt: skip
        c0, c1, c2, c3, e0, e1, e2, e3 = _step(
            a0, a1, a2, a3, b0, b1, b2, b3, s_ptr, ra, rb, G, grp,
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
            c0, c1, c2, c3, e0, e1, e2, e3, NB, NW, F16, ASM_ON)  # fmt: skip
        if MT == 2:
            f0, f1, f2, f3, h0, h1, h2, h3 = _step(
                u0, u1, u2, u3, v0, v1, v2, v3, s_ptr, rc, rd, G, grp,
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                f0, f1, f2, f3, h0, h1, h2, h3, NB, NW, F16, ASM_ON)  # fmt: skip
        a0, a1, a2, a3 = na0, na1, na2, na3
        b0, b1, b2, b3 = nb0, nb1, nb2, nb3
        u0, u1, u2, u3 = nu0, nu1, nu2, nu3
        v0, v1, v2, v3 = nv0, nv1, nv2, nv3
    _store(c0, c1, c2, c3, e0, e1, e2, e3, 0, M, N, y_ptr, stride_ym, aux_ptr, stride_am, NWN,
           NWK, MT, NB, EPI)  # fmt: skip
    if MT == 2:
        _store(f0, f1, f2, f3, h0, h1, h2, h3, 1, M, N, y_ptr, stride_ym, aux_ptr, stride_am,
               NWN, NWK, MT, NB, EPI)  # fmt: skip
    if RES:
        residual_tail(y_ptr, h_ptr, wp_ptr, sc_ptr, wn_ptr, xo_ptr, tk_ptr, M, N, stride_ym, eps,
                      HAS_SCALAR, HAS_NEXT, RB, BLOCK_D, SPREAD)  # fmt: skip


def asm_on(device: torch.device) -> bool:
    return ASM["ok"] and device.type == "cuda" and not triton_interpreted()


def mma_ok(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether this kernel takes the product: 16-bit activations, K a multiple of 128, every
    16-byte load aligned, and mma.sync m16n8k16 (sm_80 on) or the interpreter."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[1] % 128:
        return False
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return False
    if packed.stride(1) != 1 or packed.stride(0) % 4 or packed.data_ptr() % 16:
        return False
    if scales.stride(1) != 1:
        return False
    if triton_interpreted():
        return True
    if x.device.type != "cuda" or torch.version.hip is not None:
        return False
    return _has_mma_sync(x.device.index if x.device.index is not None else 0)


@functools.cache
def _has_mma_sync(device_index: int) -> bool:
    """mma.sync m16n8k16 with bf16: sm_80 on (asked once per device, not per product)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, y: torch.Tensor,
           cfg: dict[str, Any], epi: int = 0, aux: torch.Tensor | None = None,
           res: ResidualFold | None = None) -> None:  # fmt: skip
    """One launch on checked operands (`mma_ok`); y [M, N] (or [M, N/2] for epi 1). res (epi
    0, y contiguous): the residual+norm folded in after the stores (cfg "RB": the serial tail's
    rows at once)."""
    m, k = x.shape
    n = packed.shape[0]
    nwn, nwk = cfg["NWN"], cfg["NWK"]
    steps = k // 128
    if steps % nwk:
        raise ValueError(f"w4mma: NWK={nwk} does not divide the {steps} K steps of K={k}")
    if not 1 <= m <= 16:
        raise ValueError(f"w4mma: 1..16 activation rows, got {m}")
    x32 = x.view(torch.int32)
    mt = cfg.get("MT", 1)
    grid = (triton.cdiv(n, 16 * nwn * mt),)
    if res is not None:
        if epi != 0 or not y.is_contiguous():
            raise ValueError("w4mma: the residual fold takes epilogue 0 into a contiguous y")
        res.check(*y.shape, y.dtype)
    fold = res.kernel_args(y) if res is not None else (y, y, y, y, y, y, 0.0)
    run_kernel(_w4_mma_kernel, grid,
        x32, packed, scales, y, aux if aux is not None else y, *fold[:6],
        m, n, packed.stride(0), scales.stride(0), steps // nwk, x32.stride(0), y.stride(0),
        aux.stride(0) if aux is not None else 0, fold[6],
        NWN=nwn, NWK=nwk, NB=1 if m <= 8 else 2, EPI=epi, F16=x.dtype == torch.float16,
        ASM_ON=asm_on(x.device), MT=mt, RES=res is not None,
        HAS_SCALAR=res is not None and res.scalar is not None,
        HAS_NEXT=res is not None and res.w_next is not None,
        RB=(cfg.get("RB") or rows_per_chunk(m, n, nwn * nwk)) if res is not None else 1,
        BLOCK_D=triton.next_power_of_2(n) if res is not None else 16,
        SPREAD=res is not None and spread_ok(grid[0], x.device),
        num_warps=nwn * nwk, num_stages=1,
    )  # fmt: skip
