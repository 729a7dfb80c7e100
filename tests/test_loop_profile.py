"""lab/engine/loop_profile.py's reading of a profiler trace: graph replays told from the loop's
own launches by their correlation ids, periods and what ran between, prompt passes left out."""

from __future__ import annotations

from lab.engine.loop_profile import EAGER_PASS, replays_and_between


def _launch(corr: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": corr}}


def _kernel(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _replay(corr: int, start: float, kernels: int, each: float = 10.0) -> list[dict]:
    return [_kernel(f"k{i}", start + i * each, each, corr) for i in range(kernels)]


def test_periods_spans_and_the_ops_between_decode_replays() -> None:
    events = [_launch(c) for c in (1, 2, 3, 9)]
    events += _replay(1, 0.0, 4) + _replay(2, 100.0, 4) + _replay(3, 210.0, 4)
    events += [_kernel("void at::native::reduce_kernel<512>(x)", 45.0, 5.0, 50),
               _kernel("Memcpy DtoH", 52.0, 2.0, 51, cat="gpu_memcpy"),
               _kernel("void at::native::reduce_kernel<512>(x)", 150.0, 7.0, 52)]  # fmt: skip
    events += _replay(9, 400.0, 12)  # a prompt pass's graph (another kernel count)
    got = replays_and_between(events)
    assert got["replays"] == 4 and got["replays_by_kernel_count"] == {4: 3, 12: 1}
    assert got["decode_kernels"] == 4 and got["decode_periods"] == 2  # 3->pass is not a period
    assert got["period_us_p50"] == 105.0  # 100 and 110
    assert got["span_us_p50"] == 40.0
    assert got["between_us_p50"] == 65.0  # 60 and 70
    assert got["busy_between_us_p50"] == 7.0  # 7 and 7
    ops = {r["op"]: r for r in got["between_ops"]}
    assert ops["void at::native::reduce_kernel"]["per_step"] == 1.0
    assert ops["void at::native::reduce_kernel"]["total_per_step_us"] == 6.0
    assert ops["Memcpy DtoH"]["per_step"] == 0.5


def test_an_eagerly_read_prompt_between_two_replays_is_not_a_decode_period() -> None:
    events = [_launch(1), _launch(2)] + _replay(1, 0.0, 3) + _replay(2, 5000.0, 3)
    events += [_kernel("gemm", 100.0 + i, 1.0, 100 + i) for i in range(EAGER_PASS + 1)]
    got = replays_and_between(events)
    assert got["decode_periods"] == 0 and got["period_us_p50"] is None


def test_a_trace_without_replays_says_so() -> None:
    assert "error" in replays_and_between([_kernel("k", 0.0, 1.0, 7)])
