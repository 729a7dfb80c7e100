"""The attention part of a decoder layer, one strategy per way the reference model is driven.

Why strategies: `Gemma4Model._layer` is written once (norms, products, MLP, PLE); only where a
layer's keys come from and where its new K/V go differ between reading prompt chunks, decoding
a batch of rows and the single-sequence cache. Each strategy is called as
`attend(layer, q, k, v) -> [T, Hq, D]` with q normed and rotated, k / v the layer's new keys and
values (None on a KV-shared layer, which reads its producer's, `cfg.kv_producer`), and does the
write and the attention for the rows it was built with:

* `RowsAttention`: one new token for each of B rows, row b in pool slot slots[b]; every row's
  K/V is written first (full layers: the row its block table gives; sliding layers: its ring),
  then each row attends over ITS sequence, gathered into a padded [B, S, Hkv, D] with the
  positions each gathered row recorded (pool.pos) as the mask, in one `ops.attention_rows`.
* `ChunksAttention`: several sequences' prompt chunks, segment by segment over each sequence's
  cache (attend before writing: a ring cannot take the chunk first), never copying a full
  layer's prefix when the sequence's blocks are consecutive (it is then a view of the pool).
* `CacheAttention`: the single-sequence `prefill_chunk` / `decode_step` over a cache with
  `layers[i].k / v / pos / window / write` (engine.cache.KVCache or `KVPool.view(slot)`); it
  goes when those two entry points do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.config import TextConfig
    from engine.kv_pool import KVPool
    from engine.ops import Ops


class Attend(Protocol):
    """What `Gemma4Model._layer` calls for its attention."""

    def __call__(
        self, i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor: ...


def window_of(cfg: TextConfig, i: int) -> int | None:
    return cfg.sliding_window if cfg.is_sliding(i) else None


class RowsAttention:
    """Decode attention of B rows of different sequences in one pool, computed together.

    Padding rows (slot pool.pad_slot) write only the padding slot's rows (its ring, and block 0,
    which its all-zero block table names and no sequence holds); they should carry a position
    below max_context (0 will do)."""

    def __init__(
        self, ops: Ops, pool: KVPool, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        self.ops, self.pool, self.cfg = ops, pool, pool.cfg
        self.positions = positions.to(torch.int64)
        self.slots = slots.to(device=pool.device, dtype=torch.int64)
        bs, r = pool.block_size, pool.ring_slots
        tables = pool.block_tables[self.slots].to(torch.int64)  # [B, max_blocks]
        self.full_rows = tables.gather(1, (self.positions // bs)[:, None])[:, 0] * bs
        self.full_rows += self.positions % bs  # [B]: where each row's new key goes
        self.ring_rows = self.slots * r + self.positions % r if r else None
        # every row's sequence up to the furthest position in the batch (a host read: this is
        # the CPU reference, no graph is captured around it); columns past a row's own
        # position are masked by their recorded positions below
        blocks = min(int(self.positions.max()) // bs + 1, tables.shape[1])
        cols = torch.arange(blocks * bs, device=pool.device)
        self.gather_full = tables[:, :blocks].repeat_interleave(bs, dim=1) * bs + cols % bs
        self.cols = cols
        self.gather_ring = (
            self.slots[:, None] * r + torch.arange(r, device=pool.device) if r else None
        )
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self.ring_rows if self.cfg.is_sliding(i) else self.full_rows
        pool = self.pool
        pool.k[i].index_copy_(0, rows, k.to(pool.dtype))
        pool.v[i].index_copy_(0, rows, v.to(pool.dtype))
        pool.pos[i].index_copy_(0, rows, self.positions)

    def _keys(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's keys, values and their positions [B, S, ...] in producer layer i (after
        its write; kept for the KV-shared layers that read the same producer)."""
        got = self._seen.get(i)
        if got is None:
            pool = self.pool
            if self.cfg.is_sliding(i):
                rows = self.gather_ring
                kpos = pool.pos[i][rows]
            else:
                rows = self.gather_full
                kpos = pool.pos[i][rows]
                # a column holds the row's sequence only where it recorded that column's
                # position: block-table entries past a sequence's blocks may name another's
                kpos = torch.where(kpos == self.cols, kpos, -1)
            got = self._seen[i] = (pool.k[i][rows], pool.v[i][rows], kpos)
        return got

    def __call__(
        self, i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        if k is not None and v is not None:
            self._write(i, k, v)
        keys, values, kpos = self._keys(self.cfg.kv_producer(i))
        return self.ops.attention_rows(
            q, keys, values, kpos, self.positions, window_of(self.cfg, i)
        )


@dataclass
class Segment:
    """One sequence's chunk inside a read_chunks pass: rows r0 .. r0 + n - 1 of the pass."""

    r0: int
    n: int
    start: int
    slot: int
    positions: torch.Tensor  # [n]: start .. start + n - 1
    write_rows: torch.Tensor  # [n]: the full layers' rows of those positions
    prefix: slice | torch.Tensor  # the full layers' rows of positions 0 .. start - 1


def segment(pool: KVPool, r0: int, n: int, start: int, slot: int) -> Segment:
    """Where one chunk's keys go and where its prefix lies. The prefix is a slice (a view of the
    pool, no copy) when the sequence's blocks are consecutive (`KVPool.contiguous_rows`, host
    bookkeeping: a sequence alone in its pool, the long-prompt case); else its rows (a gather,
    copied per full layer)."""
    positions = torch.arange(start, start + n, device=pool.device)
    rows = pool.contiguous_rows(slot)
    if rows is not None:
        prefix: slice | torch.Tensor = slice(rows.start, rows.start + start)
    else:
        prefix = pool.rows_of(slot, torch.arange(start, device=pool.device))
    return Segment(r0, n, start, slot, positions, pool.rows_of(slot, positions), prefix)


class ChunksAttention:
    """Prompt-chunk attention of several sequences (the own-KV layers only), segment by segment
    over each sequence's cache; score_budget bounds each segment's scores
    (`ops.attention_prefill`). A full layer's prefix is taken as all visible (positions
    0 .. start-1 were read in order before this chunk), as the fused reader does."""

    def __init__(
        self, ops: Ops, pool: KVPool, segments: list[Segment], score_budget: int | None
    ) -> None:
        self.ops, self.pool, self.cfg = ops, pool, pool.cfg
        self.segments, self.score_budget = segments, score_budget

    def __call__(
        self, i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        if k is None or v is None:
            raise ValueError(f"layer {i} keeps no K/V: prompt chunks run the own-KV layers only")
        pool, window, r = self.pool, window_of(self.cfg, i), self.pool.ring_slots
        pk, pv, pp = pool.k[i], pool.v[i], pool.pos[i]
        parts = []
        for s in self.segments:
            rows = slice(s.r0, s.r0 + s.n)
            qs, ks, vs = q[rows], k[rows], v[rows]
            if window is None:
                ck, cv, cp = pk[s.prefix], pv[s.prefix], pp[s.prefix]
            else:  # the sequence's whole ring (a view)
                ring = slice(s.slot * r, (s.slot + 1) * r)
                ck, cv, cp = pk[ring], pv[ring], pp[ring]
            parts.append(self.ops.attention_prefill(qs, ks, vs, ck, cv, cp, s.positions, window,
                                                    self.score_budget,
                                                    prefix_visible=window is None))  # fmt: skip
            if window is None:
                dest, pos = s.write_rows, s.positions
            else:  # a chunk longer than the ring: only its tail survives
                keep = min(s.n, r)
                ks, vs, pos = ks[-keep:], vs[-keep:], s.positions[-keep:]
                dest = s.slot * r + pos % r
            pk.index_copy_(0, dest, ks.to(pool.dtype))
            pv.index_copy_(0, dest, vs.to(pool.dtype))
            pp.index_copy_(0, dest, pos)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class LayerCacheLike(Protocol):
    """One producing layer of a single-sequence cache (engine.cache.LayerCache, PagedLayer)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    window: int | None

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None: ...


class SequenceCacheLike(Protocol):
    """What prefill_chunk / decode_step read as a cache (KVCache, KVPool.view(slot))."""

    layers: dict


class CacheAttention:
    """The single-sequence cache's attention, as prefill_chunk / decode_step always did it.
    prefill_start is the chunk's first position when reading a prompt chunk (attend over the
    filled prefix or the ring, then write), None for a decode step (write, then attend over the
    whole buffer)."""

    def __init__(
        self,
        ops: Ops,
        cfg: TextConfig,
        cache: SequenceCacheLike,
        positions: torch.Tensor,
        prefill_start: int | None,
        score_budget: int | None = None,
    ) -> None:
        self.ops, self.cfg, self.cache = ops, cfg, cache
        self.positions, self.start, self.score_budget = positions, prefill_start, score_budget

    def __call__(
        self, i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        window, positions = window_of(self.cfg, i), self.positions
        lc: LayerCacheLike = self.cache.layers[self.cfg.kv_producer(i)]
        if k is None or v is None:
            return self.ops.attention_decode(q, lc.k, lc.v, lc.pos, positions, window)
        if self.start is None:
            lc.write(k, v, positions)
            return self.ops.attention_decode(q, lc.k, lc.v, lc.pos, positions, window)
        if lc.window is None:  # full layer: the filled prefix
            s = self.start
            ck, cv, cp = lc.k[:s], lc.v[:s], lc.pos[:s]
        else:  # sliding ring: all of it
            ck, cv, cp = lc.k, lc.v, lc.pos
        attn = self.ops.attention_prefill(q, k, v, ck, cv, cp, positions, window,
                                          self.score_budget)  # fmt: skip
        lc.write(k, v, positions)
        return attn
