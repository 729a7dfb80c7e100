"""EngineOptions.defer_outputs: a step's tokens reach their sinks after the next step is
launched. The tokens, their order and every ending must be those of the default."""

from __future__ import annotations

import threading

import pytest

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.options import EngineOptions
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_checkpoint(path, preset="tiny", seed=4)
    return path


def _overlapping(path, defer: bool) -> dict[int, list[int]]:
    """Tokens of four overlapping requests of different lengths, then of one streamed alone."""
    eng = engine.load(path, device="cpu", max_context=256, max_num_seqs=4,
                      options=EngineOptions(defer_outputs=defer))  # fmt: skip
    got: dict[int, list[int]] = {}
    try:

        def run(j: int) -> None:
            prompt = [2] + [(7 * i + 3 * j) % 400 + 20 for i in range(8 + 5 * j)]
            got[j] = eng.generate(prompt, SamplingParams(max_tokens=6 + 3 * j, stop_ids=()))

        threads = [threading.Thread(target=run, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # streamed alone: with nothing else in flight its chunks still come, all, in order
        got[9] = list(eng.stream([2, 30, 31, 32], SamplingParams(max_tokens=5, stop_ids=())))
        while eng.step():  # the look-ahead row and the ended slot's bookkeeping
            pass
    finally:
        eng.close()
    return got


def test_deferred_outputs_change_no_token(tiny) -> None:
    plain, deferred = _overlapping(tiny, False), _overlapping(tiny, True)
    assert deferred == plain
    assert [len(plain[j]) for j in range(4)] == [6, 9, 12, 15] and len(plain[9]) == 5
