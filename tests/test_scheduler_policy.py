"""The scheduler's policy without torch: step plans from plain sequences and block counts.

The runner is played by hand: each test takes the plan, "runs" it (nothing to run), and hands
back made-up tokens one step late, as engine/runner.py does, so what is checked is the policy
alone: who is admitted, which prompt chunks and decode rows a step carries, when a sequence
ends, and that its blocks and slot come back.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_manager import BlockManager
from engine.errors import ContextLengthError
from engine.sampling import SamplingParams
from engine.scheduler import DecodeRow, Scheduler
from engine.sequence import Output, Sequence

BLOCK = 4


def _scheduler(blocks: int = 33, seqs: int = 4, budget: int = 16, ctx: int = 64,
               whole: bool = False) -> Scheduler:  # fmt: skip
    return Scheduler(BlockManager(blocks, seqs, BLOCK, ctx), seqs, budget, ctx, whole_prompts=whole)


def _seq(n: int, max_tokens: int, stops=(), chunk: int = 8, outputs=None) -> Sequence:
    def sink(_s: Sequence, out: Output) -> None:
        if outputs is not None:
            outputs.append(out)

    prompt = list(range(10, 10 + n))
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens), frozenset(stops), chunk, None,
                    sink)  # fmt: skip


def test_the_policy_imports_no_torch():
    code = "import sys, engine.scheduler, engine.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_prompt_is_read_in_chunks_then_decoded_with_look_ahead():
    sch = _scheduler()
    outs: list[Output] = []
    s = _seq(20, 3, chunk=8, outputs=outs)
    sch.add(s)
    plans = [sch.schedule() for _ in range(3)]
    assert plans[0].opened == (s.slot,) and plans[0].started == (s,)
    # the body (19 tokens) in chunks of at most 8; the last token is the first decode row's
    assert [(c.start, c.length) for p in plans for c in p.chunks] == [(0, 8), (8, 8), (16, 3)]
    assert plans[2].rows == (DecodeRow(s.id, s.slot, 19, 29),)  # fed the prompt's last token
    # blocks granted as the positions grow, never beyond what the sequence reaches
    granted = [b for p in plans for g in p.grants for b in g.blocks]
    assert len(granted) == 5 and 0 not in granted  # positions 0..19: 5 blocks of 4
    nxt = sch.schedule()  # the next row carries the token still on the device
    assert nxt.rows == (DecodeRow(s.id, s.slot, 20, None),)
    sch.deliver([(s.id, 111, None)])  # step 3's token arrives one step late
    sch.schedule()
    sch.deliver([(s.id, 112, None)])
    assert [o.tokens for o in outs] == [[111], [112]]
    assert sch.schedule().rows == ()  # max_tokens 3: all three rows were launched
    sch.deliver([(s.id, 113, None)])
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].tokens == [113]
    assert s.made == 3 and s.slot == -1
    last = sch.schedule()
    assert last.ended == (s.id,) and sch.blocks.free_blocks == 32 and not sch.has_work


def test_a_stop_id_ends_it_without_being_returned_and_frees_its_blocks():
    sch = _scheduler()
    outs: list[Output] = []
    s = _seq(3, 10, stops={7}, outputs=outs)
    sch.add(s)
    sch.schedule()  # the body, 2 tokens
    sch.schedule()  # first row
    sch.schedule()  # second row (the first token still on the device)
    sch.deliver([(s.id, 5, None)])
    sch.deliver([(s.id, 7, None)])  # the stop id
    assert [o.tokens for o in outs] == [[5], []] and outs[-1].finish_reason == "stop"
    sch.deliver([(s.id, 9, None)])  # a row launched after the stop: ignored
    assert s.made == 1 and len(outs) == 2 and sch.blocks.free_blocks == 32


def test_first_come_first_served_the_head_waits_for_blocks_and_nobody_overtakes():
    sch = _scheduler(blocks=9, seqs=4)  # 8 usable blocks of 4 tokens
    big1, big2, small = _seq(17, 7), _seq(17, 7), _seq(2, 1)  # 6 blocks each; 1 block
    for s in (big1, big2, small):
        sch.add(s)
    plan = sch.schedule()
    assert plan.started == (big1,)  # big2 needs 6 blocks, 2 are left: it waits
    assert list(sch.waiting) == [big2, small]  # and small, which would fit, waits behind it
    big1.cancel()
    plan = sch.schedule()
    assert big1.finished and big1.finish_reason is None
    assert plan.started == (big2, small)  # in arrival order, now that the blocks are back


def test_prompt_reading_is_shared_within_the_budget_oldest_first():
    sch = _scheduler(budget=10)
    a, b, c = _seq(9, 2, chunk=8), _seq(9, 2, chunk=8), _seq(9, 2, chunk=8)
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(a.id, 0, 8), (b.id, 0, 2)]
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(b.id, 2, 6), (c.id, 0, 4)]
    # a's prompt was read: it decodes meanwhile; b's is read now, so b's first row joins too
    assert [r.seq for r in plan.rows] == [a.id, b.id]


def test_with_graphed_passes_a_prompt_read_whole_later_is_not_cut():
    """whole_prompts (the engine's passes replay as CUDA graphs, which read fresh prompts only)."""
    sch = _scheduler(budget=10, whole=True)
    a, b, c = _seq(9, 2, chunk=8), _seq(9, 2, chunk=8), _seq(4, 2, chunk=8)
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    # b (8 tokens) is not cut to fill the budget's last 2: the next pass reads it whole
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(a.id, 0, 8)]
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(b.id, 0, 8)]
    # a's prompt was read: it decodes meanwhile; b's is read now, so b's first row joins too
    assert [r.seq for r in plan.rows] == [a.id, b.id]
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(c.id, 0, 3)]


