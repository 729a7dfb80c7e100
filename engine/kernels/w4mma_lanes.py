"""The lane-level pieces of the warp-level int4 product (engine/kernels/w4mma_kernel.py, whose
docstring gives the operand mapping): every tensor holds one element per thread, so each
helper works on one lane's registers. The 16-byte loads, the unpack of a word into four
(code - 8) * scale pairs, `prmt` and `mma.sync.m16n8k16` are inline PTX on the GPU and tl ops
under the CPU interpreter (ASM_ON False), where the mma is rebuilt from the lanes' fragments."""

from __future__ import annotations

import triton
import triton.language as tl

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
def ld4(ptr, ASM_ON: tl.constexpr, X: tl.constexpr = False):
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
def scale_pair(s, F16: tl.constexpr):
    """A loaded group scale in the activations' 16-bit type, in both halves of an int32."""
    b = _bits16(s.to(tl.float32), F16)
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
def _x_words(xp, ASM_ON: tl.constexpr):
    """One lane's 32 activations of a step as loaded (four 16-byte loads): 16 words."""
    r0, r1, r2, r3 = ld4(xp, ASM_ON, True)
    r4, r5, r6, r7 = ld4(xp + 4, ASM_ON, True)
    r8, r9, r10, r11 = ld4(xp + 8, ASM_ON, True)
    r12, r13, r14, r15 = ld4(xp + 12, ASM_ON, True)
    return r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15


@triton.jit
def _x_pairs(r, ASM_ON: tl.constexpr):
    """A step's 16 loaded activation words -> 16 B pairs: for word i, (x[8i+j], x[8i+j+4]) for
    j = 0..3."""
    q0, q1 = _prmt(r[0], r[2], ASM_ON)
    q2, q3 = _prmt(r[1], r[3], ASM_ON)
    q4, q5 = _prmt(r[4], r[6], ASM_ON)
    q6, q7 = _prmt(r[5], r[7], ASM_ON)
    q8, q9 = _prmt(r[8], r[10], ASM_ON)
    q10, q11 = _prmt(r[9], r[11], ASM_ON)
    q12, q13 = _prmt(r[12], r[14], ASM_ON)
    q14, q15 = _prmt(r[13], r[15], ASM_ON)
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
def xs_words(xp0, xp1, NB: tl.constexpr, ASM_ON: tl.constexpr):
    """A step's activation words of both batch tiles, as loaded (tile 1's are tile 0's when
    NB == 1): requested apart from their use, so a step can ask for the next step's."""
    rx = _x_words(xp0, ASM_ON)
    if NB == 2:  # noqa: SIM108 - a constexpr branch
        ry = _x_words(xp1, ASM_ON)
    else:
        ry = rx
    return rx, ry


@triton.jit
def xs(rx, ry, NB: tl.constexpr, ASM_ON: tl.constexpr):
    """A step's activation pairs of both batch tiles from their loaded words (`xs_words`)."""
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x_pairs(rx, ASM_ON)
    if NB == 2:
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _x_pairs(
            ry, ASM_ON)  # fmt: skip
    else:
        y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
        y8, y9, y10, y11, y12, y13, y14, y15 = x8, x9, x10, x11, x12, x13, x14, x15
    return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)  # fmt: skip


@triton.jit
def step_tile(wa, wb, scale_a, scale_b, x, acc, NB: tl.constexpr, NW: tl.constexpr,
              F16: tl.constexpr, ASM_ON: tl.constexpr):  # fmt: skip
    """One 16-row tile's 128-element K step: the lane's 4 words of each of its two rows (wa,
    wb), their loaded group scales, the step's 32 activation pairs (`xs`: 16 of batch tile 0,
    16 of tile 1) and the 8 accumulators (c0..c3 of tile 0, e0..e3 of tile 1)."""
    sa = scale_pair(scale_a, F16)
    sb = scale_pair(scale_b, F16)
    for j in tl.static_range(4):  # word j: activation pairs 4j..4j+3 of each batch tile
        acc = _word_mma(wa[j], wb[j], sa, sb, x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3],
                        x[16 + 4 * j], x[17 + 4 * j], x[18 + 4 * j], x[19 + 4 * j], acc[0],
                        acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], NB, NW, F16,
                        ASM_ON)  # fmt: skip
    return acc
