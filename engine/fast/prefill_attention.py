"""The attention and cache writes of a prompt pass, for all its segments at once.

Why: `FusedPrefill` attended and wrote the cache segment by segment (views of the pool,
concatenations, a masked softmax, three index copies: about twenty launches per segment and
layer), so a pass of eight prompts spent most of its host time there. A `PassAttention` is
built once per pass from the scheduler's plan (host lists only: which pool rows hold each
segment's cache, where its new keys go) and then costs each layer one kernel launch
(`engine.kernels.attention_prefill`) and three index copies, however many segments.

It applies where the kernel does: every segment's cache a view of one `KVPool`, tensor-core
`tl.dot` (sm_80 and newer) in a 16-bit dtype, or the CPU interpreter (CI); and a cached prefix
short enough that re-reading it per query block stays cheap (`PREFIX_LIMIT`; a long prompt's
later chunks keep `engine.attention.attend_chunk`, whose prefix goes through torch's
memory-efficient kernel). Elsewhere `plan` says None and the segment-by-segment path runs.
`FusedPrefill(pass_attention=False)` keeps the segment-by-segment path everywhere (the tests'
reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.attention_prefill import prefill_attention
from engine.kv_pool import KVPool, SequenceCache

PREFIX_LIMIT = 8192  # the longest cached prefix a segment may have on this path


def kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the pass kernel runs here: sm_80+ in 16-bit, or the CPU (where the fused path
    only runs forced, on Triton's interpreter)."""
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        return major >= 8 and dtype in (torch.bfloat16, torch.float16)
    return device.type == "cpu"


@dataclass
class _Rows:
    """Per layer kind: the cache rows each segment sees (None: no segment has any), where the
    pass's keys are written, and which of its rows (None: all of them, in order)."""

    cache: tuple[torch.Tensor, torch.Tensor] | None  # (rows int64, offsets int32 [B+1])
    write: torch.Tensor
    source: torch.Tensor | None


class PassAttention:
    """`attend(layer, q, k, v)` and `write(layer, k, v)` for one pass; `plan` builds it."""

    def __init__(self, pool: KVPool, cu_q: torch.Tensor, q_pos: torch.Tensor, max_rows: int,
                 full: _Rows, ring: _Rows, flat: bool = False) -> None:  # fmt: skip
        self.pool, self.cu_q, self.q_pos, self.max_rows = pool, cu_q, q_pos, max_rows
        self._rows = {False: full, True: ring}
        self.flat = flat  # the kernel's grid by row blocks of the pass (a captured pass)

    @classmethod
    def fresh(cls, pool: KVPool, cu_q: torch.Tensor, q_pos: torch.Tensor, slots: torch.Tensor,
              keep_from: torch.Tensor) -> PassAttention:  # fmt: skip
        """A pass of fresh prompts (no cached keys) whose write rows are computed on the device
        from its rows' slots and positions, as the decode step computes its own: nothing is
        read on the host, so a CUDA graph can capture it (engine/fast/prefill_graph.py).
        q_pos / slots / keep_from: int64 [T] per row; a ring keeps rows at positions >=
        keep_from (a chunk's tail), the rest go to the padding slot's ring, as padding rows
        (slot = the pool's padding slot, position 0) go to its rows."""
        full_rows, ring_rows = pool.write_rows(slots, q_pos)
        full = ring = _Rows(None, full_rows, None)
        if pool.ring_slots:
            dropped = pool.pad_slot * pool.ring_slots
            ring = _Rows(None, torch.where(q_pos >= keep_from, ring_rows, dropped), None)
        return cls(pool, cu_q, q_pos, 0, full, ring, flat=True)

    @classmethod
    def plan(cls, segments: list[tuple[int, int, object]], q_pos: torch.Tensor,
             dtype: torch.dtype) -> PassAttention | None:  # fmt: skip
        """segments: (rows, start, cache) each, in the pass's row order. None where the kernel
        does not apply (see the module's docstring)."""
        caches = [c for _, _, c in segments]
        if not all(isinstance(c, SequenceCache) for c in caches):
            return None
        pool = caches[0].pool
        if any(c.pool is not pool for c in caches) or not kernel_applies(pool.device, dtype):
            return None
        if max(start for _, start, _ in segments) > PREFIX_LIMIT:
            return None
        bs, r = pool.block_size, pool.ring_slots
        cu, full_cache, full_cu, ring_cache, ring_cu = [0], [], [0], [], [0]
        full_write, ring_write, ring_src = [], [], []
        truncated = False
        for n, start, cache in segments:
            blocks = torch.tensor(pool.blocks.blocks_of(cache.slot), dtype=torch.int64)
            held = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
            full_cache.append(held[:start])
            full_cu.append(full_cu[-1] + start)
            full_write.append(held[start : start + n])
            if r:
                seen = r if start else 0  # a fresh sequence's ring holds nothing it may see
                ring_cache.append(torch.arange(cache.slot * r, cache.slot * r + seen))
                ring_cu.append(ring_cu[-1] + seen)
                keep = min(n, r)  # a chunk longer than the ring: its tail survives
                truncated |= keep < n
                pos = torch.arange(start + n - keep, start + n)
                ring_write.append(cache.slot * r + pos % r)
                ring_src.append(torch.arange(cu[-1] + n - keep, cu[-1] + n))
            cu.append(cu[-1] + n)
        dev = pool.device

        def rows(parts: list[torch.Tensor], offsets: list[int]) -> tuple | None:
            if not offsets[-1]:
                return None
            return (to_device(torch.cat(parts), dev),
                    torch.tensor(offsets, dtype=torch.int32).to(dev))  # fmt: skip

        full = _Rows(rows(full_cache, full_cu), to_device(torch.cat(full_write), dev), None)
        ring = _Rows(None, full.write, None)
        if r:
            src = to_device(torch.cat(ring_src), dev) if truncated else None
            ring = _Rows(rows(ring_cache, ring_cu), to_device(torch.cat(ring_write), dev), src)
        cu_q = torch.tensor(cu, dtype=torch.int32).to(dev)
        return cls(pool, cu_q, q_pos, max(n for n, _, _ in segments), full, ring)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        """[T, Hq, D]: every segment's queries over its cache (before this pass's keys are
        written) and its own keys."""
        p = self.pool
        rows = self._rows[p.cfg.is_sliding(layer)]
        cache = None
        if rows.cache is not None:
            cache = (p.k[layer], p.v[layer], p.pos[layer], *rows.cache)
        kk, vv = k.to(q.dtype), v.to(q.dtype)
        return prefill_attention(q, kk, vv, self.q_pos, self.cu_q, self.max_rows, window, cache,
                                 flat=self.flat)  # fmt: skip

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The pass's keys and values into the pool (a ring keeps each chunk's tail)."""
        p = self.pool
        rows = self._rows[p.cfg.is_sliding(layer)]
        pos = self.q_pos
        if rows.source is not None:
            k, v, pos = k[rows.source], v[rows.source], pos[rows.source]
        p.k[layer].index_copy_(0, rows.write, k.to(p.dtype))
        p.v[layer].index_copy_(0, rows.write, v.to(p.dtype))
        p.pos[layer].index_copy_(0, rows.write, pos)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, copied from pinned memory without waiting on the GPU."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
