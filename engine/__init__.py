"""The in-process Gemma 4 engine: packed 4-bit weights from disk to arithmetic.

Public surface (the contract engine-speed and engine-server build on):

    import engine
    from engine import EngineConfig, SamplingParams
    eng = engine.load("ckpt/", EngineConfig(max_context=4096))  # or engine.load("ckpt/",
                                                                # max_context=4096): its fields
    new_ids = eng.generate(ids, SamplingParams(max_tokens=64, temperature=0.0, top_k=None,
                           top_p=None, seed=None, stop_ids=None, logit_bias=((id, bias),)))
    gen = eng.stream(ids, SamplingParams(max_tokens=64))  # a Generation (engine/generation.py)
    for tok in gen: ...                                   # .close() stops it; then
    gen.finish_reason, gen.completion_tokens, gen.timings # "stop" | "length" | None
    gen = eng.stream(ids, SamplingParams(logprobs=5))     # gen.logprobs[i]: tokens[i]'s
                                                          # engine.logprobs.TokenLogprobs
    seq = eng.add_request(ids, params, sink)              # sink(seq, Output) on the stepping
    while eng.step(): ...                                 # thread (the server's loop)
    eng.tokenizer, eng.chat_template, eng.bos_id, eng.eos_ids, eng.max_context,
    eng.model_dir, eng.model_name, eng.device, eng.stats(), eng.memory_report()

One design for every caller: requests wait in one line, the scheduler (engine/scheduler.py)
plans each step, the runner (engine/runner.py) runs it over the KV block pool; a single
sequence is a batch of one (EngineConfig.max_num_seqs 1, the default; the server loads "auto").
Config: engine.options.EngineConfig (sizes) holding EngineOptions (every switch: fast path,
CUDA graphs, side-stream prompts, PDL, tuning; `EngineOptions.from_env()` reads the GPURIG_*
variables). Errors: engine.errors.EngineError, CheckpointError, ContextLengthError (.limit,
.requested). Checkpoints: engine.checkpoint_maker.make_checkpoint / quantize_checkpoint. Kernel
dispatch points: engine/ops.py (reference) and engine/fast/ops_fast.py (Triton). Layout of
4-bit embeddings: engine/FORMAT.md.

Importing this package is cheap: torch loads on first use of `load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import CheckpointError, ContextLengthError, EngineError, GenerationError
from engine.options import EngineConfig, EngineOptions

if TYPE_CHECKING:
    import os

    from engine.memory import MemoryReport
    from engine.runtime import Engine
    from engine.sampling import SamplingParams

__all__ = [
    "CheckpointError",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOptions",
    "GenerationError",
    "MemoryReport",
    "SamplingParams",
    "load",
]


def load(
    path: str | os.PathLike[str], config: EngineConfig | None = None, **fields: object
) -> Engine:
    """Load a Gemma 4 W4A16 checkpoint directory (engine.runtime.load): `config`, or its fields
    as keywords."""
    from engine.runtime import load as _load

    return _load(path, config, **fields)


def __getattr__(name: str) -> object:
    if name == "Engine":
        from engine.runtime import Engine

        return Engine
    if name == "MemoryReport":
        from engine.memory import MemoryReport

        return MemoryReport
    if name == "SamplingParams":
        from engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
