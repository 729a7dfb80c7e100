"""Continuous batching: many requests share each decode step; they join and leave between steps.

Why a scheduler in the engine (not in the HTTP layer): one decode step reads every weight once
whatever the number of rows, so the engine serves N clients at nearly the cost of one only if
their tokens are made in the same steps. One thread owns the device and loops:

1. intake and cancellation: new requests queue in arrival order; a cancelled one (a client that
   left, a consumer that closed its Generation) leaves now, its slot and blocks freed;
2. admission, first come first served: the head of the queue starts when a sequence slot is free
   and the pool's free blocks, less those promised to running sequences, hold its prompt plus its
   max tokens (so a running sequence never runs out of blocks and nothing is ever preempted);
3. prompt reading: at most `prefill_budget` prompt tokens per iteration, oldest first, several
   sequences' pieces in one pass, so a new request gets its first token while the others keep
   streaming;
4. one decode step for every sequence whose prompt is read (its first step feeds the prompt's
   last token), each row sampled by its own request's sampler (own seeded generator, own logit
   bias): a request's tokens do not depend on who else is in the batch;
5. delivery of the PREVIOUS step's tokens: the step just launched runs on the device while the
   host checks stop ids and hands tokens to their consumers (one step of look-ahead, as the
   single-sequence loop has; a row whose sequence turned out finished is simply ignored).

Consumers read a `Generation` (engine/generation.py) fed through a queue, so Engine.stream looks
the same to the server, the CLI and the benchmarks whether the engine batches or not.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.batch_runner import BatchRunner
from engine.errors import ContextLengthError, EngineError
from engine.generate import GenerationState, Sampler, SamplingParams
from engine.generation import Generation
from engine.kv_pool import KVPool
from engine.logprobs import StepLogprobs, TokenLogprobs

log = logging.getLogger(__name__)

_END = object()  # a sequence's last queue item: its Generation ends


@dataclass(frozen=True)
class SchedulerStats:
    """What /metrics reports (vLLM's names in engine/server/metrics.py)."""

    running: int
    waiting: int
    max_num_seqs: int
    kv_usage: float  # fraction of the pool's blocks held
    kv_tokens: int  # tokens the pool's blocks hold
    steps: int  # decode steps run
    step_rows: int  # sequences decoded in those steps, summed (rows / steps = tokens per step)
    last_step_rows: int
    peak_step_rows: int  # the most sequences one step carried
    prompt_tokens_read: int


class _Sequence:
    """One request inside the scheduler: what it asked for and where it stands."""

    def __init__(
        self, prompt: list[int], max_new: int, sampling: SamplingParams, stops: frozenset[int],
        chunk: int, score_budget: int | None, logprobs: int | None = None,
    ) -> None:  # fmt: skip
        self.prompt = prompt
        # None: no log-probabilities; k >= 0: the token's own and the top k (engine/logprobs.py)
        self.logprobs = logprobs
        self.logprob_list: list[TokenLogprobs] | None = [] if logprobs is not None else None
        self.max_new = max_new
        self.sampling = sampling
        self.stops = stops
        self.chunk = chunk
        self.score_budget = score_budget
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.state = GenerationState()
        self.sampler: Sampler | None = None
        self.plain_greedy = sampling.greedy and not sampling.logit_bias
        self.ids: torch.Tensor | None = None
        self.slot = -1
        self.need_blocks = 0
        self.read = 0  # prompt tokens in the cache (all but the last, which the first step feeds)
        self.fed = 0  # decode steps launched for it
        self.made = 0  # tokens delivered
        self.finished = False

    @property
    def body(self) -> int:
        return len(self.prompt) - 1

    @property
    def ready(self) -> bool:
        return self.read >= self.body

    @property
    def position(self) -> int:
        """The position the next step feeds."""
        return self.body + self.fed


@dataclass
class _Launched:
    """A step on the device whose tokens have not reached the host yet."""

    rows: list[_Sequence]
    ids: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # [B] int64 (pinned on CUDA), filled when `event` completes
    event: torch.cuda.Event | None
    index: dict[int, int]  # id(sequence) -> row
    logprobs: StepLogprobs | None = None  # the rows that asked for them, still on the device


class Scheduler:
    """Runs the loop above in its own thread; `submit` is safe from any thread."""

    def __init__(
        self,
        runner: BatchRunner,
        pool: KVPool,
        max_num_seqs: int,
        prefill_budget: int,
        max_context: int,
    ) -> None:
        self.runner = runner
        self.pool = pool
        self.device = pool.device
        self.max_num_seqs = max_num_seqs
        self.prefill_budget = max(1, prefill_budget)
        self.max_context = max_context
        self._inbox: queue.SimpleQueue[_Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closing = False
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._steps = self._step_rows = self._last_rows = self._peak_rows = self._prompt_read = 0
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="gpurig-scheduler", daemon=True)
        self._thread.start()

    # ---- the consumers' side -------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        max_new: int,
        sampling: SamplingParams,
        stops: set[int],
        chunk: int,
        score_budget: int | None = None,
        logprobs: int | None = None,
    ) -> Generation:
        """Queue a request (already validated by Engine.stream); its tokens come as a Generation
        (with `logprobs` k: each token's TokenLogprobs in `Generation.logprobs`, in step).
        A request whose prompt plus max tokens can never fit the pool is refused now."""
        if self._failure is not None or self._closing:
            raise EngineError("the engine's scheduler has stopped", "restart the engine")
        need = self.pool.blocks_for(min(len(prompt) + max_new, self.max_context))
        total = self.pool.geometry.num_blocks - 1
        if need > total:
            raise ContextLengthError(
                requested=len(prompt) + max_new, limit=total * self.pool.block_size
            )
        seq = _Sequence(list(prompt), max_new, sampling, frozenset(stops), chunk, score_budget,
                        logprobs)  # fmt: skip
        gen = Generation(self._tokens(seq), seq.state, len(prompt), logprobs=seq.logprob_list)
        if max_new == 0:
            seq.state.finish_reason = "length"
            seq.out.put(_END)
            return gen
        self._inbox.put(seq)
        self._wake.set()
        return gen

    def _tokens(self, seq: _Sequence) -> Iterator[int]:
        try:
            while True:
                item = seq.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # closed early (or done): the loop frees its slot at its next iteration
            seq.cancel.set()
            self._wake.set()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting) + self._inbox.qsize(),
            max_num_seqs=self.max_num_seqs,
            kv_usage=self.pool.usage,
            kv_tokens=self.pool.geometry.token_capacity,
            steps=self._steps,
            step_rows=self._step_rows,
            last_step_rows=self._last_rows,
            peak_step_rows=self._peak_rows,
            prompt_tokens_read=self._prompt_read,
        )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop; every open request ends with an error."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        launched: _Launched | None = None
        while True:
            try:
                self._intake()
                if self._closing:
                    self._fail_all(EngineError("the engine is shutting down", "retry later"))
                    return
                self._reap()
                self._admit()
                self._read_prompts()
                current = self._launch(launched)
                if launched is not None:
                    self._deliver(launched)
                launched = current
                if launched is None and not self._running:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
            except BaseException as exc:  # never let one failure kill the loop silently
                log.exception("scheduler step failed")
                launched = None
                self._fail_all(exc)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    self._failure = exc
                    return

    def _intake(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _reap(self) -> None:
        """Cancelled requests leave: waiting ones at once, running ones freeing their slot."""
        if any(s.cancel.is_set() for s in self._waiting):
            for s in [s for s in self._waiting if s.cancel.is_set()]:
                self._waiting.remove(s)
                self._end(s, None)
        for s in [s for s in self._running if s.cancel.is_set() and not s.finished]:
            self._end(s, None)

    def _promised(self) -> int:
        """Blocks running sequences may still take (their need less what they hold)."""
        return sum(max(0, s.need_blocks - self.pool.held(s.slot)) for s in self._running)

    def _admit(self) -> None:
        pool = self.pool
        while self._waiting and len(self._running) < self.max_num_seqs and pool.free_slots:
            s = self._waiting[0]
            need = pool.blocks_for(min(len(s.prompt) + s.max_new, self.max_context))
            if pool.free_blocks - self._promised() < need:
                return  # first come first served: the head waits for blocks, nobody overtakes
            self._waiting.popleft()
            s.slot = pool.open_slot()
            s.need_blocks = need
            s.sampler = Sampler(s.sampling, self.device)
            s.ids = torch.tensor(s.prompt, dtype=torch.int64, device=self.device)
            self._running.append(s)

    def _read_prompts(self) -> None:
        """Up to prefill_budget prompt tokens, oldest sequence first, read in one pass: one
        piece per sequence (a sequence's next piece follows in the next iteration), the pass no
        longer than the smallest chunk the memory plan allowed any of them."""
        pending = [s for s in self._running if not s.ready and not s.finished]
        if not pending:
            return
        # a plan's chunk below its prompt's body is what memory allows per pass; one equal to
        # the body (a short prompt read whole) limits nothing
        budget = min([self.prefill_budget] + [s.chunk for s in pending if s.chunk < s.body])
        parts, readers = [], []
        for s in pending:
            n = min(s.body - s.read, s.chunk, budget)
            if n <= 0:
                break
            if not self.pool.grow(s.slot, s.read + n):  # promised at admission
                raise EngineError("the KV pool ran out of blocks", "report this bug")
            parts.append((s.slot, s.ids[s.read : s.read + n], s.read))
            readers.append((s, n))
            budget -= n
        score = [s.score_budget for s, _ in readers if s.score_budget is not None]
        self.runner.read_chunks(parts, min(score) if score else None)
        for s, n in readers:
            s.read += n
            self._prompt_read += n

    def _launch(self, previous: _Launched | None) -> _Launched | None:
        rows = [
            s for s in self._running
            if s.ready and not s.finished and s.fed < s.max_new and s.position < self.max_context
        ]  # fmt: skip
        if not rows:
            return None
        for s in rows:
            if not self.pool.grow(s.slot, s.position + 1):
                raise EngineError("the KV pool ran out of blocks", "report this bug")
        b = len(rows)
        index = previous.index if previous is not None else {}
        host = torch.tensor(
            [
                [index.get(id(s), -1) if s.fed else -1 for s in rows],
                [0 if s.fed else s.prompt[-1] for s in rows],
                [s.position for s in rows],
                [s.slot for s in rows],
            ],
            dtype=torch.int64,
        )
        if self.device.type == "cuda":  # pinned: the copy queues instead of waiting
            host = host.pin_memory()
        staged = host.to(self.device, non_blocking=True)
        src, fresh, positions, slots = staged[0], staged[1], staged[2], staged[3]
        if previous is not None:
            carried = previous.ids[src.clamp(min=0)]
            tokens = torch.where(src >= 0, carried, fresh)
        else:
            tokens = fresh
        logits = self.runner.step(tokens, positions, slots.to(torch.int32))
        ids = self._sample(logits, rows)
        asked = [r for r, s in enumerate(rows) if s.logprobs is not None]
        # read now: on CUDA `logits` is the graph's output buffer, which the next step rewrites
        logprobs = (
            StepLogprobs.compute(logits, ids, asked, [rows[r].logprobs for r in asked])
            if asked
            else None
        )
        out = torch.empty(b, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        event = None
        if self.device.type == "cuda":
            out.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            out.copy_(ids)
        for s in rows:
            s.fed += 1
        self._steps += 1
        self._step_rows += b
        self._last_rows = b
        self._peak_rows = max(self._peak_rows, b)
        index = {id(s): r for r, s in enumerate(rows)}
        return _Launched(rows, ids, out, event, index, logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[_Sequence]) -> torch.Tensor:
        """Each row's token: one argmax for the plain greedy rows, the request's own sampler
        (generator, logit bias) for the others."""
        ids = logits.argmax(dim=-1)
        for r, s in enumerate(rows):
            if not s.plain_greedy:
                ids[r : r + 1] = s.sampler(logits[r])
        return ids

    def _deliver(self, step: _Launched) -> None:
        if step.event is not None:
            step.event.synchronize()
        values = step.host.tolist()
        logprobs = step.logprobs.to_host(values) if step.logprobs is not None else {}
        for r, (s, tok) in enumerate(zip(step.rows, values, strict=True)):
            if s.finished or s.cancel.is_set():
                continue
            if tok in s.stops:
                self._end(s, "stop")
                continue
            s.made += 1
            if s.logprob_list is not None:  # before the token: a consumer that has it finds them
                s.logprob_list.append(logprobs[r])
            s.out.put(tok)
            if s.made >= s.max_new or s.body + s.made >= self.max_context:
                self._end(s, "length")

    def _end(self, s: _Sequence, reason: str | None) -> None:
        s.finished = True
        s.state.finish_reason = reason
        s.out.put(_END)
        if s.slot >= 0:
            self.pool.close_slot(s.slot)
            s.slot = -1
        if s in self._running:
            self._running.remove(s)

    def _fail_all(self, exc: BaseException) -> None:
        for s in [*self._running, *self._waiting]:
            if not s.finished:
                s.finished = True
                s.out.put(exc)
            if s.slot >= 0:
                self.pool.close_slot(s.slot)
                s.slot = -1
        self._running.clear()
        self._waiting.clear()
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                break
            if self._closing:
                seq.out.put(exc)
            else:
                self._waiting.append(seq)
