"""The decode stream's clock (engine/step_clock.py): GPU time inside decode steps and between
them, in Engine.stats() and the server's /metrics. Events exist only on CUDA: on the CPU the
counters stay at zero while the steps are counted."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.sampling import SamplingParams
from engine.step_clock import HOST_PHASES, StepTimes, late_phases


def test_idle_share_of_step_times() -> None:
    assert StepTimes().idle_share == 0.0
    assert StepTimes(busy_ms=30.0, idle_ms=10.0, timed_steps=20).idle_share == 0.25


def test_a_late_steps_host_time_by_phase() -> None:
    """deliver / send / receive / loop / schedule / prepare from Engine.step's notes and the
    engine process's; send and receive 0 where that process noted nothing since the last
    launch (one process); nothing where a note is older than that launch or out of order."""
    notes = {"collected": 10.000, "delivered": 10.001, "stepping": 10.004, "scheduled": 10.0045}
    assert HOST_PHASES == ("deliver", "send", "receive", "loop", "schedule", "prepare")
    got = late_phases(notes, last_begin=9.999, now=10.005)
    assert got == pytest.approx([1.0, 0.0, 0.0, 3.0, 0.5, 0.5])
    stale = notes | {"sent": 9.5, "received": 9.6}  # the loop's notes from before that launch
    assert late_phases(stale, last_begin=9.999, now=10.005) == pytest.approx(got)
    process = notes | {"sent": 10.0012, "received": 10.0037}
    got = late_phases(process, last_begin=9.999, now=10.005)
    assert got == pytest.approx([1.0, 0.2, 2.5, 0.3, 0.5, 0.5])
    assert late_phases(notes, last_begin=10.0001, now=10.005) is None  # collected before it
    assert late_phases(notes | {"stepping": 10.0005}, 9.999, 10.005) is None  # out of order
    assert late_phases(process | {"received": 10.0045}, 9.999, 10.005) is None
    assert late_phases({}, 0.0, 1.0) is None


def test_no_clock_off_cuda(tmp_path) -> None:
    make_checkpoint(tmp_path, preset="tiny", seed=2)
    eng = engine.load(tmp_path, device="cpu", max_context=256)
    try:
        eng.generate([2, 40, 41, 42], SamplingParams(max_tokens=6, stop_ids=()))
        st = eng.stats()
        assert st.steps >= 5
        assert (st.decode_busy_ms, st.decode_idle_ms, st.starved_steps) == (0.0, 0.0, 0)
        assert eng.runner.clock.times().timed_steps == 0
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_every_cuda_step_is_timed(tmp_path) -> None:
    """Each collected decode step adds its GPU time; a request decoded alone leaves the GPU
    idle only between its own steps, so idle stays under the steps' own time."""
    make_checkpoint(tmp_path, preset="small", seed=5, emb4=True)
    eng = engine.load(tmp_path, device="cuda", max_context=512, max_num_seqs=4)
    try:
        before = eng.runner.clock.times()
        eng.generate([2] + list(range(30, 90)), SamplingParams(max_tokens=40, stop_ids=()))
        after = eng.runner.clock.times()
        st = eng.stats()
        timed = after.timed_steps - before.timed_steps
        assert timed >= 39
        busy = after.busy_ms - before.busy_ms
        assert 0.01 < busy / timed < 1000.0  # a step of the small preset: well within
        idle = after.idle_ms - before.idle_ms
        assert 0.0 <= idle < busy
        assert 0.0 <= after.plain_idle_ms - before.plain_idle_ms <= idle + 1e-6
        assert 0 <= after.starved_steps - before.starved_steps <= timed
        assert st.decode_busy_ms == after.busy_ms and st.starved_steps == after.starved_steps
        assert st.late_timed_steps <= st.starved_steps and min(st.late_host_ms) >= 0.0
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_steps_with_arrivals_never_make_the_host_wait_for_the_gpu(tmp_path) -> None:
    """Requests arriving while others decode (their prompt ids copied, blocks granted, a pass
    on the side stream, a sampled request's generator) and finishing: no step synchronises a
    stream or copies from pageable memory (PyTorch's sync debug mode raises on both, and a
    failed step hands its error to the sinks). Such a wait leaves the GPU idle until the host
    has launched the next step. `collect`'s event wait is the one wait, and is not counted."""
    make_checkpoint(tmp_path, preset="small", seed=5, emb4=True)
    eng = engine.load(tmp_path, device="cuda", max_context=512, max_num_seqs=4)
    errors: list[BaseException] = []

    def sink(_seq, out) -> None:
        if out.error is not None:
            errors.append(out.error)

    def prompt(j: int) -> list[int]:
        return [2] + [(13 * i + 5 * j) % 700 + 30 for i in range(40 + 9 * j)]

    greedy = SamplingParams(max_tokens=24, stop_ids=())
    sampled = SamplingParams(max_tokens=24, stop_ids=(), temperature=0.8, seed=3)
    try:
        eng.add_request(prompt(0), greedy, sink)
        for _ in range(4):  # the first request in and decoding
            eng.step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eng.add_request(prompt(1), greedy, sink)
            for _ in range(3):
                eng.step()
            eng.add_request(prompt(2), sampled, sink)
            while eng.step():
                pass
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert not errors, errors[0]
    finally:
        eng.close()


def test_the_servers_collector_pauses_are_timed_and_the_heap_can_be_frozen() -> None:
    """GcWatch times real collections through gc.callbacks (a full one counted apart) while
    installed, and /metrics shows them; `freeze` exempts what is alive (undone here, so the
    test process frees its own objects again)."""
    import gc

    from bench.sweep.telemetry import parse_metrics
    from engine.server.gc_watch import freeze
    from engine.server.metrics import Metrics

    metrics = Metrics("m")
    metrics.gc.install()
    try:
        gc.collect(0)
        gc.collect()
    finally:
        metrics.gc.uninstall()
    gc.collect()  # not counted: uninstalled
    t = metrics.gc.totals()
    assert t.collections == 2 and t.full_collections == 1
    assert 0 < t.max_pause_s <= t.seconds
    page = metrics.prometheus()
    assert "gpurig_engine_python_gc_full_collections_total" in page
    got = parse_metrics(page)
    assert got["gc_collections"] == 2 and got["gc_s"] == round(t.seconds, 6)
    metrics.reset()
    assert metrics.gc.totals().collections == 0
    try:
        assert freeze() > 1000 and gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
