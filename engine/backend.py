"""Backend: how one engine computes, chosen once at load from its EngineOptions.

Why here and not per call: the switches used to be read from the environment on every decode
step, and the decoder was cached on the KV cache under a key of those variables. A Backend is
made once per Engine, owns the fused weights and the decoder (CUDA graph, static buffers), and
lives and dies with the engine.

- reference: engine/ops.py's PyTorch bodies; the model's own decode_step and prefill_chunk.
- fast (CUDA, or anywhere with EngineOptions(fast="force")): engine/fast/'s Triton kernels; the
  fused decode step when the model fits it (else the model's step on the fast kernels), replayed
  as a CUDA graph on CUDA; fused prompt chunks that skip the KV-shared layers, the last prompt
  token through the decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import ops
from engine.cache import KVCache
from engine.model import Gemma4Model
from engine.options import EngineOptions

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_kernels(options: EngineOptions, device: torch.device) -> ops.Ops:
    """The dispatch points a model on `device` is built with: FastOps when the fast path serves
    the device, else the reference set."""
    if options.fast_on(device):
        from engine.fast.ops_fast import FastOps

        return FastOps(prefix_sdpa=options.prefix_sdpa, half2=options.half2_gemv)
    return ops.Ops(prefix_sdpa=options.prefix_sdpa)


def prefill_chunk_for(device: torch.device) -> int:
    """The most prompt tokens per forward pass on this device: 4,096 on CUDA (reading a prompt
    is host-bound below that on a big GPU), 256 elsewhere. Each prompt's real chunk is chosen
    from the memory left when it is read (engine.memory.plan_prompt), so a small or capped card
    reads in smaller chunks instead of running out."""
    return 4096 if device.type == "cuda" else 256


class Backend:
    """The decode step and the prompt-chunk reader of one model and cache."""

    def __init__(self, model: Gemma4Model, cache: KVCache, options: EngineOptions) -> None:
        self.model = model
        self.cache = cache
        self.options = options
        self.fast = options.fast_on(model.device)
        self._fused = None
        self._step: Step | None = None

    @property
    def last_token_by_step(self) -> bool:
        """Read a prompt's last token through the decode step (the fast path's arrangement)."""
        return self.fast

    def _fused_layers(self):
        if self._fused is None:
            from engine.fast.fuse import fuse_projections

            self._fused = fuse_projections(self.model)
        return self._fused

    def _kernels(self):
        from engine.fast.ops_fast import FastOps

        kernels = self.model.ops
        if isinstance(kernels, FastOps):
            return kernels
        opts = self.options
        return FastOps(prefix_sdpa=opts.prefix_sdpa, half2=opts.half2_gemv)

    def step(self) -> Step:
        """`step(token [1], position [1]) -> logits [1, V]`, made on first use and kept."""
        if self._step is None:
            self._step = self._make_step()
        return self._step

    def _make_step(self) -> Step:
        model, cache = self.model, self.cache
        # the class's step: an instance's decode_step may be routed back to this backend
        step: Step = lambda token, position: type(model).decode_step(model, token, position, cache)  # noqa: E731
        if self.fast:
            from engine.fast import decode

            fused = self._fused_layers()
            if decode.supported(model, fused):
                step = decode.FusedDecoder(model, cache, fused, self._kernels()).step
        if self.options.graphs_on(model.device):
            from engine.fast.graph import GraphDecoder

            return GraphDecoder(model, cache, step)
        return step

    def prefill_body(self) -> Callable[..., None]:
        """`chunk(ids, start, score_budget=None)`: a prompt chunk into the KV-producing layers'
        caches, as `model.prefill_chunk(ids, start, cache, last=False)` does; by the fused
        kernels where the fast path runs, fused_prefill is on and the model qualifies."""
        model, cache = self.model, self.cache
        if self.fast and self.options.fused_prefill:
            from engine.fast import prefill

            fused = self._fused_layers()
            if prefill.supported(model, fused):
                reader = prefill.FusedPrefill(model, fused, self._kernels())
                return lambda ids, start, budget=None: reader.chunk(ids, start, cache, budget)
        return lambda ids, start, budget=None: model.prefill_chunk(ids, start, cache, False, budget)
