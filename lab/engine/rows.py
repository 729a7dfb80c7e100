"""Decode rows and prompt reads driven below the scheduler, for the lab scripts: pool slots
opened and granted blocks by hand, filled with random keys to a depth, stepped by the engine's
runner (`Engine.runner.step`) or a variant runner with other options, and prompts read as the
engine reads them (all but the last token as prompt chunks, the last through the decode step).

A slot taken here is given back (`held_rows` is a context manager), so the public API
(`Engine.generate`) can run on the same engine between measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def held_rows(eng, rows: int, tokens: int | None = None) -> Iterator[torch.Tensor]:
    """`rows` pool slots, each holding blocks for positions 0..tokens-1 (default the context):
    the slot ids [rows] int32 on the device; freed on exit."""
    pool = eng.pool
    tokens = eng.max_context if tokens is None else tokens
    slots = [pool.blocks.open_slot() for _ in range(rows)]
    try:
        grants = tuple(g for s in slots if (g := pool.blocks.grow(s, tokens)) is not None)
        pool.apply(tuple(slots), grants)
        yield torch.tensor(slots, dtype=torch.int32, device=eng.device)
    finally:
        for s in slots:
            pool.blocks.close_slot(s)


def fill_rows(eng, slots: torch.Tensor, depth: int) -> None:
    """The slots as if positions 0..depth-1 had been read (random keys: decode cost depends on
    how many positions are read, not on what they hold), in pieces (little extra memory)."""
    pool, cfg = eng.pool, eng.config
    gen = torch.Generator(device=eng.device).manual_seed(depth)
    r = pool.ring_slots
    for slot in slots.tolist():
        for i in pool.k:
            if cfg.is_sliding(i):
                pool.pos[i][slot * r : (slot + 1) * r].fill_(-1)
                positions = torch.arange(max(0, depth - r), depth, device=eng.device)
                where = slot * r + positions % r
            else:
                positions = torch.arange(depth, device=eng.device)
                where = pool.rows_of(slot, positions)
            k, v = pool.k[i], pool.v[i]
            for j in range(0, positions.numel(), 8192):
                w, p = where[j : j + 8192], positions[j : j + 8192]
                shape = (p.numel(), *k.shape[1:])
                k[w] = torch.randn(shape, device=k.device, generator=gen).to(k.dtype)
                v[w] = torch.randn(shape, device=v.device, generator=gen).to(v.dtype)
                pool.pos[i][w] = p


def variant_runner(eng, **changes):
    """A ModelRunner over `eng`'s model and pool with some options changed (its own fused
    weights, decoder and graphs): a variant of the decode step or the prompt read in this
    process."""
    from engine.runner import ModelRunner

    options = dataclasses.replace(eng.options, **changes)
    runner = ModelRunner(eng.model, eng.pool, options, eng.max_num_seqs)
    runner.warm_up()
    return runner


def read_prompt(eng, prompt: list[int], slot: int, runner=None, cap=...) -> torch.Tensor:
    """The last prompt token's logits [V] as the engine reads a prompt into `slot` (already
    holding its blocks): the chunks of all but the last token through the runner's reader,
    then the last token through its decode step. `cap`: the memory cap (MiB or None) its
    chunk is planned under; default the engine's."""
    from engine.memory import plan_prompt
    from engine.sampling import SamplingParams
    from engine.scheduler import PromptChunk, StepPlan
    from engine.sequence import Sequence

    runner = runner or eng.runner
    cap = eng.memory_cap_mib if cap is ... else cap
    memory = plan_prompt(eng.model, len(prompt), eng.prefill_chunk, cap)
    seq = Sequence(list(prompt), SamplingParams(max_tokens=1), frozenset(), memory.chunk,
                   memory.score_budget)  # fmt: skip
    runner.execute(StepPlan(started=(seq,)))
    for start in range(0, len(prompt) - 1, memory.chunk):
        n = min(memory.chunk, len(prompt) - 1 - start)
        chunk = PromptChunk(seq.id, slot, start, n)
        runner.execute(StepPlan(chunks=(chunk,), score_budget=memory.score_budget))
    runner.execute(StepPlan(ended=(seq.id,)))
    dev = eng.device
    token = torch.tensor([prompt[-1]], device=dev)
    position = torch.tensor([len(prompt) - 1], device=dev)
    with torch.no_grad():
        logits = runner.step(token, position, torch.tensor([slot], dtype=torch.int32, device=dev))
    return logits[0].clone()


def read_whole(eng, prompt: list[int], slot: int, chunk: int | None = None,
               score_budget: int | None = None) -> torch.Tensor:  # fmt: skip
    """The last token's logits [V] with every prompt token through the model's own chunks of
    `chunk` tokens (KV-shared layers included on the last): what a read is compared with."""
    ids = torch.tensor(prompt, device=eng.device)
    view, chunk, logits = eng.pool.view(slot), chunk or eng.prefill_chunk, None
    for start in range(0, len(prompt), chunk):
        last = start + chunk >= len(prompt)
        piece = ids[start : start + chunk]
        logits = eng.model.prefill_chunk(piece, start, view, last, score_budget)
    return logits


def step_fn(eng, slots: torch.Tensor, runner=None):
    """`step(tokens, positions) -> logits [B, V]` over `slots` by the engine's runner."""
    runner = runner or eng.runner
    return lambda tokens, positions: runner.step(tokens, positions, slots)
