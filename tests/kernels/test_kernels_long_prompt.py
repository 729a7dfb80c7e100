"""On a GPU: what reading a long prompt holds stays within what its plan counted (issue 13)."""

from __future__ import annotations

import pytest
import torch
from engine_support import reset, sequence_cache

import engine
from engine import memory
from engine.checkpoint_maker import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("left_mib", [130, 400])
def test_reading_stays_within_the_plan(tmp_path, monkeypatch, left_mib):
    """The small preset in bf16, a 6,000-token prompt read with `left_mib` MiB said to be left:
    the allocator's peak above what the model and cache hold stays under the plan's count
    (less its safety margin, which covers the decode step's capture)."""
    make_checkpoint(tmp_path, preset="small", seed=1, emb4=True)
    eng = engine.load(tmp_path, device="cuda", max_context=8192)
    prompt = [2] + torch.randint(3, 1000, (5999,)).tolist()
    prefill = eng.runner.reader  # the fused prompt reader the engine uses
    model = eng.model
    monkeypatch.setattr(memory, "available_bytes", lambda device, cap: left_mib * memory.MIB)
    plan = memory.plan_prompt(eng.model, len(prompt), 4096, available=left_mib * memory.MIB)

    def read() -> torch.Tensor:
        """The prompt as the engine reads it: the body in the plan's chunks and score slices
        through the fused reader, the last token through a decode step."""
        ids = torch.tensor(prompt, device="cuda")
        cache, body = sequence_cache(eng), len(prompt) - 1
        reset(cache)
        for start in range(0, body, plan.chunk):
            part = ids[start : min(start + plan.chunk, body)]
            prefill.chunks([(part, start, cache)], plan.score_budget)
        pos = torch.tensor([body], device="cuda")
        return model.decode_step(ids[-1:], pos, cache)[0]

    read()  # warm-up: kernels
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits = read()
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(logits).all()
    assert used <= plan.need_bytes - memory.SAFETY_BYTES + (8 << 20), (used, plan)


@pytest.mark.parametrize("t", [1, 33, 64, 65, 97, 129])
@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_through_memory_efficient_attention_equals_slices(t, d, dtype):
    """A full layer's prefix through torch's memory-efficient kernel (heads folded into rows,
    no mask, no broadcast keys), merged by its log-sum-exp, against the sliced softmax and one
    block, at the chunk lengths whose last row the kernel once got wrong (with a mask and
    broadcast keys)."""
    from engine import ops
    from engine.attention import attend_chunk

    gen = torch.Generator(device="cuda").manual_seed(t + d)
    start, hq = 1000, 8
    q = torch.randn(t, hq, d, device="cuda", generator=gen).to(dtype)
    k_new, v_new = torch.randn(2, t, 1, d, device="cuda", generator=gen).to(dtype)
    ck, cv = torch.randn(2, start, 1, d, device="cuda", generator=gen).to(dtype)
    cp, qp = torch.arange(start, device="cuda"), torch.arange(start, start + t, device="cuda")
    keys, values = torch.cat([ck, k_new]), torch.cat([cv, v_new])
    pos = torch.cat([cp, qp])
    want = ops._attend(q.float(), keys.float(), values.float(), pos, qp, None)
    # the engine's one-block attention in this dtype: how far rounding alone takes it
    base = (ops._attend(q, keys, values, pos, qp, None).float() - want).abs().max()
    budget = hq * 32 * 300
    fused = attend_chunk(q, k_new, v_new, ck, cv, cp, qp, None, budget, prefix_visible=True)
    sliced = attend_chunk(q, k_new, v_new, ck, cv, cp, qp, None, budget, prefix_visible=True,
                          prefix_sdpa=False)  # fmt: skip
    tol = max(5e-4 if dtype == torch.float32 else 2e-2, 1.5 * float(base))
    assert (fused.float() - want).abs().max() < tol, float(base)
    assert (sliced.float() - want).abs().max() < tol, float(base)
    assert (fused.float() - want)[-1].abs().max() < tol  # the last row
