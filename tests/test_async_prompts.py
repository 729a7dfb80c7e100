"""Prompt passes beside the decode steps (EngineOptions.async_prompts, engine/prompt_stream.py)
through the real scheduler, runner and engine loop on the CPU reference path.

The CPU has no second stream, so the side stream is played by a stand-in that reads the prompt
at once but reports the pass landed only after a few polls, as a pass still running on the GPU
would. What is checked is the engine's side of it: a sequence waits for its pass, the others
keep decoding, a request cancelled during its pass frees its slot, and every request gets the
tokens it gets alone. The CUDA stream itself is tested on a GPU
(tests/kernels/test_kernels_pdl.py style, test_async_prompts_gpu below).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_support import overlapping_tokens

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.options import EngineOptions
from engine.sampling import SamplingParams

CTX = 256
REF = EngineOptions(fast="off")


class _LateLanding:
    """A pass the device finishes only after `polls` queries (or when waited for)."""

    def __init__(self, polls: int) -> None:
        self.left = polls
        self.polled = 0
        self.joins = 0

    def done(self) -> bool:
        self.polled += 1
        self.left -= 1
        return self.left < 0

    def wait(self) -> None:
        self.left = -1

    def join(self) -> None:
        self.joins += 1


class _LatePrompts:
    """Stands for SidePrompts on the CPU."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.landings: list[_LateLanding] = []

    def run(self, read) -> _LateLanding:
        read()
        landing = _LateLanding(self.polls)
        self.landings.append(landing)
        return landing

    def synchronize(self) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("async_prompts") / "tiny"
    make_checkpoint(path, preset="tiny", seed=3)
    return path


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [(7 * i + salt) % 400 + 10 for i in range(n - 1)]


def _late_engine(checkpoint, polls: int, options: EngineOptions = REF):
    eng = engine.load(checkpoint, device="cpu", max_context=CTX, options=options, max_num_seqs=4)
    prompts = _LatePrompts(polls)
    eng.runner.prompts = prompts
    eng.scheduler = eng._new_scheduler()  # asks the runner whether a pass landed
    return eng, prompts


def test_every_request_gets_its_own_tokens_while_passes_land_late(checkpoint):
    single = engine.load(checkpoint, device="cpu", max_context=CTX, options=REF)
    specs = [(1, 12), (5, 30), (40, 8), (17, 25), (90, 16), (3, 40), (33, 5)]
    prompts = [_prompt(n, salt=i) for i, (n, _) in enumerate(specs)]
    alone = [
        single.generate(p, SamplingParams(max_tokens=m, stop_ids=()))
        for p, (_, m) in zip(prompts, specs, strict=True)
    ]
    eng, late = _late_engine(checkpoint, polls=3)
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        time.sleep(0.02 * i)  # staggered arrivals: passes land while others decode
        got[i] = eng.generate(prompts[i], SamplingParams(max_tokens=specs[i][1], stop_ids=()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got[i] for i in range(len(specs))] == alone
        assert late.landings and all(landing.left < 0 for landing in late.landings)
        # each landed pass was waited on (rows held back) and ordered before the rows after it
        assert sum(landing.polled for landing in late.landings) >= len(late.landings)
        # (once per sequence it carried: arrivals close together share a pass)
        assert all(landing.joins >= 1 for landing in late.landings if landing.polled)
        st = eng.scheduler.stats()
        assert st.step_rows == sum(m for _, m in specs) and st.steps < st.step_rows
    finally:
        eng.close()


def test_a_request_cancelled_during_its_pass_frees_its_slot(checkpoint):
    eng, late = _late_engine(checkpoint, polls=1000)  # its pass never lands by polling
    try:
        gen = eng.stream(_prompt(100, 4), SamplingParams(max_tokens=20, stop_ids=()))
        eng.step()  # admitted, its pass launched
        assert late.landings and eng.pool.usage > 0
        gen.close()
        for _ in range(5):
            eng.step()
        assert late.landings[0].joins == 1  # the next plan ordered itself after the pass
        assert eng.pool.usage == 0.0 and eng.pool.blocks.free_slots == 4
        late.polls = 0  # later passes land at once
        p = _prompt(20, 9)
        want = engine.load(checkpoint, device="cpu", max_context=CTX, options=REF).generate(
            p, SamplingParams(max_tokens=6, stop_ids=())
        )
        assert eng.generate(p, SamplingParams(max_tokens=6, stop_ids=())) == want
    finally:
        eng.close()


def test_async_prompts_needs_cuda_and_is_read_from_the_environment(checkpoint):
    opts = EngineOptions.from_env({"GPURIG_FAST": "0"})
    assert opts.async_prompts and EngineOptions().async_prompts  # on by default
    assert not EngineOptions.from_env({"GPURIG_ASYNC_PROMPTS": "0"}).async_prompts
    eng = engine.load(checkpoint, device="cpu", max_context=CTX, options=opts)
    try:
        assert eng.runner.prompts is None and eng.scheduler.landed is None  # one stream
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_async_prompts_gpu(tmp_path) -> None:
    """On a GPU: greedy fp32 tokens of eight staggered requests and one alone, with prompt
    passes on the side stream and without. fp32: which rows share a step depends on timing,
    and in bf16 a different bucket's product may round a near tie the other way (seen once)."""
    make_checkpoint(tmp_path, preset="small", seed=5, emb4=True)

    def side(on: bool):
        return lambda eng: _assert_side_stream(eng, on)

    fp32 = torch.float32
    got = overlapping_tokens(tmp_path, EngineOptions(async_prompts=True), dtype=fp32,
                             stagger=0.01, check=side(True))  # fmt: skip
    assert got == overlapping_tokens(tmp_path, EngineOptions(async_prompts=False), dtype=fp32,
                                     stagger=0.01, check=side(False))  # fmt: skip


def _assert_side_stream(eng, on: bool) -> None:
    assert (eng.runner.prompts is not None) == on
