"""The patch engine and the clamp's behaviour, on real vLLM files (tests/data/turing_patch)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from patch_support import (
    BUDGET,
    SPEC,
    STOCK_0_22_0,
    STOCK_0_33_0,
    T4_SMEM_OPTIN,
    run_tile_path,
    smem_need,
)

from patches.engine import (
    PatchLayoutError,
    check_layout,
    classify,
    insert_block,
    record_hash,
    remove_block,
    unified_diff,
)


@pytest.fixture(scope="module")
def stock() -> str:
    path, digest, size = STOCK_0_33_0
    data = path.read_bytes()
    assert (record_hash(data), len(data)) == (digest, size)  # really the wheel's bytes
    return data.decode()


@pytest.fixture(scope="module")
def patched(stock: str) -> str:
    return insert_block(SPEC, stock)


def test_stock_file_is_stock(stock: str) -> None:
    c = classify(SPEC, stock.encode(), STOCK_0_33_0[1])
    assert (c.state, c.occurrences) == ("stock", 0)


def test_insert_gives_patched_that_compiles(patched: str, stock: str) -> None:
    compile(patched, SPEC.target, "exec")
    c = classify(SPEC, patched.encode(), STOCK_0_33_0[1])
    assert (c.state, c.occurrences) == ("patched", 1)
    assert patched.count(SPEC.begin_marker) == 1
    # the block sits right before `grid: tuple[Any, ...]`, after the use_td clamp
    lines = patched.splitlines()
    grid = lines.index(SPEC.insert_before)
    assert lines[grid - 2] == SPEC.end_marker and lines[grid - 1] == ""
    assert lines.index(SPEC.anchors[2].line) < lines.index(SPEC.begin_marker) < grid
    assert len(patched) == len(stock) + len(SPEC.block)


def test_remove_restores_stock_bytes(patched: str, stock: str) -> None:
    assert remove_block(SPEC, patched) == stock
    assert remove_block(SPEC, stock) is None


def test_insert_twice_refused(patched: str) -> None:
    with pytest.raises(PatchLayoutError, match="already holds"):
        insert_block(SPEC, patched)


def test_old_layout_0_22_0_refused() -> None:
    path, digest, _ = STOCK_0_22_0
    text = path.read_text()
    assert record_hash(text.encode()) == digest
    with pytest.raises(PatchLayoutError) as err:
        insert_block(SPEC, text)
    assert any("launch_kwargs" in p and "missing" in p for p in err.value.problems)
    assert len(err.value.problems) == 3


def test_duplicated_anchor_refused(stock: str) -> None:
    doubled = stock.replace(
        SPEC.insert_before + "\n", SPEC.insert_before + "\n" + SPEC.insert_before + "\n"
    )
    with pytest.raises(PatchLayoutError, match="found 2 times"):
        check_layout(SPEC, doubled)


def test_anchors_out_of_order_refused(stock: str) -> None:
    # move the use_td clamp line after `grid: ...`: each anchor still occurs once
    line = SPEC.anchors[2].line + "\n"
    moved = stock.replace(line, "", 1).replace(
        SPEC.insert_before + "\n", SPEC.insert_before + "\n" + line, 1
    )
    with pytest.raises(PatchLayoutError, match="out of order"):
        check_layout(SPEC, moved)


@pytest.mark.parametrize(
    ("edit", "detail"),
    [
        (lambda t: t.replace("_smem_budget = (", "_smem_budget = 2 * (", 1), "was edited"),
        (lambda t: t.replace(SPEC.block, SPEC.block * 2), "occurs 2 times"),
        (lambda t: t.replace(f"{SPEC.id} v1", f"{SPEC.id} v0"), "holds turing-smem-clamp v0"),
        (lambda t: t.replace("import torch\n", "import torch  # edited\n", 1), "was edited"),
    ],
)
def test_modified_states(patched: str, edit, detail: str) -> None:
    changed = edit(patched)
    assert changed != patched
    c = classify(SPEC, changed.encode(), STOCK_0_33_0[1])
    assert c.state == "modified"
    assert detail in c.detail


def test_edited_stock_file_is_modified(stock: str) -> None:
    edited = stock.replace("def _get_tile_size(", "def _get_tile_size( ", 1)
    c = classify(SPEC, edited.encode(), STOCK_0_33_0[1])
    assert (c.state, c.occurrences) == ("modified", 0)
    assert "no gpurig marker" in c.detail


def test_upstream_diff_applies_with_git(stock: str, tmp_path) -> None:
    diff = unified_diff(stock, insert_block(SPEC, stock, markers=False), SPEC.target)
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert added and not any("gpurig" in ln for ln in added)
    assert any("launch_num_stages = 1" in ln for ln in added)
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    target = tmp_path / SPEC.target
    target.parent.mkdir(parents=True)
    target.write_text(stock)
    (tmp_path / "up.diff").write_text(diff)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", "-p1", "up.diff"], cwd=tmp_path, check=True)
    assert target.read_text() == insert_block(SPEC, stock, markers=False)


# --- the patched code does the right thing ------------------------------------------------


def test_stock_tiles_overflow_turing_at_head_512(patched: str) -> None:
    """Without the block, head 512 asks for more than the T4's 64 KiB: the bug being fixed."""
    r = run_tile_path(patched, (7, 5), 512, with_block=False)
    assert r["prefill"] == 32 and r["stages"] is None
    assert smem_need(16, r["prefill"], 512, 2) == 81920 > T4_SMEM_OPTIN


def test_turing_head_512_fp16_fits_with_one_stage(patched: str) -> None:
    r = run_tile_path(patched, (7, 5), 512, "float16")
    assert r["esz"] == 2
    assert (r["prefill"], r["decode"], r["stages"]) == (16, 16, 1)
    for tile in (r["prefill"], r["decode"]):
        assert smem_need(16, tile, 512, 2) == 49152 <= BUDGET
    assert len(r["asked"]) == 1 and str(r["asked"][0]) == "cpu"  # asked about q's device


def test_turing_head_512_sliding_window_layer(patched: str) -> None:
    r = run_tile_path(patched, (7, 5), 512, sliding_window_val=512)
    assert (r["prefill"], r["decode"], r["stages"]) == (16, 16, 1)


def test_turing_head_256_left_as_it_was(patched: str) -> None:
    stock = run_tile_path(patched, (7, 5), 256, with_block=False)
    r = run_tile_path(patched, (7, 5), 256)
    assert (r["prefill"], r["decode"], r["stages"]) == (stock["prefill"], stock["decode"], None)
    assert (r["prefill"], r["decode"]) == (32, 16)
    assert smem_need(16, 32, 256, 2) <= BUDGET


def test_turing_budget_follows_the_reported_limit(patched: str) -> None:
    # a device allowing 128 KiB per block: head 512 fp16 already fits, nothing changes
    r = run_tile_path(patched, (7, 5), 512, smem_optin=131072)
    assert (r["prefill"], r["decode"], r["stages"]) == (32, 16, None)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), None])
def test_ampere_hopper_and_unknown_untouched(patched: str, capability) -> None:
    stock = run_tile_path(patched, capability, 512, with_block=False)
    r = run_tile_path(patched, capability, 512)
    assert (r["prefill"], r["decode"], r["stages"]) == (stock["prefill"], stock["decode"], None)
    assert r["prefill"] == 32
    assert r["asked"] == []  # never queries device properties


def test_turing_fp32_halves_down_to_the_minimum(patched: str) -> None:
    r = run_tile_path(patched, (7, 5), 512, "float32")
    assert (r["prefill"], r["decode"], r["stages"]) == (16, 16, 1)
