"""One real long-prompt request through `Engine.stream`, timed and measured: what
lab.engine.long_prompt runs at each length and lab.engine.e2e_bench runs under the cap."""

from __future__ import annotations

from typing import Any

import torch

from engine.sampling import SamplingParams

NEW = 128  # tokens decoded after the prompt


def random_prompt(n: int, vocab: int) -> list[int]:
    """n token ids: bos, then random ids of the vocabulary (the same for the same n)."""
    gen = torch.Generator().manual_seed(n)
    return [2] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist()


def mib(b: float) -> float:
    """Bytes in MiB, to 0.1."""
    return round(b / 2**20, 1)


def request(eng, n: int, cap: int | None) -> dict[str, Any]:
    """One Engine.stream call on an n-token prompt: timings, peak memory and the plan."""
    from engine.memory import plan_prompt

    prompt = random_prompt(n, eng.config.vocab_size)
    plan = plan_prompt(eng.model, n, eng.prefill_chunk, cap)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with eng.stream(prompt, SamplingParams(max_tokens=NEW, stop_ids=())) as gen:
        tokens = list(gen)
    t = gen.timings  # the engine's own clock: stream() to first token, then to the synced end
    return {"tokens": n, "chunk": plan.chunk, "score_budget": plan.score_budget,
            "planned_mib": mib(plan.need_bytes), "left_mib": mib(plan.available_bytes or 0),
            "first_token_s": round(t.time_to_first_token, 3),
            "prompt_tok_per_s": round(n / t.time_to_first_token, 1),
            "decoded": gen.completion_tokens,
            "decode_tok_per_s": round(t.decode_tokens_per_s or 0.0, 1),
            "peak_allocated_mib": mib(torch.cuda.max_memory_allocated()),
            "peak_reserved_mib": mib(torch.cuda.max_memory_reserved()),
            "first_tokens": tokens[:8]}  # fmt: skip
