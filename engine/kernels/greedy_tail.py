"""The decode step's tail in two launches: the logits soft-capped in place and each row's greedy
id.

Why: in PyTorch ops `tanh(logits / cap) * cap` is three elementwise launches, each a full pass
over the [B, vocabulary] logits, and the argmax one or two more (lab/journal.md v23: 29 us of
a 16-row step). Here the first kernel caps a chunk of a row in place and keeps the chunk's
largest value and its first index; the second takes each row's chunks in order.

Both compute what the PyTorch ops compute: the division by a Python number is PyTorch's
multiply by its fp32 reciprocal, every op rounds to the logits' dtype, and on the GPU the tanh
is libdevice's, the CUDA math function PyTorch's kernel calls. The CPU interpreter has no
libdevice: there the tanh is built from `exp` (within a few fp32 units in the last place). Ties
go to the first index, as in `torch.argmax`; the ids come from the capped values as stored, so
values that rounding made equal tie as they do there.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.fused import round_to
from engine.kernels.launch import run_kernel
from engine.kernels.pdl import wait_inputs
from engine.options import triton_interpreted

BLOCK = 2048  # logits a program reads at once
PROGRAMS = 256  # about two waves of programs on a large GPU, whatever the rows


@triton.jit
def _tanh(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.tanh(x)
    # the interpreter: odd Taylor terms near 0 (where 1 - e cancels), else (1 - e) / (1 + e)
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    s = a * a
    small = a * (1.0 + s * (-1.0 / 3.0 + s * (2.0 / 15.0 + s * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _cap_chunk_kernel(y_ptr, val_ptr, idx_ptr, V, stride_y, inv_cap, cap, S, ITERS,
                      BLOCK: tl.constexpr, CAP: tl.constexpr, ACCURATE: tl.constexpr,
                      PDL: tl.constexpr = False):  # fmt: skip
    """Program (row, chunk): caps ITERS blocks of the row in place; its chunk's largest value
    and that value's first index go to val/idx [row, chunk]."""
    wait_inputs(PDL)  # the logits are the kernel before's
    DT: tl.constexpr = y_ptr.dtype.element_ty
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, BLOCK)
    start = chunk * ITERS * BLOCK
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = start
    for it in range(0, ITERS):
        offs = start + it * BLOCK + lanes
        mask = offs < V
        y = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
        if CAP:
            t = round_to(y * inv_cap, DT)
            y = round_to(round_to(_tanh(t, ACCURATE), DT) * cap, DT)
            tl.store(y_row + offs, y.to(DT), mask=mask)
        y = tl.where(mask, y, float("-inf"))
        m = tl.max(y, axis=0)
        i = tl.min(tl.where(y == m, offs, V), axis=0)  # the first index of the block's largest
        take = m > best_v  # strictly: an earlier block keeps a tie
        best_i = tl.where(take, i, best_i)
        best_v = tl.where(take, m, best_v)
    tl.store(val_ptr + row * S + chunk, best_v)
    tl.store(idx_ptr + row * S + chunk, best_i)


@triton.jit
def _pick_chunk_kernel(val_ptr, idx_ptr, ids_ptr, S, BLOCK_S: tl.constexpr,
                       PDL: tl.constexpr = False):  # fmt: skip
    """Program row: the first chunk holding the row's largest value gives its id."""
    wait_inputs(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_S)
    mask = c < S
    v = tl.load(val_ptr + row * S + c, mask=mask, other=float("-inf"))
    m = tl.max(v, axis=0)
    first = tl.min(tl.where(mask & (v == m), c, S), axis=0)
    i = tl.load(idx_ptr + row * S + tl.minimum(first, S - 1))
    tl.store(ids_ptr + row, i.to(tl.int64))


def _chunks(rows: int, vocab: int) -> tuple[int, int]:
    """(chunks per row, blocks per chunk): about PROGRAMS programs, at least a block each."""
    blocks = triton.cdiv(vocab, BLOCK)
    chunks = max(1, min(blocks, triton.cdiv(PROGRAMS, max(rows, 1))))
    iters = triton.cdiv(blocks, chunks)
    return triton.cdiv(blocks, iters), iters


def cap_and_pick(logits: torch.Tensor, cap: float | None, ids: torch.Tensor | None) -> torch.Tensor:
    """Soft-cap `logits` [B, V] in place (`tanh(logits / cap) * cap`; a None or 0 cap leaves
    them) and, where `ids` (int64 [B]) is given, write each row's greedy id into it. Returns
    `logits`. Rows must be contiguous; any float dtype."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with contiguous rows, not {tuple(logits.shape)}")
    if ids is not None and (ids.dtype != torch.int64 or ids.shape != logits.shape[:1]):
        raise ValueError(
            f"ids must be int64 [{logits.shape[0]}], not {ids.dtype} {tuple(ids.shape)}"
        )
    rows, vocab = logits.shape
    if not cap and ids is None or rows == 0:
        return logits
    chunks, iters = _chunks(rows, vocab)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    c = float(cap or 1.0)
    inv = float(np.float32(1.0) / np.float32(c))  # PyTorch's reciprocal, in fp32
    run_kernel(_cap_chunk_kernel, (rows, chunks), logits, val, idx, vocab, logits.stride(0),
               inv, c, chunks, iters, BLOCK=BLOCK, CAP=bool(cap),
               ACCURATE=not triton_interpreted())  # fmt: skip
    if ids is not None:
        run_kernel(_pick_chunk_kernel, (rows,), val, idx, ids, chunks,
                   BLOCK_S=triton.next_power_of_2(chunks))  # fmt: skip
    return logits
