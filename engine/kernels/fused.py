"""Fused elementwise kernels of one decode step (one token): norms, residuals, RoPE, GELU.

A decode step of the reference model is ~95 small PyTorch kernels per layer (an RMSNorm alone is
eight); inside a CUDA graph each still costs a launch slot of about a microsecond, which at
35 layers is several milliseconds per token, more than all the weight reads. These kernels do
each chain in one launch.

They round where the reference rounds: every PyTorch op of the reference returns a 16-bit
tensor, so each intermediate here is rounded to the compute dtype at the same point
(`round_to`), and the results equal the reference's up to the order of the fp32 sums inside a
norm. Every kernel works on one token (T = 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs


@triton.jit
def round_to(x, DT: tl.constexpr):
    """Round fp32 to the compute dtype and back: what a 16-bit PyTorch op stores."""
    return x.to(DT).to(tl.float32)


@triton.jit
def inv_rms(x, mask, n, eps):
    """(mean(x^2) + eps)^-0.5 over the valid elements, in fp32."""
    ms = tl.sum(tl.where(mask, x * x, 0.0), axis=0) / n
    return 1.0 / tl.sqrt(ms + eps)


@triton.jit
def scale_w(x, inv, w_ptr, offs, mask, HAS_W: tl.constexpr, DT: tl.constexpr):
    y = x * inv
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(y, DT)


@triton.jit
def _rms(x, w_ptr, offs, mask, n, eps, HAS_W: tl.constexpr, DT: tl.constexpr):
    """round(x * (mean(x^2) + eps)^-0.5 [* w]) in fp32 (Gemma 4: the weight as is)."""
    return scale_w(x, inv_rms(x, mask, n, eps), w_ptr, offs, mask, HAS_W, DT)


@triton.jit
def gelu_tanh(x):
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh via exp (no libdevice needed)
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    z = tl.minimum(tl.maximum(z, -20.0), 20.0)  # tanh(+-20) is +-1 in fp32; exp stays finite
    t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _rmsnorm_rows_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps,
                         HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):  # fmt: skip
    wait_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = _rms(x, w_ptr, offs, mask, D, eps, HAS_W, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _residual_norm_kernel(
    h_ptr, y_ptr, w_post_ptr, scalar_ptr, w_next_ptr, h_out_ptr, x_out_ptr, D, eps,
    HAS_SCALAR: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """h' = round(h + rms(y) * w_post) [* scalar]; x' = rms(h') * w_next (the next norm).
    One program per row of D contiguous elements (one row when decoding)."""
    wait_inputs(PDL)
    DT: tl.constexpr = h_out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64) * D
    h_ptr = h_ptr + row
    y_ptr = y_ptr + row
    h_out_ptr = h_out_ptr + row
    x_out_ptr = x_out_ptr + row
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = round_to(h + _rms(y, w_post_ptr, offs, mask, D, eps, True, DT), DT)
    if HAS_SCALAR:
        h = round_to(h * tl.load(scalar_ptr).to(tl.float32), DT)
    tl.store(h_out_ptr + offs, h, mask=mask)
    if HAS_NEXT:
        tl.store(x_out_ptr + offs, _rms(h, w_next_ptr, offs, mask, D, eps, True, DT), mask=mask)


@triton.jit
def _gelu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, STRIDE: tl.constexpr = 1,
                     PDL: tl.constexpr = False):  # fmt: skip
    """round(round(gelu_tanh(g)) * u); g and u read every STRIDE-th element (2: pairs).
    Offsets in int64: a prompt chunk's T x 2F pair index passes 2^31 (31B: T ~ 50k)."""
    wait_inputs(PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs * STRIDE, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs * STRIDE, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, round_to(round_to(gelu_tanh(g), DT) * u, DT), mask=mask)


@triton.jit
def _rope_lanes(D: tl.constexpr):
    """A head's lanes, each lane's NeoX partner (the other half), the sign rotate_half gives
    it, and the all-true mask the norm helpers take."""
    offs = tl.arange(0, D)
    half: tl.constexpr = D // 2
    return offs, (offs + half) % D, tl.where(offs < half, -1.0, 1.0), offs < D


@triton.jit
def _norm_rope(x, xp, w_ptr, offs, partner, mask, cos, sin, sign, D: tl.constexpr, eps,
               DT: tl.constexpr):  # fmt: skip
    """One head: RMSNorm with weights, then RoPE (NeoX half split); xp is x read at the partner
    index, which shares x's norm factor."""
    inv = inv_rms(x, mask, D, eps)
    xn = scale_w(x, inv, w_ptr, offs, mask, True, DT)
    xpn = scale_w(xp, inv, w_ptr, partner, mask, True, DT)
    return round_to(round_to(xn * cos, DT) + round_to(sign * xpn * sin, DT), DT)


@triton.jit
def _write_new_kv(qkv_ptr, k_norm_ptr, cos, sin, sign, offs, partner, mask,
                  cache_k_ptr, cache_v_ptr, cache_pos_ptr, slot, pos, slots, eps,
                  HQ: tl.constexpr, D: tl.constexpr, V_FROM_K: tl.constexpr,
                  DT: tl.constexpr, DO_K: tl.constexpr, DO_V: tl.constexpr):  # fmt: skip
    """The new token's key (normed with weights, rotated) and value (normed without weight)
    into `slot` of the cache, and the slot's recorded position; never past the buffer (the
    engine stops at max_context)."""
    base = HQ * D
    ok = slot < slots
    if DO_K:
        x = tl.load(qkv_ptr + base + offs).to(tl.float32)
        xp = tl.load(qkv_ptr + base + partner).to(tl.float32)
        out = _norm_rope(x, xp, k_norm_ptr, offs, partner, mask, cos, sin, sign, D, eps, DT)
        tl.store(cache_k_ptr + slot * D + offs, out.to(cache_k_ptr.dtype.element_ty),
                 mask=mask & ok)  # fmt: skip
        tl.store(cache_pos_ptr + slot, pos.to(cache_pos_ptr.dtype.element_ty), mask=ok)
    if DO_V:
        if V_FROM_K:
            x = tl.load(qkv_ptr + base + offs).to(tl.float32)
        else:
            x = tl.load(qkv_ptr + base + D + offs).to(tl.float32)
        vn = _rms(x, k_norm_ptr, offs, mask, D, eps, False, DT)
        tl.store(cache_v_ptr + slot * D + offs, vn.to(cache_v_ptr.dtype.element_ty),
                 mask=mask & ok)  # fmt: skip


@triton.jit
def _qkv_rope_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_out_ptr,
    cache_k_ptr, cache_v_ptr, cache_pos_ptr, pos_ptr, slots, eps,
    HQ: tl.constexpr, D: tl.constexpr, OWN_KV: tl.constexpr, V_FROM_K: tl.constexpr,
    RING: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Per head: RMSNorm (q, k with weights; v without), RoPE on q and k (NeoX half split),
    and for own-KV layers the key/value written into the cache slot of this position."""
    wait_inputs(PDL)
    DT: tl.constexpr = q_out_ptr.dtype.element_ty
    head = tl.program_id(0)
    offs, partner, sign, mask = _rope_lanes(D)
    pos = tl.load(pos_ptr)
    cos = tl.load(cos_ptr + offs).to(tl.float32)
    sin = tl.load(sin_ptr + offs).to(tl.float32)
    if head < HQ:
        x = tl.load(qkv_ptr + head * D + offs).to(tl.float32)
        xp = tl.load(qkv_ptr + head * D + partner).to(tl.float32)
        out = _norm_rope(x, xp, q_norm_ptr, offs, partner, mask, cos, sin, sign, D, eps, DT)
        tl.store(q_out_ptr + head * D + offs, out)
    elif OWN_KV:
        if RING:  # noqa: SIM108 - a constexpr branch
            slot = pos % slots
        else:
            slot = pos
        if head == HQ:
            _write_new_kv(qkv_ptr, k_norm_ptr, cos, sin, sign, offs, partner, mask, cache_k_ptr,
                          cache_v_ptr, cache_pos_ptr, slot, pos, slots, eps, HQ, D, V_FROM_K,
                          DT, True, False)  # fmt: skip
        else:
            _write_new_kv(qkv_ptr, k_norm_ptr, cos, sin, sign, offs, partner, mask, cache_k_ptr,
                          cache_v_ptr, cache_pos_ptr, slot, pos, slots, eps, HQ, D, V_FROM_K,
                          DT, False, True)  # fmt: skip


@triton.jit
def _qkv_rope_rows_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    stride_row, eps, rows_ptr, HQ: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
    V_FROM_K: tl.constexpr, SCATTER: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Prompt rows: program (t, head) norms one head of row t of the q|k|v output (q and k with
    their weights, v without) and rotates q and k with row t's cos / sin, as qkv_rope does for
    one token; outputs [T, heads, D] each."""
    wait_inputs(PDL)
    DT: tl.constexpr = q_out_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs, partner, sign, mask = _rope_lanes(D)
    row = qkv_ptr + t * stride_row
    if SCATTER:  # noqa: SIM108 - constexpr; k/v go straight to the pool row (batched decode)
        kv_row = tl.load(rows_ptr + t).to(tl.int64)
    else:
        kv_row = t
    if head < HQ + KVH:
        cos = tl.load(cos_ptr + t * D + offs).to(tl.float32)
        sin = tl.load(sin_ptr + t * D + offs).to(tl.float32)
        x = tl.load(row + head * D + offs).to(tl.float32)
        xp = tl.load(row + head * D + partner).to(tl.float32)
        if head < HQ:
            out = _norm_rope(x, xp, q_norm_ptr, offs, partner, mask, cos, sin, sign, D, eps, DT)
            tl.store(q_out_ptr + (t * HQ + head) * D + offs, out)
        else:
            out = _norm_rope(x, xp, k_norm_ptr, offs, partner, mask, cos, sin, sign, D, eps, DT)
            tl.store(k_out_ptr + (kv_row * KVH + head - HQ) * D + offs, out)
    else:
        j = head - HQ - KVH
        if V_FROM_K:  # noqa: SIM108 - a constexpr branch
            src = row + (HQ + j) * D
        else:
            src = row + (HQ + KVH + j) * D
        x = tl.load(src + offs).to(tl.float32)
        tl.store(v_out_ptr + (kv_row * KVH + j) * D + offs,
                 _rms(x, k_norm_ptr, offs, mask, D, eps, False, DT))  # fmt: skip


def qkv_rope_rows(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    v_from_k: bool = False,
    kv_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt chunk's q [T, HQ, D], k and v [T, KVH, D] from the fused q|k|v output
    qkv [T, N] (rows may be strided): the reference's per-head RMSNorms and RoPE in one launch
    instead of ~16 ops. v_from_k: the layer has no v_proj, its values are its raw keys.
    kv_out (k_pool, v_pool [R, KVH, D] contiguous, rows int64 [T]): k and v of row t are
    written to row rows[t] of the pools instead (a batched decode step writing its KV cache;
    two index copies fewer per layer); the returned k and v are then the pools."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or cos.shape != (t, head_dim) or not cos.is_contiguous():
        raise ValueError("qkv_rope_rows: qkv rows must be contiguous inside, cos/sin [T, D]")
    if sin.shape != cos.shape:
        raise ValueError("qkv_rope_rows: cos/sin must both be [T, D]")
    width = (num_heads + kv_heads * (1 if v_from_k else 2)) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:  # the kernel reads `width` columns of each row
        raise ValueError(
            f"qkv_rope_rows: qkv width {tuple(qkv.shape)[1:]} is not the heads' {width} "
            f"(v_from_k={v_from_k})"
        )
    q = torch.empty(t, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    if kv_out is not None:
        k, v, rows = kv_out
        if not (k.is_contiguous() and v.is_contiguous() and k.dtype == qkv.dtype == v.dtype):
            raise ValueError("qkv_rope_rows: kv_out pools must be contiguous, in qkv's dtype")
    else:
        k = torch.empty(t, kv_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
        v = torch.empty_like(k)
        rows = q
    if t:
        run_kernel(_qkv_rope_rows_kernel, (t, num_heads + 2 * kv_heads),
            qkv, q_norm, k_norm, cos, sin.contiguous(), q, k, v, qkv.stride(0), eps, rows,
            HQ=num_heads, KVH=kv_heads, D=head_dim, V_FROM_K=v_from_k,
            SCATTER=kv_out is not None, num_warps=_warps(head_dim),
        )  # fmt: skip
    return q, k, v


@triton.jit
def _ple_mix_kernel(proj_ptr, tok_ptr, w_ptr, out_ptr, P, eps, c_proj, c_mix,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Per layer l: round(round(rms(round(proj*c_proj)) * w + tok) * c_mix) (the PLE input)."""
    wait_inputs(PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < P
    p = round_to(tl.load(proj_ptr + row * P + offs, mask=mask, other=0.0).to(tl.float32) * c_proj,
               DT)  # fmt: skip
    n = _rms(p, w_ptr, offs, mask, P, eps, True, DT)
    t = tl.load(tok_ptr + row * P + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * P + offs, round_to(round_to(n + t, DT) * c_mix, DT), mask=mask)


# ---- launchers -------------------------------------------------------------------------------
def _block(n: int) -> int:
    return triton.next_power_of_2(max(n, 16))


def _warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 2 if n >= 256 else 1


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """RMSNorm of every row of x [R, D] (weight [D] or None), as ops.rms_norm rounds it."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    out = torch.empty_like(x2) if out is None else out.view(-1, d)
    run_kernel(_rmsnorm_rows_kernel, (x2.shape[0],),
        x2, weight if weight is not None else x2, out, d, x2.stride(0), out.stride(0), eps,
        HAS_W=weight is not None, BLOCK=_block(d), num_warps=_warps(d),
    )  # fmt: skip
    return out.view(x.shape)


def residual_norm(
    h: torch.Tensor,
    y: torch.Tensor,
    w_post: torch.Tensor,
    eps: float,
    scalar: torch.Tensor | None = None,
    w_next: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h' = h + rms_norm(y, w_post) [then * scalar]; also rms_norm(h', w_next) when given.
    Row by row over [..., D] (contiguous). h_out may be h itself (each row's program reads its
    row before it writes)."""
    d = h.shape[-1]
    if not (h.is_contiguous() and y.is_contiguous() and y.numel() == h.numel()):
        raise ValueError("residual_norm: h and y must be contiguous and of the same size")
    if h_out is not None and not (
        h_out.is_contiguous() and h_out.numel() == h.numel() and h_out.dtype == h.dtype
    ):  # each row's program writes D elements at row * D of h_out
        raise ValueError("residual_norm: h_out must be contiguous, of h's size and dtype")
    h_out = torch.empty_like(h) if h_out is None else h_out
    x_out = torch.empty_like(h) if w_next is not None else None
    run_kernel(_residual_norm_kernel, (h.numel() // d,),
        h, y, w_post, scalar if scalar is not None else w_post,
        w_next if w_next is not None else w_post, h_out, x_out if x_out is not None else h_out,
        d, eps, HAS_SCALAR=scalar is not None, HAS_NEXT=w_next is not None,
        BLOCK=_block(d), num_warps=_warps(d),
    )  # fmt: skip
    return h_out, x_out


def gelu_mul(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(g) * u, rounded as the reference rounds (g, u: same number of elements)."""
    out = torch.empty_like(g) if out is None else out
    return _launch_gelu_mul(g, u, out, stride=1)


def _launch_gelu_mul(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor, stride: int):
    """One launch of _gelu_mul_kernel over out's elements (g, u read every stride-th one)."""
    n = out.numel()
    block = 1024
    run_kernel(
        _gelu_mul_kernel,
        (triton.cdiv(n, block),),
        g,
        u,
        out,
        n,
        BLOCK=block,
        STRIDE=stride,
        num_warps=4,
    )
    return out


def gelu_mul_pairs(gu: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up from interleaved pairs (gate at even, up at odd columns of
    gu [..., 2F], the fused gate|up matrix's output) -> [..., F], rounded as gelu_mul."""
    if not gu.is_contiguous() or gu.shape[-1] % 2:
        raise ValueError("gelu_mul_pairs: gu must be contiguous with an even last dimension")
    out = torch.empty(*gu.shape[:-1], gu.shape[-1] // 2, device=gu.device, dtype=gu.dtype)
    return _launch_gelu_mul(gu, gu[..., 1:], out, stride=2)


def qkv_rope(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
    eps: float,
    position: torch.Tensor,
    cache=None,
    v_from_k: bool = False,
) -> torch.Tensor:
    """q [HQ, D] normed and rotated from the fused projection output; for an own-KV layer
    (`cache` a LayerCache) the key and value are normed (and the key rotated) and written to
    the slot of `position`, whose recorded position is updated too."""
    q_out = torch.empty(num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    own = cache is not None
    grid = (num_heads + (2 if own else 0),)
    run_kernel(_qkv_rope_kernel, grid,
        qkv, q_norm, k_norm if k_norm is not None else q_norm, cos, sin, q_out,
        cache.k if own else q_out, cache.v if own else q_out, cache.pos if own else position,
        position, cache.slots if own else 1, eps,
        HQ=num_heads, D=head_dim, OWN_KV=own, V_FROM_K=v_from_k,
        RING=bool(own and cache.window is not None), num_warps=_warps(head_dim),
    )  # fmt: skip
    return q_out


def ple_mix(
    proj: torch.Tensor,
    tok: torch.Tensor,
    weight: torch.Tensor,
    layers: int,
    width: int,
    eps: float,
    c_proj: float,
    c_mix: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-layer inputs [layers, width] of one token (or [tokens * layers, width] of a
    prompt chunk: rows are independent) from the raw projection and lookup. `out` may be
    `tok` itself: each row is read whole before it is written."""
    if out is None:
        out = torch.empty(layers, width, device=proj.device, dtype=proj.dtype)
    elif out.shape != (layers, width) or not out.is_contiguous() or out.dtype != proj.dtype:
        raise ValueError("ple_mix writes a contiguous [layers, width] out in proj's dtype")
    run_kernel(_ple_mix_kernel, (layers,),
        proj, tok, weight, out, width, eps, c_proj, c_mix, BLOCK=_block(width),
        num_warps=_warps(width),
    )  # fmt: skip
    return out
