"""lab.engine.goals on results GPU runs recorded, laid out as goals.sh lays them out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lab.engine import goals

# files GPU runs wrote (e67ed01:bench/results/, kept here as the recorded fixture)
RESULTS = Path(__file__).resolve().parent / "data" / "goals"
COLD = RESULTS / "cold_start_h100_2026-12-07.json"
SWEEP = RESULTS / "sweep_planner_head_h100_2026-12-07.json"
STEPS = RESULTS / "steps_at_depth_h100_2026-12-06.json"


def _folder(tmp_path: Path, cold=COLD, sweep=SWEEP, steps=STEPS) -> Path:
    out = tmp_path / "out"
    (out / "sweep").mkdir(parents=True)
    for src, dst in ((cold, "cold_start.json"), (sweep, "sweep/results.json"),
                     (steps, "steps.json")):  # fmt: skip
        if src is not None:
            shutil.copy(src, out / dst)
    return out


def _by_name(found: list[goals.Goal]) -> dict[str, goals.Goal]:
    return {g.name: g for g in found}


def test_every_goal_judged_from_the_recorded_files(tmp_path: Path) -> None:
    found = _by_name(goals.judge(_folder(tmp_path)))
    sweep = json.loads(SWEEP.read_text())
    cells = {row["concurrency"]: row["targets"][0] for row in sweep["summary"]}
    c16 = cells[16]["mean"]["output_tok_s"]
    assert found["c = 16, tok/s aggregate"].met is (c16 >= 5000)
    assert f"{c16:,.1f}" in found["c = 16, tok/s aggregate"].value
    assert found["c = 1, tok/s per stream"].met is (cells[1]["per_stream_tok_s"] >= 1000)
    steps = {b["rows"]: b["step_us"] for b in json.loads(STEPS.read_text())["buckets"]}
    ratio = steps[8] / steps[1]
    assert found["8-row step / 1-row step"].met is (ratio <= 1.3)
    assert f"{ratio:.2f}x" in found["8-row step / 1-row step"].value
    assert "8-row step / 1-row step, at depth" in found
    runs = json.loads(COLD.read_text())
    cold = next(r["ready_s"] for r in runs if r["variant"] == "cold")
    assert found["cold start, ready"].met is (cold <= 60)
    worst = max(q["ratio"] for r in runs for q in r["requests"])
    assert found["first request / warm TTFT"].value.startswith(f"worst {worst:.2f}x")


def test_a_slow_warm_start_among_several_is_missed(tmp_path: Path) -> None:
    recorded = json.loads(COLD.read_text())
    warm = next(r for r in recorded if r["variant"] == "warm")
    runs = [r for r in recorded if r["variant"] != "warm"]
    runs += [dict(warm, ready_s=s) for s in (10.0, 9.0, 15.5)]
    path = tmp_path / "cold.json"
    path.write_text(json.dumps(runs))
    found = _by_name(goals.judge(_folder(tmp_path, cold=path)))
    assert found["warm start, ready"].met is False  # the worst counts, not the best
    assert "15.5 s" in found["warm start, ready"].value


def test_a_partial_run_lists_the_rest_as_not_measured(tmp_path: Path) -> None:
    found = goals.judge(_folder(tmp_path, sweep=None, steps=None))
    missing = {g.name for g in found if g.met is None}
    assert "c = 8, tok/s aggregate" in missing and "8-row step / 1-row step" in missing
    assert all(g.met is not None for g in found if g.source == "cold_start.json")


def test_the_command_writes_the_table_and_json(tmp_path: Path, capsys) -> None:
    out = _folder(tmp_path)
    assert goals.main([str(out), "--out", str(out / "goals.md"), "--json",
                       str(out / "goals.json")]) == 0  # fmt: skip
    table = (out / "goals.md").read_text()
    assert table == capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in table.splitlines()[0]
    assert len(json.loads((out / "goals.json").read_text())) == table.count("\n| ") - 1


@pytest.mark.parametrize("bad", ["nofolder", "brokenjson", "nosummary"])
def test_bad_input_says_what_to_do(tmp_path: Path, bad: str, capsys) -> None:
    folder = _folder(tmp_path)
    if bad == "nofolder":
        folder = tmp_path / "absent"
    elif bad == "brokenjson":
        (folder / "steps.json").write_text('{"buckets": [')
    else:
        (folder / "sweep" / "results.json").write_text('{"cells": []}')
    assert goals.main([str(folder), "--out", str(tmp_path / "g.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("goals: ") and ("goals.sh" in err or "sweep summary" in err)
    assert not (tmp_path / "g.md").exists()


H200 = RESULTS / "h200_2026-12-07"  # gemm.json and long/ as goals.sh's gemm and long parts


def test_the_product_and_long_prompt_goals_from_the_recorded_h200_files() -> None:
    found = _by_name(goals.judge(H200))
    cells = json.loads((H200 / "gemm.json").read_text())["cells"]
    for m in (8, 16):
        pct = {c["shape"]: c["pct_peak"] for c in cells if c["method"] == "w4_gemm" and c["m"] == m}
        g = found[f"int4 product at {m} rows, % of bandwidth"]
        assert g.met is (min(pct.values()) >= 50)
        worst = min(pct, key=pct.get)
        assert g.value.startswith(f"{pct[worst]:.0f}% ({worst})")
        assert f"of {len(pct)} shapes" in g.value
    summary = json.loads((H200 / "long" / "long_prompt.json").read_text())
    capped = summary["capped"]["prompt_131000"]
    uncapped = summary["uncapped"]["prompt_131000"]
    assert found["131k read under the cap, tok/s"].met is (capped["prompt_tok_per_s"] >= 15000)
    assert found["131k decode under the cap, tok/s"].met is (capped["decode_tok_per_s"] >= 450)
    ratio = found["131k read uncapped / capped"]
    assert ratio.met is (uncapped["prompt_tok_per_s"] >= capped["prompt_tok_per_s"])
    assert ratio.value.startswith(
        f"{uncapped['prompt_tok_per_s'] / capped['prompt_tok_per_s']:.2f}x"
    )
    assert goals.report(H200).device == "NVIDIA H200"  # no sweep: the table's card


def test_a_failed_131k_read_is_missed_with_its_error(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    summary = json.loads((H200 / "long" / "long_prompt.json").read_text())
    summary["capped"]["prompt_131000"] = {"error": "OutOfMemoryError('CUDA out of memory')"}
    (folder / "long").mkdir()
    (folder / "long" / "long_prompt.json").write_text(json.dumps(summary))
    found = _by_name(goals.judge(folder))
    read = found["131k read under the cap, tok/s"]
    assert read.met is False and read.value.startswith("failed: OutOfMemoryError")
    assert found["131k read uncapped / capped"].met is False
    assert found["int4 product at 8 rows, % of bandwidth"].met is None  # no gemm.json here


def test_a_gemm_file_without_its_cells_says_which_part_to_rerun(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "gemm.json").write_text(json.dumps({"cells": [{"m": 8}]}))
    with pytest.raises(goals.GoalsError, match="GOALS_PARTS=gemm"):
        goals.judge(folder)
