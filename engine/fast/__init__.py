"""The engine's fast path on NVIDIA GPUs: Triton kernels behind engine/ops.py's dispatch points
(`ops_fast.FastOps`), the fused decode step of a batch (`batch_decode`, one row included),
fused prompt chunks (`prefill`), and the step replayed as one CUDA graph per batch bucket
(`batch_graph`).

Nothing here chooses itself: engine/runner.py's ModelRunner picks this path once, at load, from
the engine's EngineOptions (engine/options.py), and owns the fused weights and the decoder.
"""
