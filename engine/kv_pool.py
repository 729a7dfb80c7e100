"""The KV cache of a multi-sequence engine: one pool of fixed-size blocks shared by every sequence.

Why blocks: the single-sequence `KVCache` gives every full-attention layer a buffer of the whole
context; sixteen of those cannot sit on a 4 GB card, and a long conversation would force every
short one to reserve as much. Here each full layer owns `num_blocks * block_size` rows, and a
sequence holds the blocks its positions reach: position p of the sequence in sequence slot j
lives in row `block_tables[j, p // block_size] * block_size + p % block_size` (the same block ids
serve every full layer). Sliding layers keep a ring of `window` rows per sequence slot (row
`j * R + p % R`): a window never grows, so a ring is simpler and smaller than blocks. KV-shared
layers own nothing and read their producer's rows, as in `KVCache`.

Slot `max_seqs` is the padding slot: batch rows that only pad a CUDA graph's bucket write there
(block 0, reserved for it), never into a live sequence. Each layer records the position of
every row it wrote (`pos[layer]`, -1 = empty) for prompt reading and the reference step, whose
masks use them; one array per layer, because a prompt chunk attends over a layer's cache before
it writes that layer (an array shared with an earlier layer would already show the chunk). The
batched decode kernels need none of it (a sequence reads only positions <= its own, all written
by itself), so the batched step does not write them: a sequence's prompt is read before its
first step, and a slot's ring and a block's rows are reset when a new sequence gets them.

Allocation is host bookkeeping (engine/block_manager.py, decided by the scheduler's policy)
mirrored to the device table in one copy per plan (`apply`); freeing returns blocks at
once: later work on the same CUDA stream runs after everything already queued that still reads
them. A sequence holding consecutive blocks (one alone in its pool, the single-sequence case)
is read as a slice of each layer's rows, not a gathered copy, so a long prompt costs no extra
copy of its cache per chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine.block_manager import BlockGrant, BlockManager
from engine.config import TextConfig
from engine.errors import EngineError, arg

DEFAULT_BLOCK_SIZE = 64


@dataclass
class LayerCache:
    """K/V of one producing layer of one sequence: k, v [slots, kv_heads, head_dim]; pos int64
    [slots] (the position each slot holds, -1 = empty). window None: a full layer (slot =
    position); else a ring of `window` slots (slot = position % window)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    window: int | None

    @property
    def slots(self) -> int:
        return int(self.pos.shape[0])

    def slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        return positions if self.window is None else positions % self.slots

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store K/V [T, Hkv, D] of `positions` [T] (a ring keeps only the last `slots` of them)."""
        if positions.shape[0] > self.slots:  # a chunk longer than the ring: its tail survives
            k, v, positions = k[-self.slots :], v[-self.slots :], positions[-self.slots :]
        idx = self.slot_of(positions)
        self.k.index_copy_(0, idx, k.to(self.k.dtype))
        self.v.index_copy_(0, idx, v.to(self.v.dtype))
        self.pos.index_copy_(0, idx, positions)


@dataclass(frozen=True)
class PoolGeometry:
    """The sizes one pool is built with (also what a plan reports before allocating)."""

    max_seqs: int
    num_blocks: int  # including block 0, the padding slot's
    block_size: int
    max_context: int
    ring_slots: int  # R: rows of a sliding layer's ring per sequence (0: no sliding layers)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_context // self.block_size)

    @property
    def token_capacity(self) -> int:
        """Tokens the shared blocks hold (block 0 excluded): vLLM's "KV cache size"."""
        return (self.num_blocks - 1) * self.block_size


def bytes_per_token(cfg: TextConfig, dtype: torch.dtype) -> int:
    """K+V bytes one position costs in the full layers' blocks."""
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(
        2 * cfg.layer_kv_heads[i] * cfg.layer_head_dims[i] * size
        for i in range(cfg.first_shared_layer)
        if not cfg.is_sliding(i)
    )


def ring_bytes_per_seq(cfg: TextConfig, dtype: torch.dtype, max_context: int) -> int:
    """K+V bytes of one sequence's sliding rings (+ their recorded positions)."""
    size = torch.tensor([], dtype=dtype).element_size()
    r = min(cfg.sliding_window or 0, max_context)
    per_row = sum(
        2 * cfg.layer_kv_heads[i] * cfg.layer_head_dims[i] * size
        for i in range(cfg.first_shared_layer)
        if cfg.is_sliding(i)
    )
    return r * (per_row + 8)


