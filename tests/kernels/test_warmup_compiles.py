"""On a GPU: after the warm-up (engine/warmup.py) no request compiles a kernel, and the kernels the
parallel compile pass built give the tokens that serially compiled ones give.

Why it matters: every compile a request meets is seconds added to its time to first token (the
first request of a length used to wait 2.3 s on the H200 for 31 ms of work).
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.options import EngineOptions
from engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup_gpu") / "tiny"
    make_checkpoint(path, preset="tiny", seed=9)
    return path


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [(13 * i + salt) % 400 + 20 for i in range(n - 1)]


def _requests(eng) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, stop_ids=())
    out = [eng.generate(_prompt(n, n), params) for n in (5, 100, 333, 1000)]
    pair = [eng.stream(_prompt(n, 1), params) for n in (50, 170)]
    return out + [list(g) for g in pair]


def test_no_request_compiles_after_the_warm_up(checkpoint, tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # cold: compiled here
    fast = engine.load(checkpoint, device="cuda", max_context=2048, max_num_seqs=4,
                       options=EngineOptions(compile_threads=4))  # fmt: skip
    report = fast.warm_up_report
    assert report is not None and report.threads == 4 and report.compile_s > 0
    compiled: list[str] = []

    def count(**kw):
        compiled.append(str(kw.get("repr") or kw.get("fn")))
        return False

    knobs.runtime.jit_post_compile_hook = count
    try:
        got = _requests(fast)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == [], f"compiled after the warm-up: {compiled}"
    # the compile pass ran steps whose kernels did not run: nothing of them may reach an answer
    del fast
    torch.cuda.empty_cache()
    plain = engine.load(checkpoint, device="cuda", max_context=2048, max_num_seqs=4,
                        warm_up=False)  # fmt: skip
    assert _requests(plain) == got


def test_kernels_compiled_in_parallel_give_the_reference_tokens(checkpoint, tmp_path, monkeypatch):
    """fp32 (its own kernels, compiled by their own parallel pass): greedy tokens equal the
    reference path's (torch ops, no Triton)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    fast = engine.load(checkpoint, device="cuda", max_context=2048, max_num_seqs=4,
                       dtype=torch.float32, options=EngineOptions(compile_threads=4))  # fmt: skip
    assert fast.warm_up_report.compile_s > 0
    got = _requests(fast)
    del fast
    torch.cuda.empty_cache()
    reference = engine.load(checkpoint, device="cuda", max_context=2048, max_num_seqs=4,
                            dtype=torch.float32, options=EngineOptions(fast="off"))  # fmt: skip
    assert _requests(reference) == got
