"""The batched fused decode step (engine/fast/batch_decode.py) against the reference, on the real
Triton kernels (the GPU, or the CPU interpreter in CI), on a tiny fp32 model.

Two checks: one batched step's logits equal each row's reference decode_step over the same pool
(sequences of different lengths, one past its sliding window, a padding row); and a whole
scheduler run on the fast path gives every request the tokens it gets alone.
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.fast import batch_decode
from engine.options import EngineOptions
from engine.sampling import SamplingParams

CTX = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch_decode") / "tiny"
    make_checkpoint(path, preset="tiny", seed=5)
    return path


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [(5 * i + salt) % 300 + 20 for i in range(n - 1)]


def test_batched_step_equals_the_reference_rows(checkpoint, device):
    """4 rows, so the residual+norm before each per-layer gate is made in that GEMV's prologue,
    one grid row per batch row (PROLOGUE_ROWS)."""
    opts = EngineOptions(fast="force", cuda_graph=False)
    eng = engine.load(checkpoint, device=device, max_context=CTX, dtype=torch.float32,
                      options=opts, max_num_seqs=4, warm_up=False)  # fmt: skip
    try:
        runner = eng.runner
        assert runner.batched
        pool, model = eng.pool, eng.model  # the pool driven by hand: no request in the engine
        lengths = [3, 20, 7]  # 20 > the tiny preset's sliding window of 16
        slots = []
        for i, n in enumerate(lengths):
            slot = pool.blocks.open_slot()
            ids = torch.tensor(_prompt(n, i), device=model.device)
            pool.apply((slot,), (pool.blocks.grow(slot, n + 1),))
            model.prefill_chunk(ids[:-1], 0, pool.view(slot), False)
            slots.append(slot)
        tokens = torch.tensor([_prompt(n, i)[-1] for i, n in enumerate(lengths)] + [0],
                              device=model.device)  # fmt: skip
        positions = torch.tensor([n - 1 for n in lengths] + [0], device=model.device)
        slot_t = torch.tensor([*slots, pool.pad_slot], dtype=torch.int32, device=model.device)
        batched = runner.step(tokens, positions, slot_t)[:3].clone()
        reference = torch.cat(
            [
                model.decode_step(tokens[b : b + 1], positions[b : b + 1], pool.view(slots[b]))
                for b in range(3)
            ]
        )
        torch.testing.assert_close(batched, reference, rtol=1e-4, atol=1e-4)
        assert torch.equal(batched.argmax(-1), reference.argmax(-1))
    finally:
        eng.close()


def test_fast_scheduler_tokens_equal_alone(checkpoint, device):
    """Three requests decoding together on the fast path each get the tokens they get alone
    on the reference path (fp32: the fused step equals the reference step, tested above, so
    "alone" is read where it is cheap on the CPU interpreter)."""
    reference = engine.load(checkpoint, device=device, max_context=CTX, dtype=torch.float32,
                            options=EngineOptions(fast="off"))  # fmt: skip
    multi = engine.load(checkpoint, device=device, max_context=CTX, dtype=torch.float32,
                        options=EngineOptions(fast="force"), max_num_seqs=4)  # fmt: skip
    try:
        specs = [(4, 3), (20, 2), (9, 3)]
        prompts = [_prompt(n, 10 + i) for i, (n, _) in enumerate(specs)]
        alone = [
            reference.generate(p, SamplingParams(max_tokens=m, stop_ids=()))
            for p, (_, m) in zip(prompts, specs, strict=True)
        ]
        gens = [
            multi.stream(p, SamplingParams(max_tokens=m, stop_ids=()))
            for p, (_, m) in zip(prompts, specs, strict=True)
        ]
        assert [list(g) for g in gens] == alone
        st = multi.scheduler.stats()
        assert st.step_rows > st.steps  # some steps carried several rows
    finally:
        multi.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tail_equals_pytorch_ops(checkpoint, device, interpreted, dtype, monkeypatch):
    """The step's soft-cap and greedy ids by the two-launch tail (engine/kernels/greedy_tail.py)
    against PyTorch's ops on the same rows: the same logits (exactly on the GPU, within the
    interpreter's exp-built tanh and truncating casts on the CPU) and each row's first
    largest."""
    eng = engine.load(checkpoint, device=device, max_context=CTX, dtype=dtype,
                      options=EngineOptions(fast="force", cuda_graph=False), max_num_seqs=4,
                      warm_up=False)  # fmt: skip
    try:
        decoder = eng.runner._step.__self__
        assert eng.model.cfg.final_logit_softcapping
        pool, dev = eng.pool, eng.model.device
        slots = [pool.blocks.open_slot() for _ in range(2)]
        pool.apply(tuple(slots), tuple(pool.blocks.grow(s, 4) for s in slots))
        tokens = torch.tensor([7, 300, 0], device=dev)
        positions = torch.tensor([0, 0, 0], device=dev)
        slot_t = torch.tensor([*slots, pool.pad_slot], dtype=torch.int32, device=dev)
        ids = torch.full((3,), -1, dtype=torch.int64, device=dev)
        fused = decoder.step(tokens, positions, slot_t, ids=ids).clone()
        monkeypatch.setattr(batch_decode, "cap_and_pick", _torch_tail)
        plain_ids = torch.full((3,), -1, dtype=torch.int64, device=dev)
        plain = decoder.step(tokens, positions, slot_t, ids=plain_ids)
        assert torch.equal(ids, fused.argmax(-1))
        if interpreted:
            atol = 1e-5 if dtype == torch.float32 else 0.4
            torch.testing.assert_close(fused.float(), plain.float(), rtol=0, atol=atol)
        else:
            assert torch.equal(fused, plain)
            assert torch.equal(ids, plain_ids)
    finally:
        eng.close()


def _torch_tail(logits: torch.Tensor, cap: float | None, ids: torch.Tensor | None) -> torch.Tensor:
    """The tail by PyTorch's ops: the reference the two-launch kernels are held to."""
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if ids is not None:
        torch.argmax(logits, dim=-1, out=ids)
    return logits
