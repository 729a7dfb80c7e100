"""What a request asks for (`SamplingParams`), checked once, and how its tokens are picked.

One request object, as vLLM's and nano-vllm's `SamplingParams`: every front door (the CLI, the
OpenAI server, the benchmarks) builds one and hands it to `Engine.stream`/`Engine.generate`,
which checks it once against the checkpoint (`check`). Adding a sampling option touches this
object, its check and the HTTP schemas, nothing on the way. Plain Python (the scheduler's policy
reads it without torch); the picking itself is engine/sampler.py's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import ContextLengthError, GenerationError

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (see SamplingParams.greedy)


@dataclass(frozen=True)
class SamplingParams:
    """How many tokens to make and how to pick each.

    max_tokens: the most new tokens; temperature 0 (or below MIN_TEMPERATURE) is greedy;
    stop_ids None means the checkpoint's eos ids (generation_config.json), () stops only at
    max_tokens (vLLM's ignore_eos); the stop id that ends a generation is not returned.
    logit_bias: (token id, bias) pairs added to the logits before anything else (OpenAI's
    logit_bias; greedy too). seed: the request's own generator (its tokens do not depend on the
    other requests in a batch). logprobs k: each token's log-probability and the step's top k
    (engine/logprobs.py, of the raw logits)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """Below MIN_TEMPERATURE a temperature is greedy, as in vLLM (_SAMPLING_EPS): dividing
        the logits by 1e-40 overflows float32 to inf, and softmax of inf is NaN; the pick is
        the argmax either way."""
        return not self.temperature or self.temperature < MIN_TEMPERATURE

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing added to the logits: one argmax over the batch serves it."""
        return self.greedy and not self.logit_bias

    def check(self, vocab_size: int) -> None:
        """Refuse values no generation can use (GenerationError, before anything runs)."""
        if self.max_tokens < 0:
            raise GenerationError(f"max_tokens {self.max_tokens} is negative", "use 0 or more")
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise GenerationError(
                    f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})",
                    "bias token ids of this checkpoint's tokenizer",
                )
            if not math.isfinite(bias):
                raise GenerationError(f"logit_bias of token {token} is {bias}", "use a finite bias")
        if self.temperature is not None and (
            self.temperature < 0 or not math.isfinite(self.temperature)
        ):
            raise GenerationError(
                f"temperature {self.temperature} is not a finite number >= 0",
                "use 0 (greedy) or more",
            )
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(
                f"top_k {self.top_k} must be at least 1", "use top_k >= 1 or leave it unset"
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise GenerationError(
                f"top_p {self.top_p} must be in (0, 1]", "use a value such as 0.95"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= vocab_size:
            raise GenerationError(
                f"logprobs {self.logprobs} is outside [0, {vocab_size}]",
                "ask for 0 (the token's own) up to the vocabulary's size",
            )


def bias_pairs(bias: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias mapping as SamplingParams holds it."""
    return tuple((int(t), float(b)) for t, b in (bias or {}).items())


def check_prompt(prompt: list[int], vocab_size: int, max_context: int) -> None:
    """Refuse a prompt no generation can read (empty, too long, ids outside the vocabulary)."""
    if not prompt:
        raise GenerationError("the prompt is empty", "pass at least one token id (e.g. the bos id)")
    if len(prompt) > max_context:
        raise ContextLengthError(requested=len(prompt), limit=max_context)
    bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
    if bad:
        raise GenerationError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            "encode the prompt with this checkpoint's tokenizer",
        )
