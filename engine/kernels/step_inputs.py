"""What a decode step derives from its rows' tokens, positions and slots, each in one launch.

Why: these were small PyTorch ops inside every decode graph, each a launch that neither
overlaps its neighbours (no PDL) nor does much work:
* `pick_tokens`: the engine loop stages a step's inputs as one [4, B] int64 tensor (source row
  in the previous step or -1, fresh token, position, slot) and the decode graph picks each
  row's token: the previous step's id for a row that continues it, the fresh token otherwise
  (a clamp, a gather, a select and a cast in PyTorch ops);
* `step_tables`: the RoPE cos/sin of every row for each layer kind and the pool rows its new
  keys go to, full layers through the block tables and sliding layers in their rings (about
  24 launches in PyTorch ops: `Gemma4Model.rope` and `KVPool.write_rows`).

Both compute what the PyTorch ops compute: the same fp32 products, and on the GPU libdevice's
cos/sin, the functions PyTorch's CUDA kernels call (Triton's own `tl.cos` is the approximate
instruction, wrong for the large angles of long contexts). The CPU interpreter has no
libdevice and takes numpy's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.launch import compiling_only, run_kernel
from engine.kernels.pdl import wait_inputs
from engine.options import triton_interpreted


@triton.jit
def _pick_kernel(in_ptr, ids_ptr, tok_ptr, slot_ptr, B, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    wait_inputs(PDL)  # the head of a step: `ids` is the previous replay's
    offs = tl.arange(0, BLOCK)
    mask = offs < B
    src = tl.load(in_ptr + offs, mask=mask, other=-1)
    fresh = tl.load(in_ptr + B + offs, mask=mask, other=0)
    prev = tl.load(ids_ptr + tl.maximum(src, 0), mask=mask & (src >= 0), other=0)
    tl.store(tok_ptr + offs, tl.where(src >= 0, prev, fresh), mask=mask)
    slot = tl.load(in_ptr + 3 * B + offs, mask=mask, other=0)
    tl.store(slot_ptr + offs, slot.to(tl.int32), mask=mask)


def pick_tokens(
    inputs: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, positions [B] int64, slots [B] int32) of a step from its staged
    `inputs` [4, B] int64 (contiguous) and the previous step's `ids` (int64): row b's token is
    ids[inputs[0, b]] where that is >= 0, else inputs[1, b]."""
    if inputs.dim() != 2 or inputs.shape[0] != 4 or not inputs.is_contiguous():
        raise ValueError(f"inputs must be a contiguous [4, B] tensor, not {tuple(inputs.shape)}")
    if inputs.dtype != torch.int64 or ids.dtype != torch.int64:
        raise ValueError(f"inputs and ids must be int64, not {inputs.dtype} and {ids.dtype}")
    b = inputs.shape[1]
    tokens = torch.empty(b, dtype=torch.int64, device=inputs.device)
    slots = torch.empty(b, dtype=torch.int32, device=inputs.device)
    block = max(16, triton.next_power_of_2(b))
    run_kernel(_pick_kernel, (1,), inputs, ids, tokens, slots, b, BLOCK=block)
    if compiling_only():  # the launch above only compiled: the step's index ops need real rows
        src, fresh = inputs[0], inputs[1]
        tokens = torch.where(src >= 0, ids[src.clamp(min=0)], fresh)
        slots = inputs[3].to(torch.int32)
    return tokens, inputs[2], slots


@triton.jit
def _rope_row(p, inv_ptr, cos_ptr, sin_ptr, b, HALF, BLOCK: tl.constexpr,
              ACCURATE: tl.constexpr):  # fmt: skip
    """Row b of one kind's cos/sin [B, 2 * HALF]: both halves from the HALF frequencies."""
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    f = p * tl.load(inv_ptr + d, mask=mask, other=0.0)
    if ACCURATE:
        c, s = libdevice.cos(f), libdevice.sin(f)
    else:
        c, s = tl.cos(f), tl.sin(f)
    c = c.to(cos_ptr.dtype.element_ty)
    s = s.to(sin_ptr.dtype.element_ty)
    row = b * 2 * HALF
    tl.store(cos_ptr + row + d, c, mask=mask)
    tl.store(cos_ptr + row + HALF + d, c, mask=mask)
    tl.store(sin_ptr + row + d, s, mask=mask)
    tl.store(sin_ptr + row + HALF + d, s, mask=mask)


@triton.jit
def _tables_kernel(
    pos_ptr, slot_ptr, bt_ptr, stride_bt, full_ptr, ring_ptr, BS, R,
    inv_a, cos_a, sin_a, HALF_A, inv_b, cos_b, sin_b, HALF_B,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, TWO: tl.constexpr, ACCURATE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_inputs(PDL)
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    block = tl.load(bt_ptr + slot * stride_bt + pos // BS).to(tl.int64)
    tl.store(full_ptr + b, block * BS + pos % BS)
    tl.store(ring_ptr + b, slot * R + pos % R)
    p = pos.to(tl.float32)
    _rope_row(p, inv_a, cos_a, sin_a, b, HALF_A, BLOCK_A, ACCURATE)
    if TWO:
        _rope_row(p, inv_b, cos_b, sin_b, b, HALF_B, BLOCK_B, ACCURATE)


def step_tables(
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    ring_slots: int,
    inv_freqs: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """For B rows at `positions` (int64) of the sequences in pool `slots` (int32 or int64):
    ([(cos, sin) [B, 2 * len(inv)] in `dtype`, one pair per fp32 inverse-frequency table in
    `inv_freqs`, as `engine.ops.rope_cos_sin` makes them], the full layers' pool rows, the
    rings' rows), the rows int64 as `KVPool.write_rows` computes them. One or two tables (a
    model's layer kinds)."""
    if not 1 <= len(inv_freqs) <= 2:
        raise ValueError(f"step_tables takes one or two rope tables, not {len(inv_freqs)}")
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError("positions must be a 1-D int64 tensor")
    b, dev = positions.shape[0], positions.device
    tables = [
        (torch.empty(b, 2 * f.numel(), device=dev, dtype=dtype),
         torch.empty(b, 2 * f.numel(), device=dev, dtype=dtype))
        for f in inv_freqs
    ]  # fmt: skip
    full = torch.empty(b, dtype=torch.int64, device=dev)
    ring = torch.empty(b, dtype=torch.int64, device=dev)
    if b:
        a, second = inv_freqs[0], inv_freqs[-1]
        (cos_a, sin_a), (cos_b, sin_b) = tables[0], tables[-1]
        run_kernel(_tables_kernel, (b,), positions, slots, block_tables,
                   block_tables.stride(0), full, ring, block_size, max(ring_slots, 1),
                   a, cos_a, sin_a, a.numel(), second, cos_b, sin_b, second.numel(),
                   BLOCK_A=triton.next_power_of_2(a.numel()),
                   BLOCK_B=triton.next_power_of_2(second.numel()), TWO=len(inv_freqs) == 2,
                   ACCURATE=not triton_interpreted())  # fmt: skip
        if compiling_only():  # only compiled: later index ops must not meet garbage rows
            full.zero_()
            ring.zero_()
    return tables, full, ring
