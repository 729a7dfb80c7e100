"""Long prompts in bounded memory (issue 13): the sliced chunk attention against one-block
attention at the chunk lengths that broke torch SDPA, a long chunked read against one whole
pass (logits and greedy continuation, several chunk sizes), and the memory plan that picks the
chunk or refuses a prompt before reading it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_support import prefill, read_prompt, sequence_cache

import engine
from engine import memory, ops
from engine.attention import attend_chunk
from engine.checkpoint_maker import make_checkpoint, text_config_dict
from engine.config import parse_config
from engine.memory import MIB, PromptMemoryError, plan_prompt
from engine.sampling import SamplingParams

LENGTHS = [1, 2, 33, 64, 65, 97, 129]  # 33, 65, 97: torch's memory-efficient kernel's bad rows


def _case(t: int, window: int | None, start: int, hq: int = 8, d: int = 32, seed: int = 0):
    """q/k/v of a chunk at positions start.. and the cache before it, as the model passes them:
    a ring of `window` slots (some empty when start < window) or a full layer's prefix."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=gen)
    k_new, v_new = torch.randn(2, t, 1, d, generator=gen)
    slots = window if window is not None else start
    ck, cv = torch.randn(2, slots, 1, d, generator=gen)
    if window is None:
        cp = torch.arange(start)
    else:  # slot s holds the latest position p < start with p % window == s, or -1
        cp = torch.tensor([max((p for p in range(start) if p % window == s), default=-1)
                           for s in range(window)])  # fmt: skip
    return q, k_new, v_new, ck, cv, cp, torch.arange(start, start + t)


def _one_block(q, k_new, v_new, ck, cv, cp, q_pos, window):
    keys, values = torch.cat([ck, k_new]), torch.cat([cv, v_new])
    return ops._attend(q, keys, values, torch.cat([cp, q_pos]), q_pos, window)


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize(("window", "start"), [(16, 5), (16, 70), (None, 0), (None, 150)])
def test_sliced_chunk_attention_equals_one_block(t, window, start):
    """Tiny budgets force row blocks and key slices of a few keys; every row must still equal
    one-block attention over the concatenated keys, the last row included."""
    case = _case(t, window, start, seed=t)
    want = _one_block(*case, window)
    for budget in (8 * 64, 8 * 5 * 64, 8 * 40 * 100):
        got = attend_chunk(*case, window, budget, prefix_visible=window is None)
        assert (got - want).abs().max() < 1e-5, f"budget {budget}"
        if window is None:  # the prefix masked by its positions gives the same
            masked = attend_chunk(*case, window, budget, prefix_visible=False)
            assert (masked - want).abs().max() < 1e-5


@pytest.mark.parametrize(("t", "window", "start"), [(1100, None, 40), (600, 300, 310)])
def test_row_blocks_stop_at_their_cap_under_a_large_budget(t, window, start):
    """A budget that would let the whole chunk be one block: blocks are still cut at 1,024 rows
    on a full layer and at the window on a sliding one (the caps that keep an uncapped read from
    scoring keys nobody sees), and every row equals one block over the concatenated keys."""
    case = _case(t, window, start, d=16, seed=t)
    want = _one_block(*case, window)
    got = attend_chunk(*case, window, 1 << 40, prefix_visible=window is None)
    assert (got - want).abs().max() < 1e-5


def test_attention_prefill_slices_only_past_the_budget(monkeypatch):
    """Short: one block, bit for bit as before. Past the budget: the sliced path (to rounding)."""
    case = _case(97, 16, 70)
    want = _one_block(*case, 16)
    assert torch.equal(ops.attention_prefill(*case, 16), want)
    got = ops.attention_prefill(*case, 16, score_budget=2 * 97 * 8)
    assert (got - want).abs().max() < 1e-5 and not torch.equal(got, want)


@pytest.fixture(scope="module")
def long_eng(tmp_path_factory) -> engine.Engine:
    path: Path = tmp_path_factory.mktemp("long") / "tiny"
    make_checkpoint(path, "tiny", seed=4)  # max_position_embeddings 4096, window 16
    return engine.load(path, device="cpu", max_context=2048)


