"""The residual+norm after an int4 product, done by the product's last program (a fold).

In a batched decode step the o, down and per-layer projections (N = the hidden size) are each
followed by `fused.residual_norm`: h' = h + rms(y) * w_post [* scalar], then the next norm
x' = rms(h') * w_next. That is 105 launches a step on E2B, each a separate slot in the graph's
chain of dependent kernels. A norm needs whole rows of y, which no single program of the product
holds, so the fold is done by whichever program finishes last: every program stores its y tile,
takes a ticket (a CTA barrier, then an acq_rel atomic at GPU scope, as the split-K GEMM's
tickets in w4gemm_kernel.py), and the one drawing the last ticket reads y back from L2 (`.cg`:
never a stale L1 line) and writes h' and x' for all M rows, RB rows at a time, then puts the
ticket back at 0 so the next launch (or graph replay) starts from it.

It rounds exactly where `residual_norm` rounds, so the fold and the two launches agree up to
the order of the fp32 sums inside a norm. One ticket per device serves every fold, since the
launches of a decode step run one after another on one stream.

The last program's tail is serial over the rows. Where every program of the launch is resident at
once (a grid no larger than the SM count; the launch checks), the tail is spread instead: all
programs meet at a grid barrier on the same counter and fold a row each (`spread_ok`;
GPURIG_FOLD_TAIL=last keeps the serial tail for comparison). The interpreter runs programs one
after another, so a barrier would never open there: it always takes the serial tail.

Off by default (`EngineOptions.fold_residual`, GPURIG_FOLD_RESIDUAL=1): on the H200 the spread
tail cost more than the graph node it saves (the 8-row step 2,090 -> 2,124 us; bench/NOTES.md
v18). It stays as the arrival-and-spread building block a persistent kernel needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.fused import round_to
from engine.options import fold_tail_serial, triton_interpreted


@triton.jit
def _rows_inv_rms(v, mask, D, eps):
    """(mean(v^2) + eps)^-0.5 of every row of v [RB, BLOCK_D] over its D valid columns."""
    ms = tl.sum(tl.where(mask, v * v, 0.0), axis=1) / D
    return 1.0 / tl.sqrt(ms + eps)


@triton.jit
def _fold_rows(r0, y_ptr, h_ptr, sc_ptr, xo_ptr, w_post, w_next, offs, cmask, M, D, stride_ym,
               eps, HAS_SCALAR: tl.constexpr, HAS_NEXT: tl.constexpr, RB: tl.constexpr):  # fmt: skip
    """Rows r0 .. r0 + RB - 1: h += rms(y) * w_post [* scalar] in place, x' = rms(h) * w_next,
    rounded where fused._residual_norm_kernel rounds."""
    DT: tl.constexpr = h_ptr.dtype.element_ty
    rows = r0 + tl.arange(0, RB)
    mask = (rows < M)[:, None] & cmask[None, :]
    y = tl.load(y_ptr + rows[:, None] * stride_ym + offs[None, :], mask=mask, other=0.0,
                cache_modifier=".cg").to(tl.float32)  # fmt: skip
    hp = h_ptr + rows[:, None] * D + offs[None, :]
    h = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
    yn = round_to(y * _rows_inv_rms(y, mask, D, eps)[:, None] * w_post[None, :], DT)
    h = round_to(h + yn, DT)
    if HAS_SCALAR:
        h = round_to(h * tl.load(sc_ptr).to(tl.float32), DT)
    tl.store(hp, h, mask=mask)
    if HAS_NEXT:
        xn = round_to(h * _rows_inv_rms(h, mask, D, eps)[:, None] * w_next[None, :], DT)
        tl.store(xo_ptr + rows[:, None] * D + offs[None, :], xn, mask=mask)


@triton.jit
def residual_tail(y_ptr, h_ptr, wp_ptr, sc_ptr, wn_ptr, xo_ptr, tk_ptr, M, D, stride_ym, eps,
                  HAS_SCALAR: tl.constexpr, HAS_NEXT: tl.constexpr, RB: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPREAD: tl.constexpr = False):  # fmt: skip
    """Called by every program after its y stores. SPREAD False: the last program to finish
    folds all M rows, RB at a time. SPREAD True (every program resident at once, which the
    launch checks): all programs wait at a grid barrier, then program p folds rows p, p + P, ...
    in parallel; the last to leave puts both counters back at 0."""
    tl.debug_barrier()  # every thread's y stores are issued before the ticket is taken
    P = tl.num_programs(0)
    ticket = tl.atomic_add(tk_ptr, 1, sem="acq_rel", scope="gpu")
    offs = tl.arange(0, BLOCK_D)
    cmask = offs < D
    if SPREAD:
        seen = ticket + 1
        while seen < P:  # the barrier: every program's tile is stored
            seen = tl.atomic_add(tk_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        w_post = tl.load(wp_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
        w_next = w_post
        if HAS_NEXT:
            w_next = tl.load(wn_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
        for r0 in range(tl.program_id(0), M, P):
            _fold_rows(r0, y_ptr, h_ptr, sc_ptr, xo_ptr, w_post, w_next, offs, cmask, M, D,
                       stride_ym, eps, HAS_SCALAR, HAS_NEXT, 1)  # fmt: skip
        tl.debug_barrier()
        left = tl.atomic_add(tk_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == P - 1:  # everyone is past the barrier: reset for the next launch
            tl.atomic_xchg(tk_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(tk_ptr + 1, 0, sem="relaxed", scope="gpu")
    elif ticket == P - 1:
        tl.debug_barrier()
        w_post = tl.load(wp_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
        w_next = w_post
        if HAS_NEXT:
            w_next = tl.load(wn_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
        for r0 in range(0, M, RB):
            _fold_rows(r0, y_ptr, h_ptr, sc_ptr, xo_ptr, w_post, w_next, offs, cmask, M, D,
                       stride_ym, eps, HAS_SCALAR, HAS_NEXT, RB)  # fmt: skip
        tl.atomic_xchg(tk_ptr, 0, sem="relaxed", scope="gpu")  # for the next launch


@dataclass(frozen=True)
class ResidualFold:
    """What the product's last program folds in: h [M, N] (updated in place), the post-norm
    weight [N], an optional scalar [1] and next-norm weight [N] with its output x_out [M, N]."""

    h: torch.Tensor
    w_post: torch.Tensor
    eps: float
    scalar: torch.Tensor | None = None
    w_next: torch.Tensor | None = None
    x_out: torch.Tensor | None = None

    def check(self, m: int, n: int, dtype: torch.dtype) -> None:
        """That the tensors fit a product's output y [m, n] of `dtype`."""
        h = self.h
        if h.shape != (m, n) or not h.is_contiguous() or h.dtype != dtype:
            raise ValueError(f"residual fold: h must be a contiguous [{m}, {n}] {dtype} tensor")
        if self.w_post.shape != (n,) or (self.w_next is not None and self.w_next.shape != (n,)):
            raise ValueError(f"residual fold: the norm weights must be [{n}]")
        if self.scalar is not None and self.scalar.numel() != 1:
            raise ValueError("residual fold: the scalar must have one element")
        if (self.w_next is None) != (self.x_out is None):
            raise ValueError("residual fold: w_next and x_out come together")
        if self.x_out is not None and (self.x_out.shape != (m, n) or not self.x_out.is_contiguous()
                                       or self.x_out.dtype != dtype):  # fmt: skip
            raise ValueError(f"residual fold: x_out must be a contiguous [{m}, {n}] {dtype}")

    def kernel_args(self, y: torch.Tensor) -> tuple:
        """The kernel's pointer and scalar arguments (unused ones point at h)."""
        return (self.h, self.w_post, self.scalar if self.scalar is not None else self.w_post,
                self.w_next if self.w_next is not None else self.w_post,
                self.x_out if self.x_out is not None else self.h, ticket(y.device), self.eps)  # fmt: skip


