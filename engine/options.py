"""EngineOptions: every switch of the engine in one frozen object, passed to `engine.load`.

Why one object: the switches used to be GPURIG_* variables read from os.environ by six modules
while the engine ran, so a benchmark changed the engine by mutating the environment in-process
and a decoder cache had to be keyed by the variables. Now the front doors (the `gpurig engine`
commands, the server, the sweep) call `EngineOptions.from_env()` once, and everything below
`engine.load` reads the object it was given. The variables are declared, and read, in
engine/env.py.

Only switches a user would set, or that guard a won feature's fallback, are options. What was
measured and won is the engine's one behaviour (fused prefill, one-kernel pass attention, the
batch prologue, the mma look-ahead, the greedy tail, the half2 GEMV, the prefix through torch's
SDPA, expandable segments under a cap); what lost is deleted (the CUDA GEMV, the carveout, the
residual fold, steps first, deferred outputs): lab/journal.md has each one's figures.

| variable                  | field               | meaning                                          | default |
|---------------------------|---------------------|--------------------------------------------------|---------|
| GPURIG_FAST               | fast                | "0" off (reference ops, no graph); "force" the   | on      |
|                           |                     | Triton path on any device (CPU interpreter)      |         |
| GPURIG_CUDA_GRAPH         | cuda_graph          | "0": fused kernels, decoded without a graph      | on      |
| GPURIG_PASS_GRAPHS        | pass_graphs         | "0": prompt passes launched op by op, not        | on      |
|                           |                     | replayed as CUDA graphs (fresh prompts, CUDA)    |         |
| GPURIG_ASYNC_PROMPTS      | async_prompts       | "0": prompt passes on the decode steps' stream,  | on      |
|                           |                     | not on a second CUDA stream beside them          |         |
| GPURIG_PDL                | pdl                 | "0": kernels launch after the one before ends,   | on      |
|                           |                     | not overlapping its tail (programmatic dependent |         |
|                           |                     | launch, sm_90 on: engine/kernels/pdl.py)         |         |
| GPURIG_KERNEL_AUTOTUNE    | autotune            | "0": GEMV tile configs from defaults, no timing  | on      |
| GPURIG_KERNEL_CACHE       | tuning_cache_dir    | directory of the per-GPU tile-config files       | ~/.cache/gpurig/kernels |
| GPURIG_COMPILE_THREADS    | compile_threads     | threads compiling kernels at warm-up; 1 serial   | the cores (<= 32) |

`EngineConfig` is the one object `engine.load` takes: the sizes (device, dtype, context, memory
cap, prompt chunk, sequences, KV pool) and these options, checked once when it is made. The
sizes were never environment switches. `default_dtype` decides the dtype when none is given,
from the device's compute capability.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine import env as variables

if TYPE_CHECKING:  # torch loads on first use: `import engine` (and `gpurig --help`) stays cheap
    import torch

FastMode = Literal["on", "off", "force"]


@dataclass(frozen=True)
class EngineOptions:
    """How the engine computes; the defaults are the measured-fastest arrangement."""

    fast: FastMode = "on"  # Triton kernels + fused decode on CUDA; "force": on any device
    cuda_graph: bool = True  # replay the decode step as a CUDA graph (CUDA only)
    pass_graphs: bool = True  # passes of fresh prompts replayed as CUDA graphs (CUDA only)
    async_prompts: bool = True  # CUDA: prompt passes on a side stream beside the steps
    pdl: bool = True  # sm_90 on: a kernel launches during the one before and waits in it
    autotune: bool = True  # time GEMV tile candidates on first use of a shape
    tuning_cache_dir: Path | None = None  # None: ~/.cache/gpurig/kernels
    compile_threads: int | None = None  # warm-up compile threads; None: the cores (<= 32)

    def __post_init__(self) -> None:
        if self.fast not in ("on", "off", "force"):
            raise ValueError(f"fast must be 'on', 'off' or 'force', not {self.fast!r}")
        if self.compile_threads is not None and self.compile_threads < 1:
            raise ValueError(f"compile_threads must be at least 1, not {self.compile_threads}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineOptions:
        """The options the GPURIG_* variables ask for (see the table above); unset means default.
        `env` stands in for os.environ (engine/env.py reads either)."""
        raw = (variables.read("GPURIG_FAST", env) or "1").strip()
        fast: FastMode = "force" if raw == "force" else "off" if raw == "0" else "on"
        cache = variables.read("GPURIG_KERNEL_CACHE", env)
        threads = (variables.read("GPURIG_COMPILE_THREADS", env) or "").strip()
        if threads and not (threads.isdigit() and int(threads) >= 1):
            from engine.errors import EngineError

            raise EngineError(
                f"GPURIG_COMPILE_THREADS={threads!r} is not a thread count",
                "set a whole number of at least 1 (1 compiles serially), or unset it",
            )
        return cls(
            fast=fast,
            cuda_graph=variables.flag("GPURIG_CUDA_GRAPH", env=env),
            pass_graphs=variables.flag("GPURIG_PASS_GRAPHS", env=env),
            async_prompts=variables.flag("GPURIG_ASYNC_PROMPTS", env=env),
            pdl=variables.flag("GPURIG_PDL", env=env),
            autotune=variables.flag("GPURIG_KERNEL_AUTOTUNE", env=env),
            tuning_cache_dir=Path(cache).expanduser() if cache else None,
            compile_threads=int(threads) if threads else None,
        )

    def fast_on(self, device: torch.device) -> bool:
        """The Triton path serves this device: CUDA unless off; anywhere when forced."""
        return self.fast == "force" or (device.type == "cuda" and self.fast == "on")

    def graphs_on(self, device: torch.device) -> bool:
        """The decode step is captured as a CUDA graph on this device."""
        return device.type == "cuda" and self.fast_on(device) and self.cuda_graph

    def pass_graphs_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Prompt passes of fresh prompts are captured as CUDA graphs: with the decode graphs
        and the fused prefill's one-launch attention, which runs on sm_80+ in 16-bit."""
        if not self.graphs_on(device):
            return False
        from engine.fast.prefill_attention import kernel_applies

        return self.pass_graphs and kernel_applies(device, dtype)


MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class EngineConfig:
    """Everything `engine.load` is told, checked once here (what needs the checkpoint, the
    context against max_position_embeddings, is checked by load).

    device None: cuda when available, else cpu. dtype None: `default_dtype`. max_context None:
    the model's max_position_embeddings. memory_cap_mib: cap this process's CUDA memory.
    prefill_chunk None: the most prompt tokens per pass (4,096 on CUDA, 256 on the CPU; each
    prompt's chunk is lowered to what the memory left holds). max_num_seqs: sequences decoded
    together (1: one at a time, each in the same steps as a batch of one; "auto": what the
    memory left holds, engine/batching.py). prefill_budget None: the most prompt tokens read
    between two decode steps (the chunk, at most 2,048). kv_cache_mib: the KV pool's size
    instead of what is left. warm_up: capture the decode graphs at load."""

    device: str | None = None
    dtype: torch.dtype | None = None
    max_context: int | None = None
    memory_cap_mib: int | None = None
    prefill_chunk: int | None = None
    max_num_seqs: int | Literal["auto"] = 1
    prefill_budget: int | None = None
    kv_cache_mib: float | None = None
    warm_up: bool = True
    options: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        from engine.errors import EngineError, arg

        seqs = self.max_num_seqs
        if seqs != "auto" and (isinstance(seqs, bool) or not isinstance(seqs, int)
                               or not 1 <= seqs <= MAX_NUM_SEQS):  # fmt: skip
            raise EngineError(
                f"max_num_seqs {seqs} is outside [1, {MAX_NUM_SEQS}]",
                f"use {arg('max_num_seqs')} 1 to {MAX_NUM_SEQS}, or auto",
            )
        for name in ("max_context", "prefill_chunk", "prefill_budget", "memory_cap_mib"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineError(
                    f"{name} {value} must be at least 1", f"use a positive {arg(name)}"
                )
        if self.kv_cache_mib is not None and not self.kv_cache_mib > 0:
            raise EngineError(
                f"kv_cache_mib {self.kv_cache_mib} must be positive",
                f"use e.g. {arg('kv_cache_mib')} 512",
            )


def default_dtype(device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The compute dtype when load is given none: float32 on the CPU; on CUDA bfloat16 from
    Ampere (capability 8.0) up, float16 below (Turing and older emulate bf16 arithmetic, which
    makes it several times slower there)."""
    import torch

    if device_type != "cuda":
        return torch.float32
    if capability is not None and capability[0] < 8:
        return torch.float16
    return torch.bfloat16


def triton_interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1): no inline
    PTX, no hardware-only features."""
    return os.environ.get("TRITON_INTERPRET") == "1"


ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_configured() -> bool:
    """The user set the CUDA allocator's own configuration variable, which then wins."""
    return any(name in os.environ for name in ALLOCATOR_VARIABLES)


def allocator_settings_from_env() -> str:
    """What the user's allocator variables say ("" when unset), comma-joined."""
    return ",".join(os.environ.get(name, "") for name in ALLOCATOR_VARIABLES)
