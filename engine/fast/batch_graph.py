"""The batched decode step replayed as CUDA graphs, one per batch-size bucket (1, 2, 4, 8, 16).

Why buckets: a graph fixes its tensors' shapes, and a step of ~600 launches costs the host far
more to launch one by one than the GPU takes to run it at small batches. A batch of B rows runs
the smallest bucket >= B; the spare rows are padding pointed at the pool's padding slot (their
writes land in block 0, which no sequence holds, and their logits are ignored). All buckets share
one memory pool for their intermediates (replays never overlap), captured largest first, as vLLM
does.

Buckets of up to `pdl_rows` rows are captured with programmatic dependent launch
(engine/kernels/pdl.py): each kernel launches while the one before finishes and requests its
first weights before it waits. It pays where the step is many short kernels (one row most); at
16 rows, and in the prompt passes, it measured slower (lab/journal.md, v20), so those launch as
before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.kernels.launch import compiling_only, pdl_launches
from engine.kernels.step_inputs import pick_tokens
from engine.options import triton_interpreted


class GreedyStep(Protocol):
    """A batch step that also writes each row's greedy id into `ids` where given
    (engine.fast.batch_decode.BatchDecoder.step)."""

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


BUCKETS = (1, 2, 4, 8, 16)
PDL_ROWS = 8  # the largest bucket captured with PDL where the device has it (EngineOptions.pdl)


PDL_DRIVER = 12030  # CUDA 12.3: stream capture keeps a programmatic launch as a graph edge


def pdl_supported(device: torch.device) -> bool:
    """PDL can be used on this device: an NVIDIA GPU of sm_90 or later (griddepcontrol), a
    driver that captures it into graphs, not the interpreter, and a Triton whose launcher sets
    the launch attribute (`launch_pdl`)."""
    if device.type != "cuda" or torch.version.hip is not None or triton_interpreted():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(index) and _driver_version() >= PDL_DRIVER and _triton_launches_pdl()


@functools.cache
def _driver_version() -> int:
    """The CUDA driver's version (12030 for 12.3), 0 where it cannot be asked."""
    import ctypes

    try:
        version = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return version.value


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.cache
def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def buckets_for(max_batch: int) -> list[int]:
    """The bucket sizes a scheduler of `max_batch` sequences needs: the powers of two up to 16,
    then multiples of 16, ending at max_batch itself."""
    out = [b for b in BUCKETS if b < max_batch]
    b = 32
    while b < max_batch and max_batch > 16:
        out.append(b)
        b += 16
    out.append(max_batch)
    return sorted(set(out))


