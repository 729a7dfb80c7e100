"""The model runner: executes the scheduler's step plans on the device.

What it owns (nano-vllm's model runner, vLLM v1's GPU model runner): the KV pool's device side,
how prompts are read and rows decoded (chosen once, from the engine's options), each running
request's sampler, and the token read-back. It decides nothing: a `StepPlan`
(engine/scheduler.py) says which prompt chunks to read and which rows to decode.

The arrangement, one for every batch size (a single sequence is a batch of one row):
* fast path (CUDA, or EngineOptions(fast="force")): prompt chunks through the fused prefill
  (engine/fast/prefill.py), several sequences in one pass; decode rows through the fused batched
  step (engine/fast/batch_decode.py), replayed as one CUDA graph per batch bucket on CUDA;
* reference (the CPU, or a model the fused kernels do not cover): the model's own rows
  (Gemma4Model), every row of a batch in the same tensors where the model offers it.

Tokens come back one step late: `execute` launches step n and returns at once; `collect` of step
n-1 then waits for its token ids (on CUDA a pinned copy behind an event), so the device decodes
while the host delivers. A row whose token is that of its previous step reads it on the device
(inside the decode graph, with the greedy argmax, where there is one: BatchGraphs.run_staged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine import ops
from engine.kernels.tuning import TuningSettings, tuning_settings
from engine.kv_pool import KVPool
from engine.logprobs import StepLogprobs
from engine.model import Gemma4Model
from engine.options import EngineOptions
from engine.prompt_stream import Landing, SidePrompts
from engine.sampler import Sampler
from engine.scheduler import Delivered, PromptChunk, StepPlan
from engine.sequence import Sequence
from engine.step_clock import StepClock, StepMarks

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Reader = Callable[[list[tuple[torch.Tensor, int, int]], int | None], None]


def make_kernels(options: EngineOptions, device: torch.device) -> ops.Ops:
    """The dispatch points a model on `device` is built with: FastOps when the fast path serves
    the device, else the reference set."""
    if options.fast_on(device):
        from engine.fast.ops_fast import FastOps

        return FastOps()
    return ops.Ops()


def prefill_chunk_for(device: torch.device) -> int:
    """The most prompt tokens per forward pass on this device: 4,096 on CUDA (reading a prompt
    is host-bound below that on a big GPU), 256 elsewhere. Each prompt's real chunk is chosen
    from the memory left when it is read (engine.memory.plan_prompt), so a small or capped card
    reads in smaller chunks instead of running out."""
    return 4096 if device.type == "cuda" else 256


@dataclass
class Launched:
    """A step on the device whose tokens have not reached the host yet."""

    seqs: list[int]  # the sequence of each row
    ids: torch.Tensor  # [B] int64 on the device (graphs: a view the next step rewrites)
    host: torch.Tensor  # [B] int64 (pinned on CUDA), filled when `event` completes
    event: torch.cuda.Event | None
    logprobs: StepLogprobs | None  # the rows that asked for them, still on the device
    marks: StepMarks | None = None  # CUDA: its GPU time and the gap before it (StepClock)


@dataclass
class _Request:
    """What the runner keeps per running sequence."""

    prompt: torch.Tensor  # its prompt ids on the device
    sampler: Sampler | None  # None: plain greedy (the batch's one argmax serves it)
    logprobs: int | None


class ModelRunner:
    def __init__(
        self, model: Gemma4Model, pool: KVPool, options: EngineOptions, max_batch: int,
        prefill_budget: int = 2048, memory_cap_mib: int | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.pool = pool
        self.device = model.device
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.memory_cap_mib = memory_cap_mib
        # the engine's tile tuning, in force in each call below that launches kernels (the
        # server steps the engine on a thread of its own: engine/kernels/tuning.py)
        self.tuning = TuningSettings(options.autotune, options.tuning_cache_dir)
        self.batched = False  # the fused batched step runs
        self.graphs = None
        self.reader = None  # the fused prompt reader, when it runs (holds a dequantisation buffer)
        self._read: Reader = self._reference_read
        self._step: Step = self._reference_step
        if options.fast_on(model.device):
            self._choose_fast(options)
        if self.batched and options.graphs_on(model.device):
            from engine.fast.batch_graph import PDL_ROWS, BatchGraphs, buckets_for, pdl_supported

            pdl_rows = PDL_ROWS if options.pdl and pdl_supported(model.device) else 0
            self.graphs = BatchGraphs(self._step, buckets_for(max_batch), model.device,
                                      pool.pad_slot, pdl_rows=pdl_rows)  # fmt: skip
        self._requests: dict[int, _Request] = {}
        self._previous: Launched | None = None
        # prompt passes beside the decode steps (engine/prompt_stream.py): each sequence's
        # last pass until it lands
        self.prompts: SidePrompts | None = None
        if options.async_prompts and self.device.type == "cuda":
            self.prompts = SidePrompts(self.device)
        self._landing: dict[int, Landing] = {}
        self.clock = StepClock()  # the decode stream's busy and idle GPU time (CUDA)

    def _choose_fast(self, options: EngineOptions) -> None:
        from engine.fast import batch_decode, prefill
        from engine.fast.fuse import fuse_projections
        from engine.fast.ops_fast import FastOps

        model, pool = self.model, self.pool
        fused = fuse_projections(model)
        kernels = (
            model.ops if isinstance(model.ops, FastOps) else make_kernels(options, self.device)
        )
        if prefill.supported(model, fused):
            reader = self.reader = prefill.FusedPrefill(model, fused, kernels)
            self._read = lambda parts, budget: reader.chunks(  # noqa: E731
                [(ids, start, pool.view(slot)) for ids, start, slot in parts], budget
            )
            if options.pass_graphs_on(self.device, model.dtype):
                from engine.fast.prefill_graph import PassGraphs

                reader.graphs = PassGraphs(reader, pool, self.prefill_budget, self.max_batch)
        if batch_decode.supported(model, fused):
            decoder = batch_decode.BatchDecoder(model, pool, fused, kernels, self.max_batch)
            self._step = decoder.step
            self.batched = True

    def warm_up(self) -> None:
        """Capture every bucket's graph now (compiling and tuning every kernel on the way), so
        the first requests do not wait for it: the decode steps', then the prompt passes'
        where the memory left holds them (engine/fast/prefill_graph.py)."""
        with tuning_settings(self.tuning):
            self._warm_up()

    def _warm_up(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_all()
        passes = self.reader.graphs if self.reader is not None else None
        if passes is not None and not passes.captured:
            from engine.fast.ops_fast import prefill_dtype
            from engine.memory import available_bytes, reader_peak_bytes

            elem = prefill_dtype(self.device.index or 0, self.model.dtype).itemsize
            need = reader_peak_bytes(self.model, passes.buckets[-1], elem)
            passes.capture_all(available_bytes(self.device, self.memory_cap_mib), need)

    @property
    def passes_captured(self) -> bool:
        """Prompt passes of fresh prompts replay as CUDA graphs (captured at warm-up)."""
        return self.reader is not None and self.reader.graphs is not None and (
            self.reader.graphs.captured)  # fmt: skip

    def compile_steps(self) -> None:
        """Every bucket's step once without capturing (inside engine.kernels.launch's
        compile_ahead: queues their kernels' compiles), and every prompt-pass bucket's pass."""
        with tuning_settings(self.tuning):
            if self.graphs is not None:
                self.graphs.compile_all()
            if self.reader is not None and self.reader.graphs is not None:
                self.reader.graphs.compile_all()

    # ---- the reference arrangement: the model's own rows, a batch in the same tensors -----------
    def _reference_read(
        self, parts: list[tuple[torch.Tensor, int, int]], budget: int | None
    ) -> None:
        self.model.read_chunks(parts, self.pool, budget)

    def _reference_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        return self.model.decode_rows(tokens, positions, self.pool, slots)

    # ---- executing a plan ----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> Launched | None:
        """Run `plan`: bookkeeping, prompt chunks, then launch the decode rows (returned, their
        tokens not yet read)."""
        with tuning_settings(self.tuning):
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> Launched | None:
        for seq_id in plan.ended:
            self._requests.pop(seq_id, None)
            landing = self._landing.pop(seq_id, None)
            if landing is not None:  # ended while its pass ran: its slot may open again below
                landing.join()
        self.pool.apply(plan.opened, plan.grants)
        if plan.started:
            self._admit(plan.started)
        if plan.chunks and self.prompts is not None:
            self._read_aside(plan)
        elif plan.chunks:
            self._read_chunks(plan.chunks, plan.score_budget)
        elif self.reader is not None and not self._landing:
            self.reader.release()  # no prompt being read: decode does not need its buffer
        if not plan.rows:
            if not plan.chunks and self._landing:  # only passes in flight: wait for one
                next(iter(self._landing.values())).wait()
            self._previous = None
            return None
        launched = self._launch(plan)
        self._previous = launched
        return launched

    def _admit(self, started: tuple[Sequence, ...]) -> None:
        """The new sequences' prompt ids to the device in one copy, joined in numpy: each
        PyTorch call gives the interpreter lock away, and while the server's threads run Python
        getting it back can take a switch interval (lab/journal.md v24)."""
        host = torch.from_numpy(np.concatenate([np.asarray(s.prompt, np.int64) for s in started]))
        if self.device.type == "cuda":  # pinned: the copy queues behind the running step; a
            host = host.pin_memory()  # pageable one waits for it (the GPU then idles)
        ids = host.to(self.device, non_blocking=True)
        start = 0
        for seq in started:
            p = seq.params
            sampler = None if p.plain_greedy else Sampler(p, self.device)
            prompt = ids[start : start + len(seq.prompt)]
            start += len(seq.prompt)
            self._requests[seq.id] = _Request(prompt, sampler, p.logprobs)

    def _read_aside(self, plan: StepPlan) -> None:
        """The plan's prompt chunks on the side stream, after all the main stream has queued;
        each sequence lands with the pass."""
        assert self.prompts is not None
        read = lambda: self._read_chunks(plan.chunks, plan.score_budget)  # noqa: E731
        landing = self.prompts.run(read)
        for c in plan.chunks:
            self._landing[c.seq] = landing

    def _read_chunks(self, chunks: tuple[PromptChunk, ...], budget: int | None) -> None:
        prompts = {c.seq: self._requests[c.seq].prompt for c in chunks}
        parts = [(prompts[c.seq][c.start : c.start + c.length], c.start, c.slot) for c in chunks]
        self._read(parts, budget)

    def _launch(self, plan: StepPlan) -> Launched:
        rows, previous = plan.rows, self._previous
        index = {s: r for r, s in enumerate(previous.seqs)} if previous is not None else {}
        host = torch.tensor(
            [
                [index[r.seq] if r.token is None else -1 for r in rows],
                [0 if r.token is None else r.token for r in rows],
                [r.position for r in rows],
                [r.slot for r in rows],
            ],
            dtype=torch.int64,
        )
        cuda = self.device.type == "cuda"
        seqs = [r.seq for r in rows]
        requests = [self._requests[s] for s in seqs]
        before = previous.event if previous is not None else None
        start, starved = self.clock.begin(before) if cuda else (None, False)
        if self.graphs is not None:  # the replay picks the tokens and makes the greedy ids
            logits, ids = self.graphs.run_staged(host)
        else:  # the same, op by op
            if cuda:  # pinned: the copy queues instead of waiting
                host = host.pin_memory()
            staged = host.to(self.device, non_blocking=True)
            src, fresh, positions, slots = staged[0], staged[1], staged[2], staged[3]
            if previous is not None:
                tokens = torch.where(src >= 0, previous.ids[src.clamp(min=0)], fresh)
            else:
                tokens = fresh
            logits = self.step(tokens, positions, slots.to(torch.int32))
            ids = logits.argmax(dim=-1)
        self._resample(logits, ids, requests)
        asked = [r for r, q in enumerate(requests) if q.logprobs is not None]
        # read now: on CUDA `logits` is the graph's output buffer, which the next step rewrites
        logprobs = (
            StepLogprobs.compute(logits, ids, asked, [requests[r].logprobs for r in asked])
            if asked
            else None
        )
        out = torch.empty(len(rows), dtype=torch.int64, pin_memory=cuda)
        if start is None:
            out.copy_(ids)
            return Launched(seqs, ids, out, None, logprobs)
        out.copy_(ids, non_blocking=True)
        event = self.clock.mark_end()
        plain = not (plan.started or plan.chunks or plan.ended)
        marks = StepMarks(start, event, before, starved, plain)
        return Launched(seqs, ids, out, event, logprobs, marks)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Logits [B, V] of one token per row (on CUDA a view of the graph's output: read it
        before the next step)."""
        with tuning_settings(self.tuning):
            if self.graphs is not None:
                return self.graphs.run(tokens, positions, slots)
            return self._step(tokens, positions, slots)

    @staticmethod
    def _resample(logits: torch.Tensor, ids: torch.Tensor, requests: list[_Request]) -> None:
        """Each row's token in `ids` (the batch's one argmax serves the plain greedy rows): a
        row with its own sampler (generator, logit bias) gets its draw written over it."""
        for r, q in enumerate(requests):
            if q.sampler is not None:
                ids[r : r + 1] = q.sampler(logits[r])

    def collect(self, step: Launched) -> Delivered:
        """The step's (sequence, token, log-probabilities) per row, once they reach the host."""
        if step.event is not None:
            step.event.synchronize()
        if step.marks is not None:
            self.clock.add(step.marks)
        values = step.host.tolist()
        logprobs = step.logprobs.to_host(values) if step.logprobs is not None else {}
        return [
            (s, tok, logprobs.get(r))
            for r, (s, tok) in enumerate(zip(step.seqs, values, strict=True))
        ]

    def landed(self, seq_id: int) -> bool:
        """Whether the sequence's prompt passes have finished (always, on one stream); the
        scheduler decodes it only then. Once they have, the main stream's later work (the step
        that first reads its cache) is ordered after them."""
        landing = self._landing.get(seq_id)
        if landing is None:
            return True
        if not landing.done():
            return False
        del self._landing[seq_id]
        landing.join()
        return True

    def reset(self) -> None:
        """Forget the launched step (after a failure: its tokens are not delivered)."""
        self._previous = None
        self._requests.clear()
        if self.prompts is not None:
            self.prompts.synchronize()
        self._landing.clear()
