"""The decode step as one CUDA graph: captured once per (model, cache), replayed every token.

A decode step launches hundreds of small kernels (35 layers of norms, GEMVs, attention...);
launching them one by one from Python costs more than running them. The model's decode_step
takes its token and position as device tensors and computes every mask, cache slot and rotary
angle from them, so nothing in the step is a Python int that changes per token: the graph is
captured once against two static input buffers and replayed, after copying the new token and
position into those buffers. The first call runs the step eagerly (on a side stream, as graph
capture requires) so that every kernel is compiled and every GEMV shape tuned before capture.
"""

from __future__ import annotations

import torch


class GraphDecoder:
    """`decoder(token, position) -> logits [1, V]`, the same as `model.decode_step`.

    `step` (default: the model's own decode_step on `cache`) is what gets captured; the fused
    decoder's step is the usual choice on CUDA.
    """

    def __init__(self, model, cache, step=None) -> None:
        self.model = model
        self.cache = cache
        self.step = step or (
            lambda token, position: type(model).decode_step(model, token, position, cache)
        )
        dev = model.device
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.position = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _capture(self) -> None:
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            # eager warm-up: compiles and tunes every kernel; it is this token's real step (the
            # replay below rewrites the same cache slot with the same values)
            self.step(self.token, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            self.logits = self.step(self.token, self.position)
        self.graph = graph

    @torch.inference_mode()
    def __call__(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token.reshape(1))
        self.position.copy_(position.reshape(1))
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.logits is not None
        self.graph.replay()
        return self.logits
