"""The scheduler's policy: which prompt chunks and which decode rows the next step runs.

It touches no tensors (vLLM v1's contract: a plan goes to the model runner, tokens come back),
so the policy is tested without torch and a new policy changes this file only. Each step:

1. intake and cancellation: new sequences join the one waiting line in arrival order; a
   cancelled one (a client that left, a consumer that closed its Generation) leaves now, its
   slot and blocks freed;
2. admission, first come first served: the head of the line starts when a sequence slot is free
   and the free blocks, less those promised to running sequences, hold its prompt plus its max
   tokens (so a running sequence never runs out of blocks and nothing is ever preempted);
3. prompt reading: at most `prefill_budget` prompt tokens per step, oldest first, several
   sequences' pieces in one pass, so a new request gets its first token while the others keep
   streaming;
4. one decode row for every sequence whose prompt is read, and whose last prompt pass has
   landed where passes run beside the steps (its first step feeds the prompt's last token,
   later ones the token its previous step sampled, still on the device: one step of
   look-ahead, so the device decodes while the host delivers);
5. `deliver` takes the tokens of the step before, checks stop ids and lengths and hands each
   sequence its output; a row launched for a sequence that turned out finished is ignored.

A single sequence is a batch of one row through the same steps.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockGrant, BlockManager
from engine.errors import ContextLengthError, EngineError
from engine.sequence import Output, Sequence
from engine.step_clock import HOST_PHASES


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens start..start+length-1 of a sequence, read into its slot."""

    seq: int
    slot: int
    start: int
    length: int


@dataclass(frozen=True)
class DecodeRow:
    """One new token for a sequence: fed `token`, or with None the token its previous step
    sampled (still on the device), at `position`."""

    seq: int
    slot: int
    position: int
    token: int | None


@dataclass(frozen=True)
class StepPlan:
    """What one step runs, in order: slots opened (their rings start empty), blocks granted,
    the prompt chunks (read in one pass, scores within `score_budget`), then the decode rows.
    `started`/`ended`: sequences whose per-request state (sampler) the runner makes or drops."""

    opened: tuple[int, ...] = ()
    grants: tuple[BlockGrant, ...] = ()
    chunks: tuple[PromptChunk, ...] = ()
    score_budget: int | None = None
    rows: tuple[DecodeRow, ...] = ()
    started: tuple[Sequence, ...] = ()
    ended: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.rows or self.ended or self.opened)


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
    # the decode stream's GPU time (the runner's engine.step_clock; zeros off CUDA)
    decode_busy_ms: float = 0.0
    decode_idle_ms: float = 0.0
    starved_steps: int = 0  # steps launched after the step before them had ended
    decode_plain_idle_ms: float = 0.0  # of the idle, before steps admitting/reading/ending none
    # the host's time before late steps by phase (engine.step_clock.HOST_PHASES), and how many
    late_host_ms: tuple[float, ...] = (0.0,) * len(HOST_PHASES)
    late_timed_steps: int = 0
    # the engine process's own garbage collections (engine/process/core.py), which stop its
    # stepping thread; zeros where the engine runs in the server's process (whose collector
    # the server's python_gc_* metrics count)
    process_gc_collections: int = 0
    process_gc_s: float = 0.0
    process_gc_max_pause_s: float = 0.0


# (sequence id, token, its log-probabilities or None) for each row of a step
Delivered = list[tuple[int, int, object]]


