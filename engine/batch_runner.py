"""BatchRunner: how a multi-sequence engine computes, over its KVPool.

Two jobs for the scheduler (engine/scheduler.py), which decides what runs when:
* `read_chunks([(slot, ids, start), ...], budget)`: prompt tokens into sequences' blocks and
  rings (the KV-producing layers only, as engine.generate.read_prompt reads a prompt's body),
  several sequences in one pass on the fast path;
* `step(tokens, positions, slots)`: one new token for each of B sequences -> logits [B, V].

The arrangement is chosen once, like the single-sequence Backend: on the fast path the batched
fused step (engine/fast/batch_decode.py) replayed as one CUDA graph per batch bucket; elsewhere
(the CPU reference) the model's own decode_step, row by row, over each sequence's view of the
pool, which is the ground truth the batched step is tested against.
"""

from __future__ import annotations

import torch

from engine.kv_pool import KVPool
from engine.model import Gemma4Model
from engine.options import EngineOptions


class BatchRunner:
    def __init__(
        self, model: Gemma4Model, pool: KVPool, options: EngineOptions, backend, max_batch: int
    ) -> None:
        self.model = model
        self.pool = pool
        self.options = options
        self.max_batch = max_batch
        self.batched = False  # the fused batched step runs (else row by row)
        self.graphs = None
        self._read = self._rows_read
        self._step = self._rows_step
        if options.fast_on(model.device):
            from engine.fast import batch_decode

            fused = backend._fused_layers()
            if options.fused_prefill:
                from engine.fast import prefill

                if prefill.supported(model, fused):
                    reader = prefill.FusedPrefill(model, fused, backend._kernels())
                    self._read = lambda parts, budget: reader.chunks(  # noqa: E731
                        [(ids, start, pool.view(slot)) for slot, ids, start in parts], budget
                    )
            if batch_decode.supported(model, fused):
                decoder = batch_decode.BatchDecoder(
                    model, pool, fused, backend._kernels(), max_batch
                )
                self._step = decoder.step
                self.batched = True
        if self.batched and options.graphs_on(model.device):
            from engine.fast.batch_graph import BatchGraphs, buckets_for

            self.graphs = BatchGraphs(
                self._step, buckets_for(max_batch), model.device, pool.pad_slot
            )

    def warm_up(self) -> None:
        """Capture every bucket's graph now (compiling and tuning every kernel on the way), so
        the first requests do not wait for it."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def read_chunks(self, parts: list[tuple[int, torch.Tensor, int]], budget: int | None) -> None:
        """Prompt chunks of several sequences, (slot, ids, start) each, read in one pass where
        the fused reader runs (one chunk after another on the reference)."""
        self._read(parts, budget)

    def _rows_read(self, parts: list[tuple[int, torch.Tensor, int]], budget: int | None) -> None:
        for slot, ids, start in parts:
            self.model.prefill_chunk(ids, start, self.pool.view(slot), False, budget)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Logits [B, V] (on CUDA a view of the graph's output: read it before the next step)."""
        if self.graphs is not None:
            return self.graphs.run(tokens, positions, slots)
        return self._step(tokens, positions, slots)

    @torch.inference_mode()
    def _rows_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The reference: each row alone through the model's decode_step on its view."""
        model = self.model
        out = [
            type(model).decode_step(
                model, tokens[b : b + 1], positions[b : b + 1], self.pool.view(int(s))
            )  # fmt: skip
            for b, s in enumerate(slots.tolist())
        ]
        return torch.cat(out)
