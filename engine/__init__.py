"""The in-process Gemma 4 engine: packed 4-bit weights from disk to arithmetic.

Public surface (the contract engine-speed and engine-server build on):

    import engine
    eng = engine.load("ckpt/", device=None, max_context=None, memory_cap_mib=None, prefill_chunk=None,
                      dtype=None, options=EngineOptions())  # front doors: EngineOptions.from_env()
    eng = engine.load("ckpt/", max_num_seqs="auto")       # continuous batching (the server's)
    new_ids = eng.generate(ids, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
                           seed=None, stop_ids=None, logit_bias=None)  # {id: bias}
    gen = eng.stream(ids, 64)                             # a Generation (engine/generation.py)
    for tok in gen: ...                                   # .close() stops it; then
    gen.finish_reason, gen.completion_tokens, gen.timings # "stop" | "length" | None
    gen = eng.stream(ids, 64, logprobs=5)                 # gen.logprobs[i]: tokens[i]'s
                                                          # engine.logprobs.TokenLogprobs
    eng.tokenizer, eng.chat_template, eng.bos_id, eng.eos_ids, eng.max_context,
    eng.model_dir, eng.model_name, eng.device, eng.memory_report()

Options: engine.options.EngineOptions, one frozen object for every switch (fast path, CUDA
graph, fused prefill, half2 GEMV, ...); `EngineOptions.from_env()` reads the GPURIG_* variables.
Errors: engine.errors.EngineError, CheckpointError, ContextLengthError (.limit, .requested).
Checkpoints: engine.checkpoint_maker.make_checkpoint / quantize_checkpoint. Kernel dispatch
points: engine/ops.py (reference) and engine/fast/ops_fast.py (Triton); which one, and the
decode step, are chosen once at load by engine/backend.py. Layout of 4-bit embeddings: engine/FORMAT.md.

Importing this package is cheap: torch loads on first use of `load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import CheckpointError, ContextLengthError, EngineError, GenerationError
from engine.options import EngineOptions

if TYPE_CHECKING:
    import os

    import torch

    from engine.memory import MemoryReport
    from engine.runtime import Engine

__all__ = [
    "CheckpointError",
    "ContextLengthError",
    "Engine",
    "EngineError",
    "EngineOptions",
    "GenerationError",
    "MemoryReport",
    "load",
]


def load(
    path: str | os.PathLike[str],
    device: str | torch.device | None = None,
    max_context: int | None = None,
    memory_cap_mib: int | None = None,
    prefill_chunk: int | None = None,
    dtype: torch.dtype | None = None,
    options: EngineOptions | None = None,
    max_num_seqs: int | str | None = None,
    prefill_budget: int | None = None,
    kv_cache_mib: float | None = None,
    warm_up: bool = True,
) -> Engine:
    """Load a Gemma 4 W4A16 checkpoint directory (see engine.runtime.load for every argument).

    device None: cuda when available, else cpu. max_context None: the model's
    max_position_embeddings. dtype None: bfloat16 on CUDA (float16 below capability 8.0),
    float32 on the CPU. options None: EngineOptions() (the defaults, not the environment).
    max_num_seqs (an int or "auto"): many sequences at once, continuously batched over a shared
    KV block pool (engine/scheduler.py); `stream` is then safe from any thread."""
    from engine.runtime import load as _load

    return _load(
        path,
        device=device,
        max_context=max_context,
        memory_cap_mib=memory_cap_mib,
        prefill_chunk=prefill_chunk,
        dtype=dtype,
        options=options,
        max_num_seqs=max_num_seqs,
        prefill_budget=prefill_budget,
        kv_cache_mib=kv_cache_mib,
        warm_up=warm_up,
    )


def __getattr__(name: str) -> object:
    if name == "Engine":
        from engine.runtime import Engine

        return Engine
    if name == "MemoryReport":
        from engine.memory import MemoryReport

        return MemoryReport
    raise AttributeError(name)
