"""`lab.engine.batch_bench`'s closed loop (the sweep's loop in process, no server): every
stream sends its rounds of requests one after another through a real engine (the CPU
reference path here), and the late steps' figures are the differences of the clock's
counters."""

from __future__ import annotations

import pytest

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.options import EngineOptions
from engine.step_clock import HOST_PHASES, StepTimes
from lab.engine import batch_bench


def test_late_steps_are_the_counters_differences() -> None:
    before = StepTimes(timed_steps=10, starved_steps=1, late_host_ms=(1.0, 0.0, 0.0, 0.0, 0.0, 2.0),
                       late_timed=1)  # fmt: skip
    after = StepTimes(timed_steps=110, starved_steps=5, late_host_ms=(1.4, 0.4, 0.8, 0.8, 0.4, 18.0),
                      late_timed=5)  # fmt: skip
    got = batch_bench._late_steps(before, after)
    assert got["late_step_share"] == 0.04
    assert list(got["late_host_ms"]) == list(HOST_PHASES)
    assert list(got["late_host_ms"].values()) == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.1, 4.0])
    none = batch_bench._late_steps(before, before)
    assert none["late_step_share"] is None and set(none["late_host_ms"].values()) == {0.0}


@pytest.fixture
def tiny_engine(tmp_path, monkeypatch):
    """A tiny checkpoint's engine on the CPU, with the bench's prompts in its vocabulary."""
    make_checkpoint(tmp_path, preset="tiny", seed=4)
    # the tiny vocabulary: the bench's own prompts are E2B token ids
    monkeypatch.setattr(batch_bench, "prompt",
                        lambda n, salt: [2] + [(7 * i + salt) % 400 + 10 for i in range(n - 1)])  # fmt: skip
    eng = engine.load(tmp_path, device="cpu", max_context=256, options=EngineOptions(fast="off"),
                      max_num_seqs=4)  # fmt: skip
    yield eng
    eng.close()


def test_closed_rounds_send_every_request(tiny_engine) -> None:
    got = batch_bench.concurrent(tiny_engine, 3, 12, 5, rounds=3)
    assert got["rounds"] == 3 and got["tokens"] == 3 * 3 * 5
    assert got["aggregate_tok_s"] > 0 and got["ttft_ms_max"] >= got["ttft_ms_median"]
    assert got["decode_idle_share"] is None  # no clock off CUDA
    assert got["late_step_share"] is None
    st = tiny_engine.scheduler.stats()
    assert st.step_rows == 3 * 3 * 5  # every token a row of some step


def test_alone_sends_every_round_from_the_stepping_thread(tiny_engine) -> None:
    got = batch_bench.alone(tiny_engine, 3, 12, 5, rounds=3)
    assert got["rounds"] == 3 and got["tokens"] == 3 * 3 * 5
    assert got["ttft_ms_max"] >= got["ttft_ms_median"] > 0
    assert got["per_stream_tok_s_median"] > 0
    assert tiny_engine.scheduler.stats().step_rows == 3 * 3 * 5
    assert not tiny_engine.has_work