def spread_ok(grid: int, device: torch.device) -> bool:
    """Whether the spread tail's grid barrier may be used: a GPU (not the interpreter), a grid no
    larger than its SM count (each program then has an SM, so none waits on one not yet
    started), and GPURIG_FOLD_TAIL not set to "last"."""
    if device.type != "cuda" or triton_interpreted() or fold_tail_serial():
        return False
    return grid <= _sm_count(device.index if device.index is not None else 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rows_per_chunk(m: int, n: int, warps: int) -> int:
    """Rows the tail takes at once: about 32 values of each tensor per thread (more would spill
    registers in a program of few warps), at most the rows there are."""
    per = max(1, (warps * 32 * 32) // triton.next_power_of_2(n))
    return min(triton.next_power_of_2(m), 1 << (per.bit_length() - 1))


_TICKETS: dict[str, torch.Tensor] = {}


def ticket(device: torch.device) -> torch.Tensor:
    """The device's fold counters (int32 [2]: arrivals, departures; 0 between launches), made
    outside a graph capture."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    tk = _TICKETS.get(key)
    if tk is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "w4mma residual fold: its ticket is made on first use; call w4_gemm_residual "
                "once before capturing a CUDA graph"
            )
        tk = _TICKETS[key] = torch.zeros(2, device=device, dtype=torch.int32)
    return tk
