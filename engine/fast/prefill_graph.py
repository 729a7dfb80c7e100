"""A prompt pass replayed as a CUDA graph, one per bucket of pass sizes (64 .. the prefill budget).

Why: reading a prompt is bound by the host. On the H200 a pass of one 511-token prompt took
9.7 ms of wall time for 3.1 ms of kernels, and four of them 13.1 ms for 6.9 ms (lab/journal.md,
v16): about 400 launches, each costing the host more than the GPU spends on it. Under load the
other sequences' decode steps wait for every pass, so the host's share of it was most of what
separated the c=8 and c=16 sweeps from their goals. Replayed, a pass costs its kernels' time.

What a graph covers: passes of fresh prompts only (every segment at position 0; the scheduler
reads a prompt that fits one chunk in one pass, engine/scheduler.py), at most `max_segments` of
them and `buckets[-1]` tokens in all. Its inputs are fixed buffers: the token ids, and per row
its position, its sequence's slot and the first position its ring keeps; the segments' first
rows (cu_q). Rows past the pass's tokens are padding: token 0 at position 0 of the padding slot,
whose writes land where the decode step's padding rows write (block 0 and the padding slot's
ring, which no sequence holds). The write rows are computed inside the graph from the block
tables (`PassAttention.fresh`), and the attention kernel's grid runs over row blocks of the
pass (`flat`), so neither depends on how the tokens split into segments. Any other pass (a
continuing chunk, a longer pass) runs eagerly as before.

Memory: the graphs share one pool holding the largest bucket's intermediates (the reader's peak
at the budget), which eager passes cannot use; so they are captured only where the device has
room for that twice over after the KV pool (`capture_all` says why not otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from engine.fast.prefill_attention import PassAttention
from engine.kernels.launch import compiling_only
from engine.kv_pool import KVPool, SequenceCache

log = logging.getLogger(__name__)

SMALL_BUCKETS = (64, 128, 256, 512)
STEP = 512  # buckets past SMALL_BUCKETS: every multiple of this up to the budget


def pass_buckets(max_tokens: int) -> list[int]:
    """The pass sizes captured: powers of two from 64 to 512, then every multiple of 512, the
    last one `max_tokens` itself (the prefill budget)."""
    out = [b for b in SMALL_BUCKETS if b < max_tokens]
    b = STEP * 2
    while b < max_tokens:
        out.append(b)
        b += STEP
    out.append(max_tokens)
    return sorted(set(out))


class PassGraphs:
    """`run(segments) -> bool`: the pass by graph replay, or False (run it eagerly)."""

    def __init__(self, reader, pool: KVPool, max_tokens: int, max_segments: int) -> None:
        self.reader = reader  # engine.fast.prefill.FusedPrefill
        self.pool = pool
        self.buckets = pass_buckets(max_tokens)
        self.max_segments = max_segments
        dev = pool.device
        top = self.buckets[-1]
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)
        # per row: position, slot, first position its ring keeps
        self.meta = torch.zeros(3, top, dtype=torch.int64, device=dev)
        self.meta[1].fill_(pool.pad_slot)
        self.cu_q = torch.zeros(max_segments + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _forward(self, size: int) -> None:
        """The pass over the first `size` rows of the fixed buffers (eager, or being captured)."""
        pos, slots, keep = self.meta[0, :size], self.meta[1, :size], self.meta[2, :size]
        joint = PassAttention.fresh(self.pool, self.cu_q, pos, slots, keep)
        with torch.inference_mode():
            self.reader.forward(self.ids[:size], pos, joint)

    def compile_all(self) -> None:
        """Every bucket's pass once on padding rows, inside engine.kernels.launch.compile_ahead:
        its kernels (the flat attention grid, each bucket's specialisations) queue for
        compiling; nothing is captured. What it writes lands in the padding rows."""
        self._pad()
        for size in reversed(self.buckets):
            self._forward(size)

    def capture_all(self, free_bytes: int | None, need_bytes: int) -> bool:
        """Capture every bucket (largest first, one shared pool) if `free_bytes`, what the device
        has left, holds `need_bytes` (the reader's peak at the budget) twice; False otherwise
        (passes then run eagerly, as they did)."""
        if free_bytes is not None and free_bytes < 2 * need_bytes:
            log.info("prompt passes run without CUDA graphs: %d MiB left, %d MiB wanted",
                     free_bytes >> 20, (2 * need_bytes) >> 20)  # fmt: skip
            return False
        self._pad()
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._capture(size)
        self.reader.weights = None  # allocated inside the capture: the graphs' pool keeps it
        return True

    def _pad(self) -> None:
        self.ids.zero_()
        self.meta[0].zero_()
        self.meta[1].fill_(self.pool.pad_slot)
        self.meta[2].zero_()
        self.cu_q.zero_()

    def _capture(self, size: int) -> None:
        stream = torch.cuda.Stream(device=self.pool.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)  # eager first: compiles, tunes, loads cuBLAS outside capture
        torch.cuda.current_stream().wait_stream(stream)
        self.reader.weights = None  # the capture allocates its own, in the graphs' pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size)
        self._graphs[size] = graph

    def bucket_for(self, segments: Sequence[tuple[torch.Tensor, int, object]]) -> int | None:
        """The bucket a pass fits, or None where no graph can read it (it runs eagerly)."""
        if len(segments) > self.max_segments:
            return None
        for _, start, cache in segments:
            if start != 0 or not isinstance(cache, SequenceCache) or cache.pool is not self.pool:
                return None
        tokens = sum(ids.shape[0] for ids, _, _ in segments)
        return next((b for b in self.buckets if b >= tokens), None)

    def run(self, segments: Sequence[tuple[torch.Tensor, int, object]]) -> bool:
        """Read a pass of (ids, start, cache) segments by replaying its bucket's graph; False
        (nothing done) where no graph applies."""
        if not self._graphs or compiling_only():
            return False
        size = self.stage(segments)
        if size is None:
            return False
        self._graphs[size].replay()
        return True

    def stage(self, segments: Sequence[tuple[torch.Tensor, int, object]]) -> int | None:
        """The pass's inputs into the fixed buffers; its bucket, or None (nothing staged)."""
        size = self.bucket_for(segments)
        if size is None:
            return None
        # in numpy: the engine thread builds these between two launches, and numpy's ops cost
        # the host about a tenth of PyTorch's on CPU tensors
        counts = np.array([ids.shape[0] for ids, _, _ in segments], dtype=np.int64)
        t, n = int(counts.sum()), len(segments)
        ends = np.cumsum(counts)
        meta = np.zeros((3, size), dtype=np.int64)  # padding rows: position 0, ring start 0
        meta[0, :t] = np.arange(t) - np.repeat(ends - counts, counts)
        meta[1, :t] = np.repeat(np.array([c.slot for _, _, c in segments]), counts)
        meta[1, t:] = self.pool.pad_slot
        meta[2, :t] = np.repeat(counts - max(self.pool.ring_slots, 1), counts)
        cu = np.full(self.max_segments + 1, t, dtype=np.int32)
        cu[0] = 0
        cu[1 : n + 1] = ends
        self.meta[:, :size].copy_(_pinned(torch.from_numpy(meta)), non_blocking=True)
        self.cu_q.copy_(_pinned(torch.from_numpy(cu)), non_blocking=True)
        ids = segments[0][0] if n == 1 else torch.cat([s[0] for s in segments])
        self.ids[:t].copy_(ids)
        self.ids[t:size].zero_()
        return size


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """Pinned where there is CUDA, so the copy queues behind the running work instead of waiting
    for it (the caching host allocator keeps the block until the copy has run)."""
    return host.pin_memory() if torch.cuda.is_available() else host
