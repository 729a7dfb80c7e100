"""Model-level test helpers: one sequence's cache, and a prompt read the two ways the engine
reads one, for tests that check the reference model's functions (prefill_chunk, decode_step)
below the scheduler and the runner.

`sequence_cache(eng)` is a cache for one sequence of the whole context, kept per engine (as the
single-sequence engine's own cache was), a view of a one-sequence KV pool whose blocks are
consecutive, so its full layers are plain slices.
"""

from __future__ import annotations

import weakref

import torch

from engine.kv_pool import KVPool, SequenceCache, plan_geometry

_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sequence_cache(eng) -> SequenceCache:
    """The engine's test cache: one sequence holding every position of its context."""
    cache = _caches.get(eng)
    if cache is None:
        cfg, model = eng.config, eng.model
        geometry = plan_geometry(cfg, model.dtype, eng.max_context, 1 << 62, 1)
        pool = KVPool(cfg, geometry, model.device, model.dtype)
        slot = pool.blocks.open_slot()
        grant = pool.blocks.grow(slot, eng.max_context)
        pool.apply((slot,), (grant,) if grant is not None else ())
        cache = pool.view(slot)
        _caches[eng] = cache
    return cache


def reset(cache: SequenceCache) -> None:
    """Forget every position (a new sequence starts)."""
    for layer in cache.layers.values():
        layer.pos.fill_(-1)


def prefill(model, cache, prompt: list[int], chunk: int, score_budget: int | None = None):
    """Read the whole prompt, `chunk` tokens at a time, every layer on every chunk (the
    reference reading); returns the last token's logits [V]."""
    reset(cache)
    ids = torch.tensor(prompt, dtype=torch.int64, device=model.device)
    logits = None
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        logits = model.prefill_chunk(ids[start:end], start, cache, end == len(prompt), score_budget)
    return logits


def read_prompt(model, cache, prompt: list[int], chunk: int, step, score_budget=None):
    """The engine's arrangement: the body through chunks that skip the KV-shared layers, the
    last token through the decode `step(token [1], position [1]) -> logits [1, V]`."""
    reset(cache)
    ids = torch.tensor(prompt, dtype=torch.int64, device=model.device)
    body = len(prompt) - 1
    for start in range(0, body, chunk):
        model.prefill_chunk(
            ids[start : min(start + chunk, body)], start, cache, False, score_budget
        )
    position = torch.tensor([body], dtype=torch.int64, device=model.device)
    return step(ids[body:], position)[0].clone()


def overlapping_tokens(path, options, *, dtype=torch.bfloat16, stagger: float = 0.0,
                       check=None) -> list[list[int]]:  # fmt: skip
    """Greedy tokens on the GPU of one request alone, then eight overlapping ones (40 tokens
    each; `stagger` seconds between arrivals), from an engine over the checkpoint at `path`
    with `options`; `check(engine)` runs once it is loaded. For tests that compare two
    arrangements of the engine token for token."""
    import threading
    import time

    import engine
    from engine.sampling import SamplingParams

    prompts = [[2] + [(11 * i + 7 * j) % 900 + 20 for i in range(30 + 17 * j)] for j in range(8)]
    eng = engine.load(path, device="cuda", dtype=dtype, max_context=1024, max_num_seqs=8,
                      options=options)  # fmt: skip
    try:
        if check is not None:
            check(eng)
        params = SamplingParams(max_tokens=40, stop_ids=())
        got: dict[int, list[int]] = {-1: eng.generate(prompts[0], params)}

        def run(j: int) -> None:
            time.sleep(stagger * j)
            got[j] = eng.generate(prompts[j], params)

        threads = [threading.Thread(target=run, args=(j,)) for j in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        return [got[j] for j in range(-1, 8)]
    finally:
        eng.close()