def test_with_graphed_passes_a_long_prompt_is_still_read_in_pieces():
    sch = _scheduler(budget=10, whole=True)
    a, b = _seq(4, 2, chunk=8), _seq(21, 2, chunk=8)
    for s in (a, b):
        sch.add(s)
    plan = sch.schedule()
    # b's first piece would be 8; the budget leaves 7, so b waits for the next pass
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(a.id, 0, 3)]
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(b.id, 0, 8)]
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(b.id, 8, 8)]
    plan = sch.schedule()
    assert [(x.seq, x.start, x.length) for x in plan.chunks] == [(b.id, 16, 4)]


def test_cancelled_waiting_and_running_sequences_leave():
    sch = _scheduler(seqs=1)
    outs: list[Output] = []
    run, wait = _seq(5, 9, outputs=outs), _seq(5, 9, outputs=outs)
    sch.add(run)
    sch.add(wait)
    sch.schedule()
    wait.cancel()
    sch.schedule()
    assert wait.finished and list(sch.waiting) == []
    run.cancel()
    plan = sch.schedule()
    assert run.finished and plan.rows == () and sch.blocks.free_slots == 1
    assert all(o.finished and o.finish_reason is None for o in outs)


def test_refusals_and_empty_requests():
    sch = _scheduler(blocks=5)  # 16 tokens of blocks
    with pytest.raises(ContextLengthError) as info:
        sch.add(_seq(10, 10))
    assert (info.value.requested, info.value.limit) == (20, 16)
    outs: list[Output] = []
    sch.add(_seq(3, 0, outputs=outs))  # max_tokens 0: ended at once, never queued
    assert outs[0].finished and outs[0].finish_reason == "length" and not sch.has_work


def test_a_failed_step_ends_every_sequence_with_its_error():
    sch = _scheduler()
    outs: list[Output] = []
    for n in (3, 30):
        sch.add(_seq(n, 5, outputs=outs))
    sch.schedule()
    sch.add(_seq(4, 5, outputs=outs))  # still in the inbox
    boom = RuntimeError("device lost")
    sch.fail_all(boom)
    assert [o.error for o in outs] == [boom] * 3
    assert sch.blocks.free_blocks == 32 and sch.blocks.free_slots == 4


def test_with_passes_beside_the_steps_a_sequence_decodes_once_its_last_pass_landed():
    """The runner reads prompts on a second stream (engine/prompt_stream.py): a sequence's
    first row never shares a plan with its own last pass, and waits until the runner says the
    pass landed, while the others keep decoding."""
    in_flight: set[int] = set()  # the runner's passes not landed yet, played by hand
    sch = Scheduler(BlockManager(33, 4, BLOCK, 64), 4, 16, 64,
                    landed=lambda seq: seq not in in_flight)  # fmt: skip

    def step():
        plan = sch.schedule()
        in_flight.update(c.seq for c in plan.chunks)  # the runner launches the plan's pass
        return plan

    old, new, one = _seq(3, 8), _seq(11, 4), _seq(1, 2)
    sch.add(old)
    assert [c.seq for c in step().chunks] == [old.id]
    assert step().rows == ()  # its pass has not landed
    in_flight.clear()
    assert [r.seq for r in step().rows] == [old.id]
    sch.add(new)
    plan = step()  # new's whole body in this plan's pass: old decodes, new does not
    assert [c.seq for c in plan.chunks] == [new.id] and [r.seq for r in plan.rows] == [old.id]
    assert [r.seq for r in step().rows] == [old.id]  # not landed yet
    in_flight.clear()
    rows = step().rows
    assert [r.seq for r in rows] == [old.id, new.id]
    assert rows[1] == DecodeRow(new.id, new.slot, 10, 20)  # fed its prompt's last token
    sch.add(one)  # a one-token prompt has no pass to wait for: it decodes at once
    plan = step()
    assert plan.chunks == () and one.id in [r.seq for r in plan.rows]


def test_outputs_reach_the_sinks_as_they_are_made():
    """deliver and a cancellation hand their outputs to the sink at once, in order (tokens,
    then the end); a request of zero tokens hears at once, on the caller's thread."""
    sch = Scheduler(BlockManager(33, 4, BLOCK, 64), 4, 16, 64)
    outs: list[Output] = []
    s = _seq(3, 10, outputs=outs)
    sch.add(s)
    for _ in range(3):  # the body, then two rows
        sch.schedule()
    sch.deliver([(s.id, 5, None)])
    assert [o.tokens for o in outs] == [[5]]
    sch.deliver([(s.id, 6, None)])
    s.cancel()
    sch.schedule()  # ends it (cancelled)
    assert [o.tokens for o in outs] == [[5], [6], []] and outs[-1].finished
    zero: list[Output] = []
    sch.add(_seq(2, 0, outputs=zero))
    assert len(zero) == 1 and zero[0].finished and zero[0].finish_reason == "length"