class Scheduler:
    """The waiting line, the running set and the blocks; `add` is safe from any thread."""

    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, prefill_budget: int, max_context: int,
        whole_prompts: bool = False, landed: Callable[[int], bool] | None = None,
    ) -> None:  # fmt: skip
        self.blocks = blocks
        self.whole_prompts = whole_prompts  # see _prompt_chunks
        # where prompt passes run beside the decode steps (engine/prompt_stream.py): whether a
        # sequence's passes have finished on the device. Its first row waits for that, so it
        # never shares a plan with its own last pass.
        self.landed = landed
        self.max_num_seqs = max_num_seqs
        self.prefill_budget = max(1, prefill_budget)
        self.max_context = max_context
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._ended: list[int] = []
        self._steps = self._step_rows = self._last_rows = self._peak_rows = self._prompt_read = 0

    # ---- arrivals ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence (its request already checked). One whose prompt plus max tokens
        can never fit the pool is refused now (ContextLengthError)."""
        need = self.blocks.blocks_for(len(seq.prompt) + seq.max_tokens)
        if need > self.blocks.total_blocks:
            raise ContextLengthError(
                requested=len(seq.prompt) + seq.max_tokens,
                limit=self.blocks.total_blocks * self.blocks.block_size,
            )
        if seq.max_tokens == 0:  # on the caller's thread: its sink hears it at once
            self._end(seq, "length")
            return
        self._inbox.put(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._ended) or not self._inbox.empty()

    # ---- one step's plan -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        while True:
            try:
                self.waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        self._reap()
        opened, started = self._admit()
        grants: list[BlockGrant] = []
        chunks, budget = self._prompt_chunks(grants)
        rows = self._decode_rows(grants, {c.seq for c in chunks})
        ended, self._ended = tuple(self._ended), []
        if rows:
            self._steps += 1
            self._step_rows += len(rows)
            self._last_rows = len(rows)
            self._peak_rows = max(self._peak_rows, len(rows))
        return StepPlan(opened, tuple(grants), chunks, budget, rows, started, ended)

    def _reap(self) -> None:
        """Cancelled sequences leave: waiting ones at once, running ones freeing their slot."""
        for s in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(s)
            self._end(s, None)
        for s in [s for s in self.running.values() if s.cancelled]:
            self._end(s, None)

    def _promised(self) -> int:
        """Blocks running sequences may still take (their need less what they hold)."""
        return sum(max(0, s.need_blocks - self.blocks.held(s.slot)) for s in self.running.values())

    def _admit(self) -> tuple[tuple[int, ...], tuple[Sequence, ...]]:
        blocks, opened, started = self.blocks, [], []
        while self.waiting and len(self.running) < self.max_num_seqs and blocks.free_slots:
            s = self.waiting[0]
            need = blocks.blocks_for(len(s.prompt) + s.max_tokens)
            if blocks.free_blocks - self._promised() < need:
                break  # first come first served: the head waits for blocks, nobody overtakes
            self.waiting.popleft()
            s.slot = blocks.open_slot()
            s.need_blocks = need
            s.started_at = time.perf_counter()
            self.running[s.id] = s
            opened.append(s.slot)
            started.append(s)
        return tuple(opened), tuple(started)

    def _grow(self, s: Sequence, tokens: int, grants: list[BlockGrant]) -> None:
        try:
            grant = self.blocks.grow(s.slot, tokens)
        except ValueError as exc:  # promised at admission: cannot happen
            raise EngineError(f"the KV pool ran out of blocks: {exc}", "report this bug") from exc
        if grant is not None:
            grants.append(grant)

    def _prompt_chunks(
        self, grants: list[BlockGrant]
    ) -> tuple[tuple[PromptChunk, ...], int | None]:
        """Up to prefill_budget prompt tokens, oldest sequence first, one piece per sequence
        (its next piece follows in the next step), the pass no longer than the smallest chunk
        the memory plan allowed any of them. With `whole_prompts` (the engine's prompt passes
        replay as CUDA graphs, engine/fast/prefill_graph.py, which read fresh prompts only) a
        prompt that one later pass reads whole is not cut to fill this one; the pass's first
        piece always goes. Without, the budget is filled (an eager pass costs the host about
        the same whatever its size)."""
        pending = [s for s in self.running.values() if not s.prompt_read]
        if not pending:
            return (), None
        # a plan's chunk below its prompt's body is what memory allows per pass; one equal to
        # the body (a short prompt read whole) limits nothing
        budget = min([self.prefill_budget] + [s.chunk for s in pending if s.chunk < s.body])
        chunks, scores = [], []
        for s in pending:
            whole = min(s.body - s.read, s.chunk)
            n = min(whole, budget)
            if n <= 0 or (self.whole_prompts and chunks and n < whole):
                break
            self._grow(s, s.read + n, grants)
            chunks.append(PromptChunk(s.id, s.slot, s.read, n))
            if s.score_budget is not None:
                scores.append(s.score_budget)
            s.read += n
            self._prompt_read += n
            budget -= n
        return tuple(chunks), (min(scores) if scores else None)

    def _decode_rows(self, grants: list[BlockGrant], reading: set[int]) -> tuple[DecodeRow, ...]:
        rows = []
        for s in self.running.values():
            if not s.prompt_read or s.fed >= s.max_tokens or s.position >= self.max_context:
                continue
            if self.landed is not None and not s.fed and (s.id in reading or not self.landed(s.id)):
                continue  # its prompt's last pass runs beside the steps and has not landed
            self._grow(s, s.position + 1, grants)
            rows.append(DecodeRow(s.id, s.slot, s.position, s.prompt[-1] if not s.fed else None))
            s.fed += 1
        return tuple(rows)

    # ---- the tokens of a step ------------------------------------------------------------------
    def deliver(self, delivered: Delivered) -> None:
        """Each row's token to its sequence: a stop id ends it ("stop", not returned), max
        tokens or a full context ends it after the token ("length")."""
        outputs: dict[int, Output] = {}
        for seq_id, tok, lp in delivered:
            s = self.running.get(seq_id)
            if s is None or s.finished or s.cancelled:
                continue
            if tok in s.stops:
                self._end(s, "stop", outputs.pop(s.id, None))
                continue
            out = outputs.setdefault(
                s.id, Output([], [] if s.params.logprobs is not None else None)
            )
            if s.first_token_at is None:
                s.first_token_at = time.perf_counter()
            s.made += 1
            out.tokens.append(tok)
            if out.logprobs is not None:
                out.logprobs.append(lp)
            if s.made >= s.max_tokens or s.body + s.made >= self.max_context:
                self._end(s, "length", outputs.pop(s.id))
        for seq_id, out in outputs.items():
            self._send(self.running[seq_id], out)

    @staticmethod
    def _send(s: Sequence, out: Output) -> None:
        if s.sink is not None:
            s.sink(s, out)

    def _end(self, s: Sequence, reason: str | None, out: Output | None = None) -> None:
        s.finished, s.finish_reason = True, reason
        s.ended_at = time.perf_counter()
        out = out or Output([], [] if s.params.logprobs is not None else None)
        out.finished, out.finish_reason = True, reason
        if s.slot >= 0:
            self.blocks.close_slot(s.slot)
            s.slot = -1
        if self.running.pop(s.id, None) is not None:
            self._ended.append(s.id)
        self._send(s, out)

    def fail_all(self, exc: BaseException) -> None:
        """End every sequence, waiting or running, with `exc` (the step failed)."""
        while True:
            try:
                self.waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for s in [*self.running.values(), *self.waiting]:
            s.finished = True
            if s.slot >= 0:
                self.blocks.close_slot(s.slot)
                s.slot = -1
            if s.sink is not None:
                s.sink(s, Output([], finished=True, error=exc))
        self._ended.extend(self.running)
        self.running.clear()
        self.waiting.clear()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting) + self._inbox.qsize(),
            max_num_seqs=self.max_num_seqs,
            kv_usage=self.blocks.usage,
            kv_tokens=self.blocks.total_blocks * self.blocks.block_size,
            steps=self._steps,
            step_rows=self._step_rows,
            last_step_rows=self._last_rows,
            peak_step_rows=self._peak_rows,
            prompt_tokens_read=self._prompt_read,
        )
