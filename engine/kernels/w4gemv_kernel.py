"""The int4 GEMV kernel itself (Triton): y = x @ dequant(W).T straight from the packed words.

Here: the kernel, its launch and the default tiling. The Python API is engine/kernels/w4gemv.py;
tile tuning engine/kernels/w4gemv_tune.py (stored through engine/kernels/tuning.py).

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

from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels.fused import gelu_tanh, inv_rms, round_to, scale_w
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs
from engine.options import triton_interpreted

KERNEL_NAME = "w4gemv"
KERNEL_VERSION = 5  # bump when the kernel changes: stored tilings of older versions are ignored
ASM_MEMO = {"ok": True}  # cleared if the inline-PTX variant ever fails to build on this machine


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
        h = round_to(h + scale_w(y, inv1, pwp_ptr, off, m, True, DT), DT)
        if PRO_SCALAR:
            h = round_to(h * sc, DT)
        if PRO_NEXT:
            h = scale_w(h, inv2, pwn_ptr, off, m, True, DT)
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
    w, s = ws_loads(w_ptrs, s_ptrs, rk, kw0, KW, EVEN_K)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_loads(x_ptr, rk, kw0, KW, EVEN_K, PRO, py_ptr, ph_ptr,
                                              pwp_ptr, pwn_ptr, inv1, inv2, sc, PRO_SCALAR,
                                              PRO_NEXT, DT)  # fmt: skip
    return w, s, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def ws_loads(w_ptrs, s_ptrs, rk, kw0, KW, EVEN_K: tl.constexpr):
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
    inv1 = inv_rms(y, m, K, eps)
    h = tl.load(ph_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = round_to(h + scale_w(y, inv1, pwp_ptr, offs, m, True, DT), DT)
    if PRO_SCALAR:
        sc = tl.load(psc_ptr).to(tl.float32)
        h = round_to(h * sc, DT)
    else:
        sc = 1.0
    tl.store(ph_out_ptr + offs, h.to(ph_out_ptr.dtype.element_ty), mask=m & write)
    if PRO_NEXT:  # noqa: SIM108 - a constexpr branch
        inv2 = inv_rms(h, m, K, eps)
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
def tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2: tl.constexpr,
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
    aux_ptr, stride_am, eps, py_ptr, ph_ptr, pwp_ptr, psc_ptr, pwn_ptr, ph_out_ptr,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr = False, EPI: tl.constexpr = 0, H2: tl.constexpr = False,
    PIPE: tl.constexpr = True, PRO: tl.constexpr = False, PRO_SCALAR: tl.constexpr = False,
    PRO_NEXT: tl.constexpr = False, BLOCK_P: tl.constexpr = 16,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """EPI 0: y = x W^T. 1: GLU over interleaved (gate, up) rows -> gelu(gate) * up, N/2 wide.
    2: gelu(y) * aux[row]. Intermediates round where the reference rounds.

    PRO: the activations are not read from x but made from the previous GEMV's output y (py),
    the residual h (ph) and the norm weights, as `residual_norm` makes them; every program
    computes the two norms of its row itself and the row's program 0 writes h' (ph_out, never
    ph: the other programs still read it). Rows are K apart in py, ph and ph_out. One launch
    fewer per residual+norm in the decode step."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PRO:  # this program's row of the residual stream
        py_ptr += pid_m * K
        ph_ptr += pid_m * K
        ph_out_ptr += pid_m * K
    # KW (= K/8 words) and G (= K/32 scales) come as arguments, not K // 8: Triton then knows
    # their divisibility and loads 16 bytes of a row at a time
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
    w, s = ws_loads(w_ptrs, s_ptrs, rk, 0, KW, EVEN_K)
    wait_inputs(PDL)  # the first step's weights are on their way before the wait
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
            acc = tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)
        else:
            acc = tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)
            nw, ns, n0, n1, n2, n3, n4, n5, n6, n7 = _tile_loads(
                w_ptrs, s_ptrs, xm_ptr, rk, kn, KW, BLOCK_KW, EVEN_K, PRO, py_ptr, ph_ptr, pwp_ptr,
                pwn_ptr, inv1, inv2, sc, PRO_SCALAR, PRO_NEXT, DTA)  # fmt: skip
        w, s, x0, x1, x2, x3, x4, x5, x6, x7 = nw, ns, n0, n1, n2, n3, n4, n5, n6, n7
    acc = tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)  # the last step
    y = tl.sum(acc, axis=1)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    if EPI == 1:
        g, u = tl.split(tl.reshape(round_to(y, DT), [BLOCK_N // 2, 2]))
        act = round_to(round_to(gelu_tanh(g), DT) * u, DT)
        rp = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + pid_m * stride_ym + rp, act, mask=rp < N // 2)
    elif EPI == 2:
        a = tl.load(aux_ptr + pid_m * stride_am + rn, mask=n_mask, other=0.0).to(tl.float32)
        out = round_to(round_to(gelu_tanh(round_to(y, DT)), DT) * a, DT)
        tl.store(y_ptr + pid_m * stride_ym + rn, out, mask=n_mask)
    else:
        tl.store(y_ptr + pid_m * stride_ym + rn, y.to(DT), mask=n_mask)


def shape_key(n: int, k: int, dtype: torch.dtype, m: int, h2: bool = False) -> str:
    key = f"v{KERNEL_VERSION}_N{n}_K{k}_{str(dtype).removeprefix('torch.')}_M{min(m, 4)}"
    return key + ("_h2" if h2 else "")


def asm_on(device: torch.device) -> bool:
    """The inline-PTX lop3 runs on NVIDIA GPUs only (not in the CPU interpreter)."""
    return (
        ASM_MEMO["ok"]
        and device.type == "cuda"
        and torch.version.hip is None
        and not triton_interpreted()
    )


def h2_on(dtype: torch.dtype, device: torch.device, half2: bool = True) -> bool:
    """Half2 arithmetic for 16-bit activations on NVIDIA GPUs unless `half2` is False (the exact
    fp32 unpack, the tests' and the lab's reference). fp32 models keep the exact fp32 unpack:
    their fast path equals the reference token for token."""
    return half2 and dtype in (torch.float16, torch.bfloat16) and asm_on(device)


def launch(x2, packed, scales, y, cfg: dict[str, Any], epi: int = 0, aux=None,
           eps: float = 1e-6, pro: tuple | None = None, half2: bool = True) -> None:  # fmt: skip
    """One launch of the kernel on prepared (2-D, contiguous-row) operands."""
    m, k = x2.shape
    n = packed.shape[0]
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), m)
    # pro: (y, h, w_post, scalar, w_next, h_out) of the residual+norm made in the prologue
    py, ph, pwp, psc, pwn, ph_out = pro if pro is not None else (y,) * 6
    # aux: one row for every activation row (1-D), or a row each ([M, N], any row stride)
    stride_am = aux.stride(0) if aux is not None and aux.dim() == 2 else 0
    run_kernel(_w4_gemv_kernel, grid,
        x2, packed, scales, y, n, k, k // 8, k // 32, x2.stride(0), y.stride(0),
        aux if aux is not None else y, stride_am, eps,
        py, ph, pwp, psc if psc is not None else py, pwn if pwn is not None else py, ph_out,
        PRO=pro is not None, PRO_SCALAR=psc is not None and pro is not None,
        PRO_NEXT=pwn is not None and pro is not None,
        BLOCK_P=triton.next_power_of_2(max(k, 16)) if pro is not None else 16,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=cfg["BLOCK_KW"], PIPE=cfg.get("PIPE", True),
        EVEN_K=(k // 8) % cfg["BLOCK_KW"] == 0, USE_ASM=asm_on(x2.device), EPI=epi,
        H2=h2_on(x2.dtype, x2.device, half2), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip


def default_config(n: int, k: int) -> dict[str, Any]:
    """A reasonable tiling when nothing is tuned (CPU interpreter, capture, tuning off)."""
    kw = k // 8
    if n >= 4096 and kw >= 64:  # several rows per thread: the activations are reused
        return {"BLOCK_N": 8, "BLOCK_KW": 64, "num_warps": 2, "num_stages": 2, "PIPE": True}
    block_kw = 256 if kw >= 256 else triton.next_power_of_2(max(kw, 16))
    return {"BLOCK_N": 4, "BLOCK_KW": block_kw, "num_warps": 4, "num_stages": 2, "PIPE": True}