def bucket_of(rows: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")


INPUTS = 4  # a step's staged inputs, one row each: source row, fresh token, position, slot


class _Bucket:
    def __init__(self, size: int, device: torch.device, pad_slot: int) -> None:
        self.size = size
        # [source row in the previous step (-1: take the fresh token), fresh token, position,
        # slot] per batch row; padding rows: -1, 0, position 0, the padding slot
        self.inputs = torch.zeros(INPUTS, size, dtype=torch.int64, device=device)
        self.inputs[0].fill_(-1)
        self.inputs[3].fill_(pad_slot)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class BatchGraphs:
    """`run(tokens [B], positions [B], slots [B]) -> logits [B, V]` by graph replay; the engine
    loop's `run_staged(host [4, B]) -> (logits, ids)` stages a step's inputs in one copy.

    Each replay also picks its rows' tokens and makes their greedy ids on the device: a row
    whose token is the previous step's output reads it from `ids` (the previous replay's
    argmax, or what a sampler wrote over it), and the replay's argmax writes `ids` for the
    next. Done between replays instead, those were a staging copy and about ten small launches
    a step, each waiting on the host (lab/journal.md v22); the pick is one kernel
    (engine/kernels/step_inputs.py).
    """

    def __init__(self, step: GreedyStep, buckets: Sequence[int], device: torch.device,
                 pad_slot: int, pdl_rows: int = 0) -> None:  # fmt: skip
        self.step = step
        self.pdl_rows = pdl_rows
        self.buckets = sorted(buckets)
        self.device = device
        self.pad_slot = pad_slot
        self._by_size = {b: _Bucket(b, device, pad_slot) for b in self.buckets}
        self._pool = None
        # every replay's greedy ids (its bucket's rows): the next replay's source rows
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self._padding = torch.tensor([-1, 0, 0, pad_slot], dtype=torch.int64)[:, None]

    def capture_all(self) -> None:
        """Capture every bucket now (largest first), so no request waits for a capture."""
        for b in reversed(self.buckets):
            self._capture(self._by_size[b])

    def compile_all(self) -> None:
        """Every bucket's step once, eagerly, on padding rows, to be called inside
        engine.kernels.launch.compile_ahead: its kernels queue for compiling, nothing is
        captured."""
        with torch.inference_mode():
            for b in reversed(self.buckets):
                bucket = self._by_size[b]
                with self._launches(bucket):
                    self._staged_step(bucket)

    def _launches(self, bucket: _Bucket) -> contextlib.AbstractContextManager[None]:
        """How this bucket's kernels launch: with PDL up to `pdl_rows` rows."""
        return pdl_launches(bucket.size <= self.pdl_rows)

    def _staged_step(self, bucket: _Bucket) -> torch.Tensor:
        """What a replay runs: the rows' tokens from the staged inputs and the previous ids,
        the step, and the greedy ids of every row into `ids`."""
        tokens, positions, slots = pick_tokens(bucket.inputs, self.ids)
        return self.step(tokens, positions, slots, ids=self.ids[: bucket.size])

    def _capture(self, bucket: _Bucket) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with self._launches(bucket):
            self._capture_as_launched(bucket)

    def _capture_as_launched(self, bucket: _Bucket) -> None:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            # eager warm-up on padding rows: compiles and tunes every kernel outside capture
            self._staged_step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            bucket.logits = self._staged_step(bucket)
        bucket.graph = graph

    def _replay(self, bucket: _Bucket, rows: int) -> torch.Tensor:
        if compiling_only():  # the warm-up's compile pass: launches compile, nothing is captured
            with self._launches(bucket):
                return self._staged_step(bucket)[:rows]
        if bucket.graph is None:
            self._capture(bucket)
        assert bucket.graph is not None and bucket.logits is not None
        bucket.graph.replay()
        return bucket.logits[:rows]

    @torch.inference_mode()
    def run_staged(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step from the host's [4, B] int64 inputs (source row in the previous step or -1,
        fresh token, position, slot): the logits [B, V] (the graph's output buffer: read it
        before the next step) and the greedy ids [B] (a view of `ids`: a sampled row's token
        is written over its id in place, and the next step's source rows read it)."""
        rows = host.shape[1]
        bucket = self._by_size[bucket_of(rows, self.buckets)]
        if rows < bucket.size:  # padding rows: the padding slot, position 0
            host = torch.cat([host, self._padding.expand(INPUTS, bucket.size - rows)], dim=1)
        if self.device.type == "cuda":  # pinned: the copy queues instead of waiting
            host = host.pin_memory()
        bucket.inputs.copy_(host, non_blocking=True)
        return self._replay(bucket, rows), self.ids[:rows]

    @torch.inference_mode()
    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One step of the given device tokens (for the lab scripts and tests)."""
        rows = tokens.shape[0]
        bucket = self._by_size[bucket_of(rows, self.buckets)]
        inputs = bucket.inputs
        inputs[:, rows:].copy_(self._padding.to(self.device).expand(INPUTS, bucket.size - rows))
        inputs[0, :rows].fill_(-1)
        inputs[1, :rows].copy_(tokens)
        inputs[2, :rows].copy_(positions)
        inputs[3, :rows].copy_(slots)
        return self._replay(bucket, rows)
