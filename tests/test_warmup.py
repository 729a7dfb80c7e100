"""The engine's warm-up (engine/warmup.py, engine/kernels/launch.py) on the CPU: which prompts it
reads, that it leaves the engine as it found it, and the compile-only switch that the GPU's
compile pass runs under (that pass itself needs a GPU: tests/kernels/test_warmup_compiles.py)."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.errors import EngineError
from engine.kernels import tuning
from engine.kernels.launch import compile_ahead, compiling_only
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.warmup import prompt_lengths, warm_up


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup") / "tiny"
    make_checkpoint(path, preset="tiny", seed=3)
    return path


def test_lengths_cover_one_token_uneven_even_and_two_chunks():
    # the powers of two up to the budget: a first 2,047-token prompt waited 1.6-1.8x its warm
    # time on the H200 while 2,048 was missing
    assert prompt_lengths(4096, 2048) == (1, 37, 64, 128, 256, 512, 1024, 2048, 2085)
    assert prompt_lengths(8192, 1024) == (1, 37, 64, 128, 256, 512, 1024, 1061)
    # a short context: every prompt still leaves room for its two new tokens
    assert prompt_lengths(100, 256) == (1, 37, 64, 98)
    assert prompt_lengths(2, 256) == (1,)


def test_warm_up_leaves_the_engine_as_it_found_it(checkpoint):
    prompts = [[2] + [(7 * i + s) % 200 + 10 for i in range(n)] for s, n in ((1, 9), (2, 30))]
    params = SamplingParams(max_tokens=6)
    cold = engine.load(checkpoint, device="cpu", max_context=128, max_num_seqs=2, warm_up=False)
    expected = [cold.generate(p, params) for p in prompts]
    eng = engine.load(checkpoint, device="cpu", max_context=128, max_num_seqs=2, warm_up=False)
    free = eng.pool.blocks.free_blocks
    report = warm_up(eng, every_length=True)
    assert report.lengths == prompt_lengths(128, eng.batching.prefill_budget)
    assert report.compile_s == 0.0 and report.capture_s == 0.0 and report.threads == 1
    assert report.prompts_s > 0 and "warmed up in" in report.line()
    assert not eng.has_work and eng.pool.blocks.free_blocks == free
    assert [eng.generate(p, params) for p in prompts] == expected


def test_load_warms_up_with_one_token_on_the_cpu(checkpoint):
    eng = engine.load(checkpoint, device="cpu", max_context=64)
    assert eng.warm_up_report is not None and eng.warm_up_report.lengths == (1,)
    assert (
        engine.load(checkpoint, device="cpu", max_context=64, warm_up=False).warm_up_report is None
    )


def test_compile_ahead_switches_launches_and_tuning_off_inside_only():
    before = tuning.autotune_enabled()
    with compile_ahead(2) as active:
        assert active and compiling_only()
        assert not tuning.autotune_enabled()  # no timing of kernels that do not run
    assert not compiling_only() and tuning.autotune_enabled() == before
    with compile_ahead(1) as active:  # one thread: nothing to gain, launches run as usual
        assert not active and not compiling_only()


def test_compile_threads_from_the_environment():
    assert EngineOptions.from_env({"GPURIG_COMPILE_THREADS": "6"}).compile_threads == 6
    assert EngineOptions.from_env({}).compile_threads is None
    for bad in ("0", "many", "-2"):
        with pytest.raises(EngineError, match="GPURIG_COMPILE_THREADS"):
            EngineOptions.from_env({"GPURIG_COMPILE_THREADS": bad})
    with pytest.raises(ValueError, match="compile_threads"):
        EngineOptions(compile_threads=0)


def test_a_cleared_pool_equals_a_new_one(checkpoint):
    eng = engine.load(checkpoint, device="cpu", max_context=128, max_num_seqs=2, warm_up=False)
    eng.generate([2, 30, 31, 32, 33], SamplingParams(max_tokens=4))
    pool = eng.pool
    assert any(bool(k.abs().sum()) for k in pool.k.values())  # the request left its keys
    pool.clear()
    fresh = engine.load(checkpoint, device="cpu", max_context=128, max_num_seqs=2, warm_up=False)
    for i in pool.k:
        assert torch.equal(pool.k[i], fresh.pool.k[i]) and torch.equal(pool.v[i], fresh.pool.v[i])
        assert torch.equal(pool.pos[i], fresh.pool.pos[i])
    assert torch.equal(pool.block_tables, fresh.pool.block_tables)
