"""Sizing the KV block pool and the number of sequences an engine decodes together.

Why a module of its own: the sizes are a decision with a rule a user must be able to read.
* max_num_seqs 1 (the default, one request at a time) without `kv_cache_mib`: a pool of exactly
  one full-context sequence, what a single-sequence cache held, so a long prompt under a memory
  cap fits as it did (the prompt's chunks are then planned from what is left, engine.memory);
* otherwise the pool gets what the device has left after the weights (under `memory_cap_mib`
  when one is set), less room for reading a prompt chunk (engine.memory's reader estimate) and
  a margin for the decode step's activations and CUDA graphs, or `kv_cache_mib`; the CPU, with
  nothing to measure, gets CPU_POOL_BYTES. `max_num_seqs` "auto" is the largest graph bucket
  (16, 8, 4, 2, 1) whose sequences each get at least DEFAULT_SEQ_TOKENS (or the whole context
  when shorter) from that pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_pool import (
    DEFAULT_BLOCK_SIZE,
    PoolGeometry,
    bytes_per_token,
    plan_geometry,
    ring_bytes_per_seq,
)
from engine.memory import MIB, available_bytes, reader_peak_bytes

AUTO_SEQS = (16, 8, 4, 2, 1)
DEFAULT_SEQ_TOKENS = 4096
CPU_POOL_BYTES = 256 * MIB  # the CPU has no measurement to size from: a fixed pool
MARGIN_BYTES = 256 * MIB  # decode activations, graph pools, the allocator's rounding


@dataclass(frozen=True)
class BatchingPlan:
    max_num_seqs: int
    prefill_budget: int
    geometry: PoolGeometry
    budget_bytes: int


def plan(
    model,
    max_context: int,
    max_num_seqs: int | str,
    prefill_budget: int,
    memory_cap_mib: int | None,
    kv_cache_mib: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> BatchingPlan:
    """The pool and the number of sequences for what is left on the device (see the module)."""
    cfg, dtype = model.cfg, model.dtype
    if max_num_seqs == 1 and kv_cache_mib is None:
        # no budget: plan_geometry caps the blocks at what one sequence can ever hold
        geometry = plan_geometry(cfg, dtype, max_context, 1 << 62, 1, block_size)
        return BatchingPlan(1, prefill_budget, geometry, 0)
    if kv_cache_mib is not None:
        budget = int(kv_cache_mib * MIB)
    else:
        left = available_bytes(model.device, memory_cap_mib)
        if left is None:
            budget = CPU_POOL_BYTES
        else:
            elem = torch.empty((), dtype=dtype).element_size()
            reader = reader_peak_bytes(model, prefill_budget, elem)
            budget = int(left - reader - MARGIN_BYTES - 0.05 * left)
    if max_num_seqs == "auto":
        want = min(max_context, DEFAULT_SEQ_TOKENS)
        per_seq = ring_bytes_per_seq(cfg, dtype, max_context) + want * (
            bytes_per_token(cfg, dtype) + 8
        )
        fitting = [n for n in AUTO_SEQS if n * per_seq <= budget - per_seq]
        seqs = fitting[0] if fitting else 1
    else:
        seqs = int(max_num_seqs)  # in range: EngineConfig checked it
    geometry = plan_geometry(cfg, dtype, max_context, budget, seqs, block_size)
    return BatchingPlan(seqs, prefill_budget, geometry, budget)


def kv_cache_line(batching: BatchingPlan, pool_bytes: int, device_type: str = "cuda") -> str:
    """The start-up line a vLLM user looks for, in vLLM's words ("GPU KV cache size: N tokens",
    "Maximum concurrency for N tokens per request: Nx"), so the same log readers parse both."""
    g = batching.geometry
    where = "GPU" if device_type == "cuda" else device_type.upper()
    return (
        f"{where} KV cache size: {g.token_capacity:,} tokens ({g.num_blocks - 1:,} blocks of "
        f"{g.block_size}, {pool_bytes / MIB:,.0f} MiB with the sliding rings); max_num_seqs "
        f"{batching.max_num_seqs}; Maximum concurrency for {g.max_context:,} tokens per "
        f"request: {g.token_capacity / g.max_context:.2f}x"
    )