def plan_geometry(
    cfg: TextConfig,
    dtype: torch.dtype,
    max_context: int,
    budget_bytes: int,
    max_seqs: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> PoolGeometry:
    """The pool that fits `budget_bytes`: the rings of max_seqs + 1 slots first, the rest in
    blocks. Refuses (EngineError) a budget that cannot hold one block per sequence."""
    if max_seqs < 1:
        raise EngineError(
            f"max_num_seqs {max_seqs} must be at least 1", f"use {arg('max_num_seqs')} 1 or more"
        )
    if block_size < 1 or block_size & (block_size - 1):
        raise EngineError(f"block size {block_size} is not a power of two", "use e.g. 64")
    rings = (max_seqs + 1) * ring_bytes_per_seq(cfg, dtype, max_context)
    per_block = block_size * (bytes_per_token(cfg, dtype) + 8)
    blocks = (budget_bytes - rings) // per_block if per_block else max_seqs + 1
    if blocks < max_seqs + 1:
        need = (rings + (max_seqs + 1) * per_block) / (1 << 20)
        raise EngineError(
            f"the KV cache budget ({budget_bytes / (1 << 20):.0f} MiB) does not hold "
            f"{max_seqs} sequences (at least {need:.0f} MiB)",
            f"lower {arg('max_num_seqs')} or {arg('max_context')}, or give the pool more memory "
            f"({arg('kv_cache_mib')}, {arg('memory_cap_mib')})",
        )
    # more blocks than every slot could ever use at once would only waste memory
    blocks = min(blocks, max_seqs * -(-max_context // block_size) + 1)
    r = (
        min(cfg.sliding_window or 0, max_context)
        if any(cfg.is_sliding(i) for i in range(cfg.first_shared_layer))
        else 0
    )
    return PoolGeometry(max_seqs, int(blocks), block_size, max_context, r)


class KVPool:
    """Every own-KV layer's rows, the block tables, and who holds what."""

    def __init__(
        self, cfg: TextConfig, geometry: PoolGeometry, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cfg = cfg
        self.geometry = g = geometry
        self.device = device
        self.dtype = dtype
        self.block_size = g.block_size
        self.ring_slots = g.ring_slots
        self.max_context = g.max_context
        self.pad_slot = g.max_seqs
        full_rows = g.num_blocks * g.block_size
        ring_rows = (g.max_seqs + 1) * g.ring_slots
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in range(cfg.first_shared_layer):
            rows = ring_rows if cfg.is_sliding(i) else full_rows
            shape = (rows, cfg.layer_kv_heads[i], cfg.layer_head_dims[i])
            self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
        self._full = [i for i in self.k if not cfg.is_sliding(i)]
        self._rings = [i for i in self.k if cfg.is_sliding(i)]
        # each layer's recorded positions: rows of one tensor per layer kind, so that opening a
        # slot or granting blocks marks every layer's rows empty in one launch, not one a layer
        # (host time between two decode steps, lab/journal.md v23)
        self._ring_pos = torch.full((len(self._rings), ring_rows), -1, dtype=torch.int64,
                                    device=device)  # fmt: skip
        self._full_pos = torch.full((len(self._full), full_rows), -1, dtype=torch.int64,
                                    device=device)  # fmt: skip
        self.pos: dict[int, torch.Tensor] = {
            **{i: self._ring_pos[j] for j, i in enumerate(self._rings)},
            **{i: self._full_pos[j] for j, i in enumerate(self._full)},
        }
        self.block_tables = torch.zeros(
            (g.max_seqs + 1, g.max_blocks_per_seq), dtype=torch.int32, device=device
        )
        # the tables on the host, written in numpy: a plan's grants reach the device in one copy
        self._tables = np.zeros(tuple(self.block_tables.shape), dtype=np.int32)
        self.blocks = BlockManager(g.num_blocks, g.max_seqs, g.block_size, g.max_context)

    def clear(self) -> None:
        """Every row back to its state at creation (zero keys and values, no positions): after the
        warm-up's compile pass, whose steps ran no kernel and left whatever memory held in the
        rows it wrote. Masked rows are still multiplied by zero, so a NaN left there would reach
        every sequence that later holds them. Only while no sequence is open."""
        for i in self.k:
            self.k[i].zero_()
            self.v[i].zero_()
        self._ring_pos.fill_(-1)
        self._full_pos.fill_(-1)
        self.block_tables.zero_()
        self._tables[:] = 0

    # ---- bookkeeping (the block manager's), mirrored on the device -----------------------------
    @property
    def usage(self) -> float:
        return self.blocks.usage

    def held(self, slot: int) -> int:
        """Blocks the sequence in `slot` holds."""
        return self.blocks.held(slot)

    def apply(self, opened: tuple[int, ...], grants: tuple[BlockGrant, ...]) -> None:
        """Mirror a step plan's bookkeeping on the device: opened slots' rings forgotten,
        granted blocks entered in the block tables and their rows marked empty."""
        r = self.ring_slots
        if self._rings:
            for slot in opened:
                self._ring_pos[:, slot * r : (slot + 1) * r].fill_(-1)
        if not grants:
            return
        # host work in numpy, then one copy for the tables and one for the rows: PyTorch gives
        # the interpreter lock away around each call, and while the server's threads run Python
        # each call waits to get it back (lab/journal.md v24)
        for g in grants:
            self._tables[g.slot, g.first : g.first + len(g.blocks)] = g.blocks
        lo = min(g.slot for g in grants)
        hi = max(g.slot for g in grants) + 1  # the rows between are copied as they stand
        host = self._staged(torch.from_numpy(self._tables[lo:hi]))
        self.block_tables[lo:hi].copy_(host, non_blocking=True)
        if self._full:  # every granted block's rows, every full layer: one launch
            ids = np.concatenate([np.asarray(g.blocks, dtype=np.int64) for g in grants])
            rows = (ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
            staged = self._staged(torch.from_numpy(rows)).to(self.device, non_blocking=True)
            self._full_pos.index_fill_(1, staged, -1)

    def _staged(self, host: torch.Tensor) -> torch.Tensor:
        """`host` in pinned memory on CUDA (a copy, so later writes to `host` do not reach it),
        so copying it queues behind the running step instead of waiting for it (the caching
        host allocator keeps the block until then)."""
        return host.pin_memory() if self.device.type == "cuda" else host

    def contiguous_rows(self, slot: int) -> slice | None:
        """The full layers' rows of `slot` as one slice when its blocks are consecutive."""
        held = self.blocks.blocks_of(slot)
        if not held or held != list(range(held[0], held[0] + len(held))):
            return None
        return slice(held[0] * self.block_size, (held[-1] + 1) * self.block_size)

    # ---- views -------------------------------------------------------------------------------
    def view(self, slot: int) -> SequenceCache:
        """A `KVCache`-like view of one sequence, for reading prompt chunks and the reference
        decode step (engine.model takes it unchanged)."""
        return SequenceCache(self, slot)

    def rows_of(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """Physical full-layer rows of `positions` of the sequence in `slot`."""
        table = self.block_tables[slot].to(torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write_rows(self, slots: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The rows tokens at `positions` of the sequences in `slots` (int tensors, one per
        token) write: (full layers' rows through the block tables, sliding layers' ring rows),
        int64, computed on the device (a CUDA graph captures it; the padding slot's rows are
        block 0 and its own ring)."""
        slots64 = slots.to(torch.int64)
        bs, r = self.block_size, self.ring_slots
        table = self.block_tables[slots64, positions // bs].to(torch.int64)
        return table * bs + positions % bs, slots64 * r + positions % max(r, 1)

    def nbytes(self) -> int:
        tensors = [*self.k.values(), *self.v.values(), *self.pos.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + (self.block_tables.numel() * 4)


class PagedLayer:
    """One full layer of one sequence seen as a `LayerCache` (slot = position): reads gather the
    sequence's rows (a copy, used by prompt reading and the reference step), writes scatter."""

    window = None

    def __init__(self, pool: KVPool, layer: int, slot: int) -> None:
        self.pool, self.layer, self.slot = pool, layer, slot

    @property
    def slots(self) -> int:
        return self.pool.held(self.slot) * self.pool.block_size

    @functools.cached_property
    def _rows(self) -> torch.Tensor | slice:
        """The sequence's rows in position order: a slice when its blocks are consecutive,
        else their indices (a view lives for one chunk or one step, while the sequence's
        blocks do not change)."""
        rows = self.pool.contiguous_rows(self.slot)
        if rows is not None:
            return rows
        return self.pool.rows_of(self.slot, torch.arange(self.slots, device=self.pool.device))

    @property
    def k(self) -> torch.Tensor:
        return self.pool.k[self.layer][self._rows]

    @property
    def v(self) -> torch.Tensor:
        return self.pool.v[self.layer][self._rows]

    @property
    def pos(self) -> torch.Tensor:
        return self.pool.pos[self.layer][self._rows]

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        rows = self.pool.rows_of(self.slot, positions)
        self.pool.k[self.layer].index_copy_(0, rows, k.to(self.pool.dtype))
        self.pool.v[self.layer].index_copy_(0, rows, v.to(self.pool.dtype))
        self.pool.pos[self.layer].index_copy_(0, rows, positions)


class SequenceCache:
    """What engine.model and engine.fast.prefill read as a cache, for one sequence of a pool."""

    def __init__(self, pool: KVPool, slot: int) -> None:
        self.pool, self.slot = pool, slot
        self.max_context = pool.max_context
        self.layers: dict[int, LayerCache | PagedLayer] = {}
        r = pool.ring_slots
        for i in pool.k:
            if pool.cfg.is_sliding(i):
                rows = slice(slot * r, (slot + 1) * r)
                self.layers[i] = LayerCache(pool.k[i][rows], pool.v[i][rows], pool.pos[i][rows], r)
            else:
                self.layers[i] = PagedLayer(pool, i, slot)
