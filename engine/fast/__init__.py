"""The engine's fast path on NVIDIA GPUs: Triton kernels behind engine/ops.py, and the decode
step replayed as a CUDA graph.

The engine picks it by itself: CUDA tensors take the Triton branches in engine/ops.py (the CPU
runs the PyTorch reference), and generation decodes through `decoder_for`, which returns a
CUDA-graph replayer on CUDA and the model's plain decode_step elsewhere.

| variable              | meaning                                                   | default |
|-----------------------|-----------------------------------------------------------|---------|
| GPURIG_FAST           | "0" turns the fast path off (reference ops, no graph)     | on      |
| GPURIG_CUDA_GRAPH     | "0" keeps the Triton kernels but decodes without a graph  | on      |
| GPURIG_DECODE         | "fused" (fused kernels) or "reference" (the model's step) | fused   |
| GPURIG_EPILOGUES      | "glu": GELU(*up) in the GEMVs, residual+norm a kernel;    | glu     |
|                       | "all": residual+norm in the GEMVs' last program too;      |         |
|                       | "0": every norm/residual/GELU a separate kernel           |         |
| GPURIG_PDL            | "1": programmatic dependent launch (sm_90+ only)          | off     |
| GPURIG_PREFETCH       | "1": L2 prefetch of weight slices first (sm_90+ only)     | off     |
| GPURIG_GEMV_H2        | "0": exact fp32-unpack GEMV instead of half2 (16-bit)     | on      |
| GPURIG_FUSE_QKV_ATTN  | "1": q/k/v norms + RoPE + cache write in the attention    | off     |
| GPURIG_FAST_PREFILL   | "0": prompt chunks through the model's own layer code     | on      |
| GPURIG_PROLOGUE       | "1": residual+norm in the next GEMV's prologue (2 of 3); | 1       |
|                       | "all": 3 of 3; "0": each residual+norm its own kernel     |         |

GPURIG_FAST=force runs the fast path on any device Triton runs on (the CPU interpreter, for
tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def fast_enabled(device: torch.device) -> bool:
    """True on CUDA unless GPURIG_FAST=0; anywhere with GPURIG_FAST=force."""
    flag = os.environ.get("GPURIG_FAST", "1")
    return flag == "force" or (device.type == "cuda" and flag != "0")


def graphs_enabled(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and fast_enabled(device)
        and os.environ.get("GPURIG_CUDA_GRAPH", "1") != "0"
    )


def _step_fn(model, cache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if fast_enabled(model.device) and os.environ.get("GPURIG_DECODE", "fused") == "fused":
        from engine.fast import decode

        if decode.supported(model):
            return decode.FusedDecoder(model, cache).step
    # the class's step: an instance may route decode_step back here
    return lambda token, position: type(model).decode_step(model, token, position, cache)


def decoder_for(model, cache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`step(token, position) -> logits [1, V]` for this model and cache: on CUDA the fused
    decode step captured as a CUDA graph on first use; elsewhere the model's eager step."""
    # kept on the cache itself: the decoder (graph, static buffers) lives and dies with it
    per_model = cache.__dict__.setdefault("_gpurig_decoders", {})
    key = (id(model), os.environ.get("GPURIG_DECODE", "fused"), graphs_enabled(model.device),
           fast_enabled(model.device),
           os.environ.get("GPURIG_EPILOGUES", "glu"), os.environ.get("GPURIG_PDL", "0"),
           os.environ.get("GPURIG_PREFETCH", "0"), os.environ.get("GPURIG_GEMV_H2", "1"),
           os.environ.get("GPURIG_FUSE_QKV_ATTN", "0"), os.environ.get("GPURIG_PROLOGUE", "1"))  # fmt: skip
    dec = per_model.get(key)
    if dec is None:
        step = _step_fn(model, cache)
        if graphs_enabled(model.device):
            from engine.fast.graph import GraphDecoder

            dec = GraphDecoder(model, cache, step)
        else:
            dec = step
        per_model[key] = dec
    return dec


def prefill_body_for(model, cache) -> Callable[..., None]:
    """`chunk(ids, start, score_budget=None)`: a prompt chunk into the KV-producing layers'
    caches, as `model.prefill_chunk(ids, start, cache, last=False)` does; with the fused kernels
    where the fast path runs and the model qualifies (GPURIG_FAST_PREFILL=0: the model's own)."""
    if fast_enabled(model.device) and os.environ.get("GPURIG_FAST_PREFILL", "1") != "0":
        from engine.fast import prefill

        if prefill.supported(model):
            fused = prefill.FusedPrefill(model)
            return lambda ids, start, budget=None: fused.chunk(ids, start, cache, budget)
    return lambda ids, start, budget=None: model.prefill_chunk(ids, start, cache, False, budget)


def prefill_chunk_for(device: torch.device, memory_cap_mib: int | None = None) -> int:
    """The most prompt tokens per forward pass on this device: 4,096 on CUDA (reading a prompt
    is host-bound below that on a big GPU), 256 elsewhere. Each prompt's real chunk is chosen
    from the memory left when it is read (engine.memory.plan_prompt), so a small or capped card
    reads in smaller chunks instead of running out."""
    return 4096 if device.type == "cuda" else 256
