"""Picking one request's next token from its logits, with its own seeded generator."""

from __future__ import annotations

import torch

from engine.sampling import SamplingParams


class Sampler:
    """Picks one request's next token from its logits [V]; holds its own seeded generator."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        """params: already checked (Engine.stream does it, with the vocabulary's size)."""
        self.params = params
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> the chosen id as a 1-element int64 tensor on the same device."""
        logits = logits.float()
        if self.bias_ids is not None:
            logits = logits.index_add(0, self.bias_ids, self.bias_values)
        p = self.params
        if p.greedy:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / p.temperature
        if p.top_k is not None and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p is not None and p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
            drop_sorted = before > p.top_p
            drop_sorted[0] = False  # always keep the most likely token
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)
