"""A decode step's tokens and slots from its staged inputs, in one launch.

Why: the engine loop stages a step's inputs as one [4, B] int64 tensor (source row in the
previous step or -1, fresh token, position, slot) and the decode graph picks each row's token:
the previous step's id for a row that continues it, the fresh token otherwise. In PyTorch ops
that is a clamp, a gather, a select and a cast, four launches at the head of every step; here
it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import compiling_only, run_kernel
from engine.kernels.pdl import wait_inputs


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
