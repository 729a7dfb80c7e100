"""Who holds which KV blocks and sequence slots: host bookkeeping, no tensors.

The scheduler's policy decides with it (admission, growth, freeing) and hands the changes to
the runner inside its step plan (`BlockGrant`); the runner mirrors them into the device's block
tables (engine/kv_pool.py). Block 0 belongs to the padding slot (`max_seqs`), so it is never
handed out. Blocks are handed out lowest id first: a sequence alone in the pool holds
consecutive blocks, whose rows the reference reads as a view instead of a gathered copy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockGrant:
    """Blocks given to a slot: `blocks` become its block-table entries first.. onwards."""

    slot: int
    first: int
    blocks: tuple[int, ...]


class BlockManager:
    """Free lists of blocks and slots, and each slot's blocks in position order."""

    def __init__(self, num_blocks: int, max_seqs: int, block_size: int, max_context: int) -> None:
        self.num_blocks = num_blocks  # including block 0, the padding slot's
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.max_context = max_context
        self._free_blocks = list(range(num_blocks - 1, 0, -1))  # popped lowest first
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._held: dict[int, list[int]] = {}

    @property
    def total_blocks(self) -> int:
        """Blocks sequences can hold (block 0 excluded)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of the shared blocks held by sequences (vLLM's kv_cache_usage_perc)."""
        total = self.total_blocks
        return (total - len(self._free_blocks)) / total if total else 0.0

    def held(self, slot: int) -> int:
        return len(self._held.get(slot, ()))

    def blocks_of(self, slot: int) -> list[int]:
        return list(self._held.get(slot, ()))

    def blocks_for(self, tokens: int) -> int:
        return -(-min(tokens, self.max_context) // self.block_size)

    def open_slot(self) -> int:
        """A slot for a new sequence; ValueError when none is free (the policy checks first)."""
        if not self._free_slots:
            raise ValueError("no free sequence slot")
        slot = self._free_slots.pop()
        self._held[slot] = []
        return slot

    def grow(self, slot: int, tokens: int) -> BlockGrant | None:
        """Make `slot` hold positions 0..tokens-1: the grant of the new blocks (None when it
        already does); ValueError when the free blocks do not reach (nothing changes)."""
        held = self._held[slot]
        need = self.blocks_for(tokens) - len(held)
        if need <= 0:
            return None
        if need > len(self._free_blocks):
            raise ValueError(f"slot {slot} needs {need} blocks, {len(self._free_blocks)} free")
        new = tuple(self._free_blocks.pop() for _ in range(need))
        grant = BlockGrant(slot, len(held), new)
        held.extend(new)
        return grant

    def close_slot(self, slot: int) -> None:
        """The sequence in `slot` is done: its blocks and the slot go back to the free lists."""
        held = self._held.pop(slot, None)
        if held is None:
            return
        self._free_blocks.extend(reversed(held))
        self._free_blocks.sort(reverse=True)  # lowest first again (consecutive for one sequence)
        self._free_slots.append(slot)
