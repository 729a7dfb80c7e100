"""The engine's fast path on NVIDIA GPUs: Triton kernels behind engine/ops.py's dispatch points
(`ops_fast.FastOps`), a fused decode step (`decode`), fused prompt chunks (`prefill`), and the
decode step replayed as a CUDA graph (`graph`).

Nothing here chooses itself: engine.backend.Backend picks this path once, at load, from the
engine's EngineOptions (engine/options.py), and owns the fused weights and the decoder.
"""
