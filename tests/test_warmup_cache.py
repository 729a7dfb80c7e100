"""The marker that lets a warm start skip the compile pass (engine/warmup_cache.py): written
after a warm-up, trusted only for the same fingerprint while Triton's cache holds every entry it
lists. The skip itself only runs on a GPU (the compile pass exists there only)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import engine
from engine import warmup_cache
from engine.checkpoint_maker import make_checkpoint
from engine.options import EngineOptions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup_cache") / "tiny"
    make_checkpoint(path, preset="tiny", seed=2)
    return path


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    for name in ("AAA", "BBB", "CCC"):
        (cache / name).mkdir(parents=True)
    monkeypatch.setattr(warmup_cache, "triton_cache_dir", lambda: cache)
    return cache


def _engine(checkpoint, **kw):
    return engine.load(checkpoint, device="cpu", max_context=128, warm_up=False, **kw)


def test_the_fingerprint_follows_what_decides_the_compiles(checkpoint):
    a, b = _engine(checkpoint), _engine(checkpoint)
    other = _engine(checkpoint, max_num_seqs=4)
    off = _engine(checkpoint, options=EngineOptions(pass_graphs=False))
    threads = _engine(checkpoint, options=EngineOptions(compile_threads=3))
    try:
        lengths = (1, 37)
        same = warmup_cache.fingerprint(a, lengths)
        assert same == warmup_cache.fingerprint(b, lengths)
        assert same == warmup_cache.fingerprint(threads, lengths)  # threads compile, not decide
        plan = b.batching  # a pool of other size (the memory left at load): the same kernels
        b.batching = dataclasses.replace(plan, budget_bytes=plan.budget_bytes * 2, geometry=(
            dataclasses.replace(plan.geometry, num_blocks=plan.geometry.num_blocks * 2)))  # fmt: skip
        assert same == warmup_cache.fingerprint(b, lengths)
        assert same != warmup_cache.fingerprint(a, (1, 38))
        assert same != warmup_cache.fingerprint(other, lengths)
        assert same != warmup_cache.fingerprint(off, lengths)
    finally:
        for e in (a, b, other, off, threads):
            e.close()


def test_a_marker_is_trusted_only_while_the_cache_holds_its_entries(tmp_path, triton_cache):
    markers = tmp_path / "kernels"
    assert not warmup_cache.kernels_cached(markers, "f" * 64)  # none yet
    warmup_cache.record(markers, "f" * 64)
    (written,) = markers.glob("warmup-*.json")
    assert json.loads(written.read_text())["entries"] == ["AAA", "BBB", "CCC"]
    assert not list(markers.glob(".warmup-*"))  # no temporary left behind
    assert warmup_cache.kernels_cached(markers, "f" * 64)
    assert not warmup_cache.kernels_cached(markers, "e" * 64)  # another engine
    (triton_cache / "BBB").rmdir()  # a cache cleared (in part) since
    assert not warmup_cache.kernels_cached(markers, "f" * 64)


def test_a_damaged_marker_or_an_unwritable_directory_runs_the_pass(tmp_path, triton_cache):
    markers = tmp_path / "kernels"
    warmup_cache.record(markers, "f" * 64)
    (written,) = markers.glob("warmup-*.json")
    written.write_text("{not json")
    assert not warmup_cache.kernels_cached(markers, "f" * 64)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    warmup_cache.record(blocked / "kernels", "f" * 64)  # cannot be made: skipped, no error
    assert not warmup_cache.kernels_cached(blocked / "kernels", "f" * 64)


def test_the_reason_a_start_compiles_names_what_changed(tmp_path, triton_cache):
    markers = tmp_path / "kernels"
    before = {"sources": "s1", "options": "o1", "lengths": [1, 37]}
    assert warmup_cache.cache_miss(markers, "f" * 64, before) == "no earlier warm-up of this engine"
    warmup_cache.record(markers, "f" * 64, before)
    assert warmup_cache.cache_miss(markers, "f" * 64, before) == ""
    after = {**before, "options": "o2", "lengths": [1, 38]}
    why = warmup_cache.cache_miss(markers, "e" * 64, after)
    assert why == "an earlier warm-up differs in lengths, options", why
    (triton_cache / "AAA").rmdir()
    assert (
        warmup_cache.cache_miss(markers, "f" * 64, before) == "1 of 3 Triton cache entries are gone"
    )


def test_the_fingerprint_is_the_same_in_every_process(checkpoint):
    """The model config's repr is hashed: a field built from a set once came out in another order
    per process (string hashes are salted), and a warm start then compiled everything again."""
    import subprocess
    import sys

    code = f"from engine.config import load_config; print(repr(load_config({str(checkpoint)!r})))"
    reprs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout
        for seed in range(6)
    }  # fmt: skip
    assert len(reprs) == 1, reprs
