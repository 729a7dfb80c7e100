"""bench/engine/step_ablation.py without graphs (the CPU: Triton's interpreter): the stand-ins
are checked in the engine's own fused step: every kind's stand-ins replace functions
the step really calls (its logits change, their shape does not), and leaving restores the step."""

from __future__ import annotations

import pytest
import torch

import engine
from bench.engine import step_ablation
from engine.checkpoint_maker import make_checkpoint
from engine.options import EngineOptions


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("ablation") / "tiny"
    make_checkpoint(path, preset="tiny", seed=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the interpreter
    eng = engine.load(path, device=device, max_context=64, dtype=torch.float32,
                      options=EngineOptions(fast="force", cuda_graph=False), max_num_seqs=2,
                      warm_up=False)  # fmt: skip
    yield eng
    eng.close()


def _step(eng) -> torch.Tensor:
    pool, model = eng.pool, eng.model
    slot = pool.blocks.open_slot()
    try:
        pool.apply((slot,), (pool.blocks.grow(slot, 9),))
        ids = torch.tensor([2, 40, 41, 42, 43, 44, 45, 46], device=model.device)
        model.prefill_chunk(ids[:-1], 0, pool.view(slot), False)
        return eng.runner.step(ids[-1:], torch.tensor([7], device=model.device),
                               torch.tensor([slot], dtype=torch.int32,
                                            device=model.device)).clone()  # fmt: skip
    finally:
        pool.blocks.close_slot(slot)


# an ablated step computes on the stand-ins' uninitialised tensors (no kernel may fill them):
# the interpreter's arithmetic on them may overflow, which says nothing here
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_each_kind_is_taken_out_of_the_step_and_put_back(tiny_engine):
    whole = _step(tiny_engine)
    for kind in step_ablation.KINDS:
        with step_ablation.ablated(kind):
            without = _step(tiny_engine)
        assert without.shape == whole.shape, kind
        assert not torch.equal(without, whole), f"{kind}: the step did not change"
    assert torch.equal(_step(tiny_engine), whole)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="one of products"):
        step_ablation.stand_ins("norms")
