"""The engine's warm-up before it serves: every kernel compiled, every decode graph captured, and
prompts of each kind read once, so no request pays a first-use cost.

Why prompts too: the decode graphs cover the decode step, but reading a prompt launches kernels
of its own (the fused prefill's norms, RoPE, dequantisation, embedding gathers), which Triton
compiles per specialisation (an integer argument equal to 1, or a multiple of 16, compiles
apart), and cuBLAS loads its kernels for each kind of size at first use. Warmed up with a
one-token prompt only, the first real request waited seconds for them. The lengths read here
give each a run: one token, a length that is no multiple of 16, the powers of two from 64 to
the prefill budget (cuBLAS picks, and lazily loads, other kernels as the rows grow: a first
512-token prompt still waited 2.3x its warm time with only 64 and 2,085 warmed), one longer
than the budget (two chunks, the second over a cached prefix), and two prompts read in one pass
when the engine batches.

Order on CUDA with graphs: first a compile pass inside engine.kernels.launch.compile_ahead (the
step of every bucket and the warm-up prompts, their kernels compiled on `compile_threads`
threads while nothing runs: a cold start waits for the compiles side by side, not one after
another; the KV pool is cleared after it, since its steps ran no kernel and wrote whatever
memory held); then the real warm-up: the graphs captured (which also tunes shapes the shipped
tables lack), the prompts read. Elsewhere (the CPU: the interpreter compiles nothing, torch
loads no kernels) one one-token prompt, which only checks that the engine answers. A start whose
kernels an earlier warm-up of the same engine left in Triton's cache skips the compile pass
(engine/warmup_cache.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine import warmup_cache
from engine.kernels import tuning
from engine.kernels.launch import compile_ahead, default_threads
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.generation import Generation
    from engine.kv_pool import KVPool
    from engine.runner import ModelRunner


class WarmingUp(warmup_cache.Compiling, Protocol):
    """What the warm-up uses of the engine it warms (engine/runtime.py's Engine, which calls it
    while it loads): typed here, so the warm-up does not import the engine it is part of."""

    runner: ModelRunner
    pool: KVPool

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def has_work(self) -> bool: ...

    def step(self) -> bool: ...

    def generate(self, token_ids: list[int], params: SamplingParams | None = None) -> list[int]: ...

    def stream(self, token_ids: list[int], params: SamplingParams | None = None) -> Generation: ...


SPLIT_TAIL = 37  # tokens past a multiple of 16 (and past the budget): the uneven cases


@dataclass(frozen=True)
class WarmUpReport:
    """What the warm-up did and how long each part took (seconds)."""

    compile_s: float  # the compile pass (0.0 where it did not run)
    capture_s: float  # every bucket's graph captured (0.0 without graphs)
    prompts_s: float  # the warm-up prompts read for real
    threads: int  # compile threads of the compile pass (1: none ran, kernels compiled in order)
    lengths: tuple[int, ...]  # the warm-up prompts' lengths
    cached: bool = False  # the compile pass was skipped: every kernel was on disk already
    why_compiled: str = ""  # why the compile pass ran (engine/warmup_cache.py's cache_miss)

    @property
    def total_s(self) -> float:
        return self.compile_s + self.capture_s + self.prompts_s

    def line(self) -> str:
        """One line for a server's log."""
        parts = []
        if self.cached:
            parts.append("kernels cached from an earlier start, compile pass skipped")
        if self.threads > 1:
            why = f", {self.why_compiled}" if self.why_compiled else ""
            parts.append(
                f"kernels compiled on {self.threads} threads in {self.compile_s:.1f} s{why}"
            )
        if self.capture_s:
            parts.append(f"graphs captured in {self.capture_s:.1f} s")
        sizes = "/".join(str(n) for n in self.lengths)
        what = f"prompts of {sizes} tokens" if len(self.lengths) > 1 else f"a {sizes}-token prompt"
        parts.append(f"{what} read in {self.prompts_s:.1f} s")
        return f"warmed up in {self.total_s:.1f} s ({'; '.join(parts)})"


def prompt_lengths(max_context: int, budget: int) -> tuple[int, ...]:
    """The warm-up prompts' lengths, each leaving room for its two new tokens."""
    room = max(1, max_context - 2)
    powers = (1 << e for e in range(6, max(budget.bit_length(), 11)))  # 64 .. the budget
    wanted = (1, SPLIT_TAIL, *powers, budget + SPLIT_TAIL)
    return tuple(sorted({min(n, room) for n in wanted}))


def warm_up(engine: WarmingUp, threads: int | None = None, every_length: bool | None = None
            ) -> WarmUpReport:  # fmt: skip
    """Compile, capture and read as the module docstring says; the engine is left idle, its pool
    empty. every_length None: every kind of prompt on CUDA, one token elsewhere."""
    if every_length is None:
        every_length = engine.device.type == "cuda"
    lengths = (
        prompt_lengths(engine.max_context, engine.batching.prefill_budget) if every_length else (1,)
    )
    runner = engine.runner
    threads = default_threads() if threads is None else threads
    ran = cached = False
    marker, now, why = None, None, ""
    t0 = time.perf_counter()
    if runner.graphs is not None:
        now = warmup_cache.facts(engine, lengths)
        marker = warmup_cache.fingerprint_of(now)
        why = warmup_cache.cache_miss(tuning.cache_dir(), marker, now)
        cached = not why
    if runner.graphs is not None and not cached:
        with compile_ahead(threads) as ran:
            if ran:
                runner.compile_steps()
                _read_prompts(engine, lengths)
        if ran:  # no kernel ran in that pass: what it wrote to the pool is whatever memory held
            engine.pool.clear()
    t1 = time.perf_counter()
    runner.warm_up()
    t2 = time.perf_counter()
    _read_prompts(engine, lengths)
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)
    t3 = time.perf_counter()
    if marker is not None:  # every kernel this engine needs is now on disk
        warmup_cache.record(tuning.cache_dir(), marker, now)
    return WarmUpReport(
        compile_s=round(t1 - t0, 3) if ran else 0.0,
        capture_s=round(t2 - t1, 3) if runner.graphs is not None else 0.0,
        prompts_s=round(t3 - t2, 3),
        threads=threads if ran else 1,
        lengths=lengths,
        cached=cached,
        why_compiled=why if ran else "",
    )


def _read_prompts(engine: WarmingUp, lengths: tuple[int, ...]) -> None:
    """Each length alone, then (when the engine batches) the two shortest uneven ones in one
    pass; two new tokens each, so a decode step follows every read."""
    params = SamplingParams(max_tokens=2, stop_ids=())
    for n in lengths:
        engine.generate(_ids(n, engine.config.vocab_size), params)
    if engine.max_num_seqs > 1 and len(lengths) > 1:  # several sequences in one prompt pass
        pair = [engine.stream(_ids(n, engine.config.vocab_size), params) for n in lengths[:2]]
        for gen in pair:
            list(gen)
    while engine.has_work:  # the last step launched ahead of its finished sequences
        engine.step()


def _ids(n: int, vocab: int) -> list[int]:
    """n fixed token ids spread over the vocabulary (no randomness: every warm-up alike)."""
    return [(7919 * i + 11) % vocab for i in range(n)]
