"""The sweep's load, SLO, interval, search, workload and compare logic, without servers (fast).

Checked: arrival gaps have vLLM's gamma law (mean 1/rate, CV 1/sqrt(burstiness)) and are
seeded; goodput follows vLLM's per-request rule while a cell's pass uses percentiles with
failures as infinitely slow; the t interval matches the textbook; the search doubles, then
bisects to the last passing level, and replays the same way from cells on disk; prompts of a
shared-prefix group share exactly the prefix; dataset files of both kinds are read; a compare
marks a difference only where the repeats' intervals part.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from bench.sweep.arrivals import arrival_times, rate_of
from bench.sweep.ci import mean_ci, overlap
from bench.sweep.compare import compare_rows
from bench.sweep.models import (
    CellKey,
    CellRecord,
    RequestResult,
    SearchSpec,
    SweepConfig,
    TargetCell,
)
from bench.sweep.prompts import MEASURED, pool_ids
from bench.sweep.search import answer, next_level
from bench.sweep.slo import evaluate, is_good
from bench.sweep.workload import cell_jobs, read_dataset


def test_arrivals_are_seeded_gamma_with_the_asked_rate_and_burstiness() -> None:
    a = arrival_times(20001, 5.0, 1.0, [1, 2])
    assert a == arrival_times(20001, 5.0, 1.0, [1, 2]) and a[0] == 0.0
    assert a != arrival_times(20001, 5.0, 1.0, [1, 3])
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.2, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # Poisson: CV 1
    regular = np.diff(arrival_times(20001, 5.0, 16.0, [1, 2]))
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.25, rel=0.05)
    assert rate_of(a) == pytest.approx(5.0, rel=0.03)
    assert rate_of([0.0]) is None


def _req(ttft: float, tpot: float, e2e: float, error: str | None = None) -> RequestResult:
    return RequestResult(index=0, prompt_sha="x", input_tokens=8, output_tokens=5,
                         ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, itl_ms=[tpot] * 4,
                         error=error)  # fmt: skip


def test_goodput_per_request_and_the_cell_pass_by_percentile() -> None:
    slo = {"ttft_p50_ms": 100.0, "tpot_p50_ms": 20.0}
    reqs = [_req(50, 10, 90), _req(150, 10, 190), _req(60, 30, 180), _req(40, 5, 60)]
    assert [is_good(r, slo) for r in reqs] == [True, False, False, True]
    out = evaluate(reqs, 2.0, slo)
    assert out["goodput_req_s"] == 1.0 and out["slo_share"] == 0.5
    assert out["slo_values"]["ttft_p50_ms"] == 55.0 and out["slo_met"] is True
    # a failed request counts as infinitely slow: half the cell failing fails a p50 SLO
    failing = evaluate([*reqs[:2], _req(0, 0, 0, "boom"), _req(0, 0, 0, "boom")], 2.0, slo)
    assert failing["slo_met"] is False and failing["slo_values"]["ttft_p50_ms"] is None
    assert evaluate(reqs, 2.0, {"itl_p99_ms": 25.0})["slo_met"] is False
    assert evaluate(reqs, 2.0, {"e2e_p99_ms": 500.0})["slo_met"] is True


def test_mean_and_95_interval_and_overlap() -> None:
    xs = [10.0, 12.0, 11.0, 13.0]
    mean, half = mean_ci(xs)
    assert mean == 11.5
    assert half == pytest.approx(3.182 * statistics.stdev(xs) / math.sqrt(4), rel=1e-3)
    assert mean_ci([5.0]) == (5.0, None) and mean_ci([None]) == (None, None)
    assert overlap((10, 1), (11.5, 1)) and not overlap((10, 1), (12.5, 1))
    assert overlap((10, None), (100, 1))  # no interval, no difference claimed


def _levels_until_done(spec: SearchSpec, knee: float) -> list[float]:
    levels: dict[float, bool] = {}
    order = []
    while (x := next_level(spec, levels)) is not None:
        order.append(x)
        levels[x] = x <= knee
    return order


def test_search_doubles_then_bisects_to_the_knee() -> None:
    spec = SearchSpec(axis="concurrency", start=1, max=64)
    assert _levels_until_done(spec, 5) == [1, 2, 4, 8, 6, 5]
    assert _levels_until_done(spec, 0) == [1]  # even the start fails
    assert _levels_until_done(spec, 1000) == [1, 2, 4, 8, 16, 32, 64]  # capped
    rate = SearchSpec(axis="rate", start=1, max=100, precision=0.05)
    order = _levels_until_done(rate, 6.3)
    passes = [x for x in order if x <= 6.3]
    fails = [x for x in order if x > 6.3]
    assert max(passes) <= 6.3 < min(fails) and (min(fails) - max(passes)) / min(fails) <= 0.05


def _cell(c: int, r: int, met: bool) -> CellRecord:
    return CellRecord(target="t", input_len=8, concurrency=c, repeat=r, seed=0, driver="builtin",
                      status="ok", started_at="x", slo_met=met, completed=4,
                      slo_values={"ttft_p99_ms": 10.0 if met else 90.0})  # fmt: skip


def test_search_answer_replayed_from_cells_needs_every_repeat() -> None:
    spec = SearchSpec(axis="concurrency", start=1, max=16)
    cells = [_cell(1, 0, True), _cell(1, 1, True), _cell(2, 0, True), _cell(2, 1, True),
             _cell(4, 0, True), _cell(4, 1, False), _cell(3, 0, True), _cell(3, 1, True)]  # fmt: skip
    a = answer(spec, "t", 8, cells, repeats=2)
    assert a.answer == 3 and a.first_fail == 4 and a.done and a.cells == 8
    assert [(lv.load, lv.passed) for lv in a.levels] == [(1, True), (2, True), (4, False),
                                                         (3, True)]  # fmt: skip
    assert a.levels[2].values == {"ttft_p99_ms": 90.0}  # the worst repeat
    partial = answer(spec, "t", 8, cells[:5], repeats=2)  # level 4 has one repeat so far
    assert partial.answer == 2 and not partial.done


def _config(**workload) -> SweepConfig:
    return SweepConfig(sweep_id="s", out_dir="d", created="c", seed=3,
                       targets=[{"label": "a", "base_url": "http://h/v1"}], input_lens=[32],
                       output_len=8, concurrency=[2, 4], repeats=2, prompts_per_cell=6,
                       workload=workload)  # fmt: skip


def test_shared_prefix_groups_multi_turn_and_drawn_lengths() -> None:
    pool = pool_ids(512, [0, 1, 2])
    config = _config(prefix_len=20, prefix_groups=2)
    key = CellKey(target="a", input_len=32, concurrency=2, repeat=0)
    jobs = cell_jobs(config, key, pool, None, False, MEASURED)
    assert [j.group for j in jobs] == [0, 1, 0, 1, 0, 1]
    heads = {j.group: set() for j in jobs}
    for j in jobs:
        assert len(j.parts[0]) == 32
        heads[j.group].add(tuple(j.parts[0][:20]))
    assert all(len(h) == 1 for h in heads.values()) and heads[0] != heads[1]
    assert len({tuple(j.parts[0][20:]) for j in jobs}) == 6  # suffixes differ
    # the next load level gets prefixes of its own (no cache carried across cells)
    other = cell_jobs(config, key.model_copy(update={"concurrency": 4}), pool, None, False, 0)
    assert tuple(other[0].parts[0][:20]) not in heads[0] | heads[1]
    # the same jobs whoever asks (every target), and different per repeat
    assert cell_jobs(config, key, pool, None, False, 0)[3].parts == jobs[3].parts
    assert cell_jobs(config, key.model_copy(update={"repeat": 1}), pool, None, False,
                     0)[3].parts != jobs[3].parts  # fmt: skip

    turns = cell_jobs(_config(turns=3), key, pool, None, False, MEASURED)
    assert all(len(j.parts) == 3 and len({tuple(p) for p in j.parts}) == 3 for j in turns)
    assert _config(turns=3).requests_in_cell(2) == 18

    drawn = cell_jobs(_config(range_ratio=0.5), key, pool, None, False, MEASURED)
    lens = [len(j.parts[0]) for j in drawn]
    assert all(16 <= n <= 48 for n in lens) and len(set(lens)) > 1
    assert all(4 <= j.output_len <= 12 for j in drawn)
    text = cell_jobs(_config(), key, None, None, False, MEASURED)  # no vocabulary known
    assert all(isinstance(j.parts[0], str) and len(j.parts[0].split()) == 24 for j in text)


def test_dataset_files_sharegpt_and_jsonl(tmp_path: Path) -> None:
    share = tmp_path / "share.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Hi there"},
                           {"from": "gpt", "value": "one two three four five six"}]},
        {"conversations": [{"from": "gpt", "value": "orphan"}]},
    ]))  # fmt: skip
    assert read_dataset(share) == [("Hi there", None, "one two three four five six")]
    lines = tmp_path / "d.jsonl"
    lines.write_text('{"prompt": "a b", "output_len": 7}\n\n{"prompt": "c"}\n')
    assert read_dataset(lines) == [("a b", 7, None), ("c", None, None)]
    config = SweepConfig(sweep_id="s", out_dir="d", created="c", seed=0, repeats=1,
                         targets=[{"label": "a", "base_url": "http://h/v1"}], input_lens=[0],
                         output_len=8, concurrency=[1], prompts_per_cell=3,
                         workload={"dataset": str(lines)})  # fmt: skip
    jobs = cell_jobs(config, CellKey(target="a", input_len=0, concurrency=1, repeat=0), None,
                     None, True, MEASURED)  # fmt: skip
    assert sorted(j.parts[0] for j in jobs[:2]) == ["a b", "c"] and len(jobs) == 3
    assert {j.output_len for j in jobs if j.parts[0] == "a b"} == {7}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_dataset(bad)


def _tc(values: list[float]) -> TargetCell:
    mean, half = mean_ci(values)
    return TargetCell(target="t", status="ok", repeats_ok=len(values),
                      output_tok_s=statistics.median(values), mean={"output_tok_s": mean},
                      ci95={"output_tok_s": half})  # fmt: skip


def test_compare_marks_only_differences_the_repeats_support() -> None:
    key = ("t", 64, 1, None)
    base = {key: _tc([100, 101, 99]), ("t", 64, 4, None): _tc([300, 310, 290])}
    faster = {key: _tc([150, 151, 149]), ("t", 64, 4, None): _tc([305, 290, 320])}
    rows = [r for r in compare_rows(["a", "b"], [base, faster]) if r.figure == "output_tok_s"]
    by_conc = {r.concurrency: r.values[1] for r in rows}
    assert by_conc[1].ratio == pytest.approx(1.5) and by_conc[1].differs
    assert by_conc[4].ratio == pytest.approx(305 / 300, rel=1e-3) and not by_conc[4].differs
    single = compare_rows(["a", "b"], [{key: _tc([100])}, {key: _tc([200])}])
    assert not single[0].values[1].differs  # one repeat: no interval, no claim
    missing = compare_rows(["a", "b"], [base, {key: faster[key]}])
    assert {r.concurrency for r in missing} == {1}
