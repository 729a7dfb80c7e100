"""The int4 few-row product on the tensor cores with the operands built in registers (Triton,
warp-level): Y[M, N] = X[M, K] @ dequant(W).T for M = 1..16 bf16 or fp16 rows, sm_80 on.

Here: the kernel and its launch (its lane-level pieces, the PTX: engine/kernels/w4mma_lanes.py;
the tilings: engine/kernels/w4mma_tune.py; measured on the H200:
lab/journal.md, v13); the Python API is engine/kernels/w4gemm.py,
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
from engine.kernels.w4mma_lanes import ld4, step_tile, xs, xs_words
from engine.options import triton_interpreted


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
def _w_words(wpa, wpb, wpc, wpd, off, MT: tl.constexpr, ASM_ON: tl.constexpr):
    """The lane's weight words of a step: 4 of each of its rows (tile 1's rows: MT == 2)."""
    wa = ld4(wpa + off, ASM_ON)
    wb = ld4(wpb + off, ASM_ON)
    if MT == 2:
        wu = ld4(wpc + off, ASM_ON)
        wv = ld4(wpd + off, ASM_ON)
    else:
        wu = wa
        wv = wb
    return wa, wb, wu, wv


@triton.jit
def _scales(s_ptr, ra, rb, rc, rd, G, grp, MT: tl.constexpr):
    """The group scale of each of the lane's rows at group `grp`, as loaded."""
    sa = tl.load(s_ptr + ra * G + grp)
    sb = tl.load(s_ptr + rb * G + grp)
    if MT == 2:
        sc = tl.load(s_ptr + rc * G + grp)
        sd = tl.load(s_ptr + rd * G + grp)
    else:
        sc = sa
        sd = sb
    return sa, sb, sc, sd


@triton.jit
def _tiles(wa, wb, wu, wv, sa, sb, sc, sd, rx, ry, acc, acc_t1, NB: tl.constexpr,
           NW: tl.constexpr, F16: tl.constexpr, ASM_ON: tl.constexpr, MT: tl.constexpr):  # fmt: skip
    """One K step of the warp's tiles (tile 1 when MT == 2) from loaded words and scales."""
    x = xs(rx, ry, NB, ASM_ON)
    acc = step_tile(wa, wb, sa, sb, x, acc, NB, NW, F16, ASM_ON)
    if MT == 2:
        acc_t1 = step_tile(wu, wv, sc, sd, x, acc_t1, NB, NW, F16, ASM_ON)
    return acc, acc_t1


@triton.jit
def _w4_mma_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, aux_ptr,
    M, N, KW, G, STEPS, stride_xm, stride_ym, stride_am,
    NWN: tl.constexpr, NWK: tl.constexpr, NB: tl.constexpr, EPI: tl.constexpr,
    F16: tl.constexpr, ASM_ON: tl.constexpr, MT: tl.constexpr = 1, AHEAD: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """EPI 0: Y = X W^T. 1: rows interleaved (gate, up) -> gelu_tanh(gate) * up, [M, N/2].
    2: gelu_tanh(Y) * aux. STEPS: 128-element K steps per warp (K = 128 * STEPS * NWK). MT: 16-row
    tiles per warp (2: each step's activation pairs serve twice the weights). AHEAD: a step's
    scales and activations are requested one step early with its weights (the first step's
    scales before the PDL wait), not in the step that uses them.

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
    z = tl.zeros([NW * 32], dtype=tl.float32)
    acc = (z, z, z, z, z, z, z, z)  # tile 0: c0..c3 (batch tile 0), e0..e3 (batch tile 1)
    acc_t1 = acc  # tile 1's (MT == 2)
    wa, wb, wu, wv = _w_words(wpa, wpb, wpc, wpd, 0, MT, ASM_ON)
    if AHEAD:  # the first step's scales are read-only too: requested before the wait
        sa, sb, sc, sd = _scales(s_ptr, ra, rb, rc, rd, G, s_begin * 4 + c, MT)
    wait_inputs(PDL)  # the first step's weights are on their way before the wait
    if AHEAD:
        rx, ry = xs_words(xpa, xpb, NB, ASM_ON)
    for s in range(0, STEPS):  # the next step's weights (AHEAD: all its operands) go out first
        sn = tl.minimum(s + 1, STEPS - 1)  # the last step re-requests itself (from L1)
        na, nb, nu, nv = _w_words(wpa, wpb, wpc, wpd, sn * 16, MT, ASM_ON)
        if AHEAD:
            nsa, nsb, nsc, nsd = _scales(s_ptr, ra, rb, rc, rd, G, (s_begin + sn) * 4 + c, MT)
            nrx, nry = xs_words(xpa + sn * 64, xpb + sn * 64, NB, ASM_ON)
        else:  # this step's scales and activations, in it
            sa, sb, sc, sd = _scales(s_ptr, ra, rb, rc, rd, G, (s_begin + s) * 4 + c, MT)
            rx, ry = xs_words(xpa + s * 64, xpb + s * 64, NB, ASM_ON)
        acc, acc_t1 = _tiles(wa, wb, wu, wv, sa, sb, sc, sd, rx, ry, acc, acc_t1, NB, NW, F16,
                             ASM_ON, MT)  # fmt: skip
        wa, wb, wu, wv = na, nb, nu, nv
        if AHEAD:
            sa, sb, sc, sd = nsa, nsb, nsc, nsd
            rx, ry = nrx, nry
    c0, c1, c2, c3, e0, e1, e2, e3 = acc
    f0, f1, f2, f3, h0, h1, h2, h3 = acc_t1
    _store(c0, c1, c2, c3, e0, e1, e2, e3, 0, M, N, y_ptr, stride_ym, aux_ptr, stride_am, NWN,
           NWK, MT, NB, EPI)  # fmt: skip
    if MT == 2:
        _store(f0, f1, f2, f3, h0, h1, h2, h3, 1, M, N, y_ptr, stride_ym, aux_ptr, stride_am,
               NWN, NWK, MT, NB, EPI)  # fmt: skip


def asm_on(device: torch.device) -> bool:
    return device.type == "cuda" and not triton_interpreted()


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
           ahead: bool = False) -> None:  # fmt: skip
    """One launch on checked operands (`mma_ok`); y [M, N] (or [M, N/2] for epi 1)."""
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
    run_kernel(_w4_mma_kernel, grid,
        x32, packed, scales, y, aux if aux is not None else y,
        m, n, packed.stride(0), scales.stride(0), steps // nwk, x32.stride(0), y.stride(0),
        aux.stride(0) if aux is not None else 0,
        NWN=nwn, NWK=nwk, NB=1 if m <= 8 else 2, EPI=epi, F16=x.dtype == torch.float16,
        ASM_ON=asm_on(x.device), MT=mt, AHEAD=ahead,
        num_warps=nwn * nwk, num_stages=1,
    )  # fmt: skip