def test_a_long_chunked_read_equals_one_whole_pass(long_eng, monkeypatch):
    """1,500 tokens read in chunks of 64 / 250 / 512 with score slices of a few hundred keys:
    the last token's logits equal one whole pass's, and the greedy continuations agree."""
    model, cache = long_eng.model, sequence_cache(long_eng)
    prompt = [2] + torch.randint(
        3, 512, (1499,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    whole = prefill(model, cache, prompt, len(prompt), score_budget=1 << 40).clone()
    ref_tokens = _greedy(model, cache, whole, len(prompt), 6)

    def step(token, position):
        return model.decode_step(token, position, cache)

    monkeypatch.setattr(ops, "SCORE_BUDGET", 2 * 64 * 300)  # ~300 keys per slice at chunk 64
    for chunk in (64, 250, 512):
        got = read_prompt(model, cache, prompt, chunk, step)
        assert (got - whole).abs().max() < 1e-4, f"chunk {chunk}"
        assert _greedy(model, cache, got, len(prompt), 6) == ref_tokens, f"chunk {chunk}"
    # the whole generate path (the reference prefill on the CPU) with a small budget too
    long_eng.prefill_chunk = 100
    assert long_eng.generate(prompt, SamplingParams(max_tokens=6, stop_ids=())) == ref_tokens


def _greedy(model, cache, logits, n, steps) -> list[int]:
    out, tok = [], logits.argmax().view(1)
    for i in range(steps):
        out.append(int(tok))
        tok = model.decode_step(tok, torch.tensor([n + i]), cache)[0].argmax().view(1)
    return out


E2B = SimpleNamespace(
    cfg=parse_config(text_config_dict("e2b")), dtype=torch.bfloat16, device=torch.device("cpu")
)


def test_the_plan_picks_the_largest_chunk_that_fits():
    roomy = plan_prompt(E2B, 131_000, 4096, available=40 << 30)
    assert roomy.chunk == 4096 and roomy.score_budget == memory.SCORE_BUDGET_MAX
    capped = plan_prompt(E2B, 131_000, 4096, available=420 * MIB)  # ~ what 3,732 MiB leaves
    assert 256 <= capped.chunk < 4096 and capped.need_bytes <= 420 * MIB
    assert capped.score_budget >= 8 * capped.chunk * 512  # slices of >= 512 keys, all rows
    less = plan_prompt(E2B, 131_000, 4096, available=250 * MIB)
    assert less.chunk < capped.chunk and less.need_bytes <= 250 * MIB
    short = plan_prompt(E2B, 40, 4096, available=420 * MIB)
    assert short.chunk == 39  # the body in one chunk; the last token goes by the decode step
    cpu = plan_prompt(E2B, 131_000, 256)
    assert cpu.chunk == 256 and cpu.score_budget is None and cpu.available_bytes is None


def test_a_prompt_that_cannot_be_read_is_refused_naming_the_largest():
    with pytest.raises(PromptMemoryError) as err:
        plan_prompt(E2B, 131_000, 4096, available=133 * MIB)
    e = err.value
    assert e.requested == 131_000 and 1 <= e.largest < memory.MIN_CHUNK + 1
    assert e.needed > e.available and "largest prompt that fits" in str(e)
    assert plan_prompt(E2B, e.largest, 4096, available=133 * MIB).chunk == e.largest - 1 or (
        e.largest == 1
    )
    with pytest.raises(PromptMemoryError):
        plan_prompt(E2B, 131_000, 4096, available=-5 * MIB)  # the cap already exceeded


def test_the_engine_refuses_before_reading(long_eng, monkeypatch):
    """Engine.stream raises at the call, not from the first next(); the cache is untouched."""
    cache = sequence_cache(long_eng)
    for c in cache.layers.values():
        c.pos.fill_(3)
    monkeypatch.setattr(memory, "available_bytes", lambda device, cap: 16 * MIB)
    with pytest.raises(PromptMemoryError, match="largest prompt that fits"):
        long_eng.stream(list(range(3, 503)) * 2, SamplingParams(max_tokens=4))
    assert all(bool((c.pos == 3).all()) for c in cache.layers.values())


class _Driver:
    """The memory left as a GPU's driver would report it, one figure per measurement (a GPU
    cannot exist here), and a clock the test moves."""

    def __init__(self, *figures: int) -> None:
        self.figures, self.now, self.asked = list(figures), 0.0, 0

    def measure(self, device, cap_mib):
        self.asked += 1
        return self.figures.pop(0) if len(self.figures) > 1 else self.figures[0]

    def clock(self) -> float:
        return self.now


def test_the_planner_asks_the_driver_once_a_second_while_plans_are_roomy():
    driver = _Driver(40 << 30)
    planner = memory.PromptPlanner(E2B, None, driver.measure, driver.clock)
    for n in (512, 40, 9_000, 1):
        assert planner.plan(n, 4096) == plan_prompt(E2B, n, 4096, available=40 << 30)
        driver.now += 0.2
    assert driver.asked == 1 and planner.measurements == 1
    driver.now += memory.PLAN_REFRESH_S
    planner.plan(512, 4096)
    assert driver.asked == 2


def test_a_bounded_plan_or_a_refusal_rests_on_a_fresh_measurement():
    # just roomy for a 512-token prompt, not for a long one's 4,096-token chunks: the long
    # prompt's plan is made on a fresh figure (by then the device has filled)
    just = plan_prompt(E2B, 512, 4096, available=40 << 30).need_bytes
    driver = _Driver(just, 420 * MIB, 420 * MIB, 133 * MIB)
    planner = memory.PromptPlanner(E2B, 3732, driver.measure, driver.clock)
    assert planner.plan(512, 4096) == plan_prompt(E2B, 512, 4096, available=just)
    assert planner.plan(512, 4096).score_budget == memory.SCORE_BUDGET_MAX and driver.asked == 1
    capped = planner.plan(131_000, 4096)
    assert capped == plan_prompt(E2B, 131_000, 4096, available=420 * MIB) and driver.asked == 2
    # a bounded plan is never reused: the next long prompt measures again, even within the second
    assert planner.plan(131_000, 4096) == capped and driver.asked == 3
    with pytest.raises(PromptMemoryError) as err:
        planner.plan(131_000, 4096)
    assert err.value.available == 133 * MIB and driver.asked == 4
    # after that fresh figure a short prompt's plan is not roomy either (the score budget is
    # bounded), so it too is planned on a fresh one
    short = err.value.largest
    assert planner.plan(short, 4096) == plan_prompt(E2B, short, 4096, available=133 * MIB)
    assert driver.asked == 5


def test_the_planner_on_the_cpu_plans_as_before():
    driver = _Driver(None)
    planner = memory.PromptPlanner(E2B, None, driver.measure, driver.clock)
    assert planner.plan(131_000, 256) == plan_prompt(E2B, 131_000, 256)


@pytest.mark.parametrize(
    ("own", "env", "expands"),
    [
        ("expandable_segments:True", {}, True),
        ("", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments: True,max_split_size_mb:64"}, True),
        ("", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False),
        ("", {}, False),
    ],
)
def test_reserved_holes_count_only_where_segments_expand(monkeypatch, own, env, expands):
    """Fixed segments cannot give a hole to a larger block, so the planner counts none of them."""
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: own)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert memory.segments_expand() is expands


def test_holes_of_fixed_segments_hold_only_blocks_that_fit_in_them():
    """The allocator serves a block from one free block at least its size: holes of 18 MiB
    take a chunk's small tensors but never the 36 MiB dequantised matrix, and a hole that fits
    the matrix takes it first (best fit), its rest still free."""
    assert memory.hole_credit((18 * MIB,) * 15, 36 * MIB, 4 * MIB, 20 * MIB) == 20 * MIB
    assert memory.hole_credit((18 * MIB,) * 15, 36 * MIB, 4 * MIB, 400 * MIB) == 15 * 16 * MIB
    assert memory.hole_credit((18 * MIB,) * 15, 36 * MIB, 24 * MIB, 400 * MIB) == 0
    both = memory.hole_credit((40 * MIB, 100 * MIB), 36 * MIB, 4 * MIB, 400 * MIB)
    assert both == 36 * MIB + 4 * MIB + 100 * MIB


def test_a_plan_under_fixed_segments_counts_the_holes_its_blocks_fit():
    # the H100's failure (bench/NOTES.md v32): 114 MiB left beside the holes, 134 MiB needed
    with pytest.raises(PromptMemoryError) as err:
        plan_prompt(E2B, 64, 4096, available=114 * MIB, holes=(18 * MIB,) * 15)
    assert err.value.holes and "holes of fixed allocator segments" in str(err.value)
    assert "expandable_segments:True to PYTORCH_CUDA_ALLOC_CONF" in str(err.value)
    # one hole the matrix fits in makes a short prompt readable, and the holes then hold its
    # small tensors: more than without them, never more than they can hold
    roomy = (40 * MIB,) + (18 * MIB,) * 15
    short = plan_prompt(E2B, 64, 4096, available=114 * MIB, holes=roomy)
    assert short.chunk == 63
    long = plan_prompt(E2B, 32_768, 4096, available=114 * MIB, holes=roomy)
    without = plan_prompt(E2B, 32_768, 4096, available=(114 + 36) * MIB)
    assert long.chunk > without.chunk
    widest = memory.reader_widest_bytes_per_token(E2B.cfg, 2)
    per_token = memory.reader_bytes_per_token(E2B.cfg, 2)
    fits_in_holes = sum(h // (long.chunk * widest) * long.chunk * widest for h in roomy[1:])
    assert long.need_bytes <= (114 + 36) * MIB + min(fits_in_holes, long.chunk * per_token)


def test_the_planner_measures_the_holes_with_the_memory_left():
    driver = _Driver(114 * MIB)
    asked = []

    def holes(device, cap_mib):
        asked.append(cap_mib)
        return (40 * MIB,) + (18 * MIB,) * 15

    planner = memory.PromptPlanner(E2B, 3732, driver.measure, driver.clock, holes=holes)
    assert planner.plan(64, 4096).chunk == 63 and asked == [3732]
    assert planner.plan(64, 4096).chunk == 63  # a bounded plan: measured again, holes too
    assert asked == [3732, 3732] and driver.asked == 2


def test_no_holes_are_read_uncapped_or_on_the_cpu():
    assert memory.fixed_segment_holes(torch.device("cpu"), 3732) == ()
    assert memory.fixed_segment_holes(torch.device("cuda"), None) == ()


def test_a_refusal_says_how_much_more_memory_reads_the_prompt():
    with pytest.raises(PromptMemoryError) as err:
        plan_prompt(E2B, 64, 4096, available=114 * MIB)
    shortfall = -(-(err.value.needed - err.value.available) // MIB)
    assert f"about {shortfall} MiB more" in str(err.value)
    # that much more is enough for the smallest chunk
    assert plan_prompt(E2B, 64, 4096, available=114 * MIB + shortfall * MIB).chunk >= 16
