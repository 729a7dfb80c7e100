"""The engine's KV cache: one buffer per layer that computes its own K/V, positions on the device.

Full-attention layers get one slot per position up to the max context (slot = position). Sliding
layers get a ring of `window` slots (slot = position % window) that records which position each
slot holds. KV-shared layers own nothing: they read their producer layer's buffers. Every slot's
position lives in a device tensor (`pos`, -1 = empty), so attention masks are computed on the
device from tensors and a decode step needs no Python int that changes per token (CUDA-graph
ready). Buffers start zeroed: masked slots are multiplied by a zero probability, and zeros (not
uninitialised memory that may hold NaN) keep that product zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import TextConfig


@dataclass
class LayerCache:
    """K/V of one producing layer: k, v [slots, kv_heads, head_dim]; pos int64 [slots]."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    window: int | None  # None: full layer (slot = position); else ring size (slot = pos % window)

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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))


class KVCache:
    """The caches of every K/V-producing layer, sized for `max_context` positions."""

    def __init__(
        self, cfg: TextConfig, max_context: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.max_context = max_context
        self.layers: dict[int, LayerCache] = {}
        for i in range(cfg.first_shared_layer):
            window = cfg.sliding_window if cfg.is_sliding(i) else None
            slots = min(window, max_context) if window is not None else max_context
            shape = (slots, cfg.layer_kv_heads[i], cfg.layer_head_dims[i])
            self.layers[i] = LayerCache(
                k=torch.zeros(shape, dtype=dtype, device=device),
                v=torch.zeros(shape, dtype=dtype, device=device),
                pos=torch.full((slots,), -1, dtype=torch.int64, device=device),
                window=slots if window is not None else None,
            )

    def reset(self) -> None:
        """Forget every position (a new sequence starts); buffers are reused."""
        for layer in self.layers.values():
            layer.pos.fill_(-1)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())
