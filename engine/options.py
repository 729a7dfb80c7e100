"""EngineOptions: every switch of the engine in one frozen object, passed to `engine.load`.

Why one object: the switches used to be GPURIG_* variables read from os.environ by six modules
while the engine ran, so a benchmark changed the engine by mutating the environment in-process
and a decoder cache had to be keyed by the variables. Now the front doors (the `gpurig engine`
commands, the server, the sweep) call `EngineOptions.from_env()` once, and everything below
`engine.load` reads the object it was given. This module is the only one in engine/ that reads
the environment.

| variable                  | field               | meaning                                          | default |
|---------------------------|---------------------|--------------------------------------------------|---------|
| GPURIG_FAST               | fast                | "0" off (reference ops, no graph); "force" the   | on      |
|                           |                     | Triton path on any device (CPU interpreter)      |         |
| GPURIG_CUDA_GRAPH         | cuda_graph          | "0": fused kernels, decoded without a graph      | on      |
| GPURIG_FAST_PREFILL       | fused_prefill       | "0": prompt chunks through the model's own code  | on      |
| GPURIG_PASS_ATTENTION     | pass_attention      | "0": a prompt pass's segments attend one by one, | on      |
|                           |                     | not in one kernel per layer                      |         |
| GPURIG_PASS_GRAPHS        | pass_graphs         | "0": prompt passes launched op by op, not        | on      |
|                           |                     | replayed as CUDA graphs (fresh prompts, CUDA)    |         |
| GPURIG_FOLD_RESIDUAL      | fold_residual       | "1": a batch step's residual+norm by the last    | off     |
|                           |                     | program of the product before it (w4mma)         |         |
| GPURIG_BATCH_PROLOGUE     | batch_prologue      | "0": a batch step of up to 8 rows launches the   | on      |
|                           |                     | residual+norm before the per-layer gate apart,   |         |
|                           |                     | not in that GEMV's prologue                      |         |
| GPURIG_MMA_AHEAD          | mma_ahead           | "0": the int4 mma product of 2-8 rows requests a | on      |
|                           |                     | step's scales and activations in that step, not  |         |
|                           |                     | one step early with its weights                  |         |
| GPURIG_ASYNC_PROMPTS      | async_prompts       | "0": prompt passes on the decode steps' stream,  | on      |
|                           |                     | not on a second CUDA stream beside them          |         |
| GPURIG_STEPS_FIRST        | steps_first         | "1": a plan's decode step is launched before its | off     |
|                           |                     | prompt passes (side stream), not after them      |         |
| GPURIG_PDL                | pdl                 | "0": kernels launch after the one before ends,   | on      |
|                           |                     | not overlapping its tail (programmatic dependent |         |
|                           |                     | launch, sm_90 on: engine/kernels/pdl.py)         |         |
| GPURIG_GREEDY_TAIL        | greedy_tail         | "0": a batch step's soft-cap and greedy ids by   | on      |
|                           |                     | PyTorch ops, not the two-launch kernel pair      |         |
|                           |                     | (engine/kernels/greedy_tail.py)                  |         |
| GPURIG_GEMV_H2            | half2_gemv          | "0": exact fp32-unpack GEMV instead of half2     | on      |
| GPURIG_CUDA_GEMV          | cuda_gemv           | "1": 1-8 bf16 rows' int4 products by the CUDA    | off     |
|                           |                     | GEMV (engine/kernels/w4gemv_cuda.py), not Triton |         |
|                           |                     | (an experiment: slower in every decode bucket)   |         |
| GPURIG_CARVEOUT           | carveout            | 0-100: every kernel's preferred shared-memory    | driver  |
|                           |                     | share of the L1 (one configuration for all, so   |         |
|                           |                     | a kernel may start on an SM beside the one       |         |
|                           |                     | before it); unset or "driver": the driver's      |         |
|                           |                     | (an experiment: no value is faster, bench/NOTES  |         |
|                           |                     | v34)                                             |         |
| GPURIG_PREFIX_SDPA        | prefix_sdpa         | "0": a full layer's cached prefix by the online  | on      |
|                           |                     | softmax slices instead of torch's efficient SDPA |         |
| GPURIG_EXPANDABLE_SEGMENTS| expandable_segments | "0": no expandable segments under a memory cap   | on      |
| GPURIG_KERNEL_AUTOTUNE    | autotune            | "0": GEMV tile configs from defaults, no timing  | on      |
| GPURIG_KERNEL_CACHE       | tuning_cache_dir    | directory of the per-GPU tile-config files       | ~/.cache/gpurig/kernels |
| GPURIG_COMPILE_THREADS    | compile_threads     | threads compiling kernels at warm-up; 1 serial   | the cores (<= 32) |
| GPURIG_DEFER_OUTPUTS      | defer_outputs       | "1": a step's tokens reach their sinks after the | off     |
|                           |                     | next step is launched, not before (a server's    |         |
|                           |                     | event loop then streams them while the GPU runs) |         |

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

if TYPE_CHECKING:  # torch loads on first use: `import engine` (and `gpurig --help`) stays cheap
    import torch

FastMode = Literal["on", "off", "force"]


def _flag(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    value = env.get(name)
    if value is None:
        return default
    return value.strip() != "0"


def _percent(env: Mapping[str, str], name: str) -> int | None:
    """A whole percentage 0-100, or None where unset, empty or "driver"."""
    raw = env.get(name, "").strip()
    if raw in ("", "driver"):
        return None
    if not (raw.isdigit() and int(raw) <= 100):
        from engine.errors import EngineError

        raise EngineError(f"{name}={raw!r} is not a percentage",
                          "set a whole number from 0 to 100, or unset it (the driver's choice)")  # fmt: skip
    return int(raw)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine computes; the defaults are the measured-fastest arrangement."""

    fast: FastMode = "on"  # Triton kernels + fused decode on CUDA; "force": on any device
    cuda_graph: bool = True  # replay the decode step as a CUDA graph (CUDA only)
    fused_prefill: bool = True  # prompt chunks through engine/fast/prefill.py
    pass_attention: bool = True  # a pass's segments in one kernel per layer
    pass_graphs: bool = True  # passes of fresh prompts replayed as CUDA graphs (CUDA only)
    fold_residual: bool = False  # batch steps: residual+norm in the product's last program
    batch_prologue: bool = True  # batch steps <= 8 rows: per-layer gate GEMV's prologue
    mma_ahead: bool = True  # mma product, 2-8 rows: a step's scales/activations a step early
    async_prompts: bool = True  # CUDA: prompt passes on a side stream beside the steps
    steps_first: bool = False  # the decode step before the side passes (measured: no gain)
    pdl: bool = True  # sm_90 on: a kernel launches during the one before and waits in it
    greedy_tail: bool = True  # batch step: soft-cap + greedy ids in two launches
    half2_gemv: bool = True  # 16-bit GEMV multiplies in half2 (fp32 unpack when False)
    cuda_gemv: bool = False  # 1-8 bf16 rows' products by the CUDA GEMV (NVRTC-built)
    carveout: int | None = None  # every kernel's preferred shared-memory %; None: the driver's
    prefix_sdpa: bool = True  # a full layer's prefix through torch's efficient attention
    expandable_segments: bool = True  # under a memory cap, grow allocator segments in place
    autotune: bool = True  # time GEMV tile candidates on first use of a shape
    tuning_cache_dir: Path | None = None  # None: ~/.cache/gpurig/kernels
    compile_threads: int | None = None  # warm-up compile threads; None: the cores (<= 32)
    defer_outputs: bool = False  # tokens to the sinks after the next launch (measured: noise)

    def __post_init__(self) -> None:
        if self.fast not in ("on", "off", "force"):
            raise ValueError(f"fast must be 'on', 'off' or 'force', not {self.fast!r}")
        if self.compile_threads is not None and self.compile_threads < 1:
            raise ValueError(f"compile_threads must be at least 1, not {self.compile_threads}")
        if self.carveout is not None and not 0 <= self.carveout <= 100:
            raise ValueError(f"carveout must be a percentage (0-100), not {self.carveout}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineOptions:
        """The options the GPURIG_* variables ask for (see the table above); unset means default."""
        env = os.environ if env is None else env
        raw = env.get("GPURIG_FAST", "1").strip()
        fast: FastMode = "force" if raw == "force" else "off" if raw == "0" else "on"
        cache = env.get("GPURIG_KERNEL_CACHE")
        threads = env.get("GPURIG_COMPILE_THREADS", "").strip()
        if threads and not (threads.isdigit() and int(threads) >= 1):
            from engine.errors import EngineError

            raise EngineError(
                f"GPURIG_COMPILE_THREADS={threads!r} is not a thread count",
                "set a whole number of at least 1 (1 compiles serially), or unset it",
            )
        return cls(
            fast=fast,
            cuda_graph=_flag(env, "GPURIG_CUDA_GRAPH"),
            fused_prefill=_flag(env, "GPURIG_FAST_PREFILL"),
            pass_attention=_flag(env, "GPURIG_PASS_ATTENTION"),
            pass_graphs=_flag(env, "GPURIG_PASS_GRAPHS"),
            fold_residual=_flag(env, "GPURIG_FOLD_RESIDUAL", default=False),
            batch_prologue=_flag(env, "GPURIG_BATCH_PROLOGUE"),
            mma_ahead=_flag(env, "GPURIG_MMA_AHEAD"),
            async_prompts=_flag(env, "GPURIG_ASYNC_PROMPTS"),
            steps_first=_flag(env, "GPURIG_STEPS_FIRST", default=False),
            pdl=_flag(env, "GPURIG_PDL"),
            greedy_tail=_flag(env, "GPURIG_GREEDY_TAIL"),
            half2_gemv=_flag(env, "GPURIG_GEMV_H2"),
            cuda_gemv=_flag(env, "GPURIG_CUDA_GEMV", default=False),
            carveout=_percent(env, "GPURIG_CARVEOUT"),
            prefix_sdpa=_flag(env, "GPURIG_PREFIX_SDPA"),
            expandable_segments=_flag(env, "GPURIG_EXPANDABLE_SEGMENTS"),
            autotune=_flag(env, "GPURIG_KERNEL_AUTOTUNE"),
            tuning_cache_dir=Path(cache).expanduser() if cache else None,
            compile_threads=int(threads) if threads else None,
            defer_outputs=_flag(env, "GPURIG_DEFER_OUTPUTS", default=False),
        )

    def fast_on(self, device: torch.device) -> bool:
        """The Triton path serves this device: CUDA unless off; anywhere when forced."""
        return self.fast == "force" or (device.type == "cuda" and self.fast == "on")

    def graphs_on(self, device: torch.device) -> bool:
        """The decode step is captured as a CUDA graph on this device."""
        return device.type == "cuda" and self.fast_on(device) and self.cuda_graph

    def pass_graphs_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Prompt passes of fresh prompts are captured as CUDA graphs: with the decode graphs,
        the fused prefill and its one-launch attention, which runs on sm_80+ in 16-bit."""
        if not (self.graphs_on(device) and self.fused_prefill and self.pass_attention):
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


def fold_tail_serial() -> bool:
    """GPURIG_FOLD_TAIL=last: the residual fold keeps its serial last-program tail even where
    its spread tail could run (a lab switch, for measuring one against the other)."""
    return os.environ.get("GPURIG_FOLD_TAIL") == "last"


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
