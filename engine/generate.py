"""Reading a prompt in chunks and producing tokens: greedy or sampled, with stop ids.

The decode loop keeps the next token and its position in device tensors that it updates in
place, so the step `model.decode_step(token, position, cache)` sees the same tensors every time
(what a CUDA graph replay needs); the engine's Backend (engine/backend.py) supplies the step
(engine.fast's fused step and CUDA graph on the fast path). The only host sync per token is
reading the sampled id, which streaming and the stop check need anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.backend import Backend
from engine.cache import KVCache
from engine.errors import ContextLengthError, GenerationError
from engine.logprobs import TokenLogprobs, one_row
from engine.memory import plan_prompt
from engine.model import Gemma4Model

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (see SamplingParams.greedy)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. temperature 0 (or None) means greedy. logit_bias: (token id,
    bias) pairs added to the logits before anything else (OpenAI's logit_bias; greedy too)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def validate(self, vocab_size: int | None = None) -> None:
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise GenerationError(
                    f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})",
                    "bias token ids of this checkpoint's tokenizer",
                )
            if not math.isfinite(bias):
                raise GenerationError(f"logit_bias of token {token} is {bias}", "use a finite bias")
        if self.temperature is not None and self.temperature < 0:
            raise GenerationError(
                f"temperature {self.temperature} is negative", "use 0 (greedy) or more"
            )
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(
                f"top_k {self.top_k} must be at least 1", "use top_k >= 1 or leave it unset"
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise GenerationError(
                f"top_p {self.top_p} must be in (0, 1]", "use a value such as 0.95"
            )

    @property
    def greedy(self) -> bool:
        """Below MIN_TEMPERATURE a temperature is greedy, as in vLLM (_SAMPLING_EPS): dividing
        the logits by 1e-40 overflows float32 to inf, and softmax of inf is NaN; the pick is
        the argmax either way."""
        return not self.temperature or self.temperature < MIN_TEMPERATURE


class Sampler:
    """Picks the next token from logits [V]; holds its own seeded generator."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        """params: already validated (Engine.stream does it, with the vocabulary's size)."""
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


@dataclass
class GenerationState:
    """Why the generation ended: 'stop' (a stop id) or 'length' (max tokens / context). The
    counts live on engine.generation.Generation, which sees every token."""

    finish_reason: str | None = None


def check_prompt(prompt: list[int], vocab_size: int, max_context: int) -> None:
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


def prefill(
    model: Gemma4Model,
    cache: KVCache,
    prompt: list[int],
    chunk: int,
    score_budget: int | None = None,
) -> torch.Tensor:
    """Read the whole prompt, `chunk` tokens at a time, every layer on every chunk (the
    reference reading); returns the last token's logits [V]."""
    cache.reset()
    ids = torch.tensor(prompt, dtype=torch.int64, device=model.device)
    logits = None
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        logits = model.prefill_chunk(
            ids[start:end], start, cache, last=end == len(prompt), score_budget=score_budget
        )
    assert logits is not None
    return logits


def read_prompt(
    model: Gemma4Model,
    cache: KVCache,
    prompt: list[int],
    chunk: int,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    memory_cap_mib: int | None = None,
    read_chunk: Callable[..., None] | None = None,
) -> torch.Tensor:
    """The prompt into the cache; returns the last token's logits [V].

    `chunk` is the most tokens per pass: `engine.memory.plan_prompt` lowers it to what the
    memory left (under `memory_cap_mib`) holds and sizes the attention's score slices, or
    refuses the prompt (PromptMemoryError) before anything is read. Every temporary of a chunk
    is bounded by the chunk, never by the cache (engine.attention), so a plan that fits at the
    first chunk fits at the last.

    With a decode `step` (the fast path: Backend.step()), every token but the last is read in
    chunks that skip the KV-shared layers (only the last token needs them, and they keep no
    cache), by `read_chunk` (Backend.prefill_body(); default the model's own layers), and the
    last token goes through the step: one CUDA-graph replay instead of those ~20 layers run as
    eager ops on a single row, which cost ~30 ms of host time on the H200 whatever the prompt's
    length. The logits are the same function either way (the decode step is the reference's
    decode_step, tested to equal prefill). Without a step `prefill` reads it all."""
    plan = plan_prompt(model, len(prompt), chunk, memory_cap_mib)
    if step is None:
        return prefill(model, cache, prompt, plan.chunk, plan.score_budget)
    cache.reset()
    ids = torch.tensor(prompt, dtype=torch.int64, device=model.device)
    body = len(prompt) - 1
    if read_chunk is None:
        read_chunk = lambda ids, start, budget=None: model.prefill_chunk(  # noqa: E731
            ids, start, cache, False, budget
        )
    for start in range(0, body, plan.chunk):
        read_chunk(ids[start : min(start + plan.chunk, body)], start, plan.score_budget)
    del read_chunk  # its dequantisation buffer: the step (and its first capture) come next
    position = torch.tensor([body], dtype=torch.int64, device=model.device)
    # a copy: on CUDA the step returns its graph's output buffer, which the next step rewrites
    return step(ids[body:], position)[0].clone()


class _TokenReader:
    """Brings a 1-element device tensor to the host without waiting for work queued after it:
    on CUDA an async copy into pinned memory and an event recorded right behind it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.empty(1, dtype=torch.int64, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending: torch.Tensor | None = None

    def request(self, token: torch.Tensor) -> None:
        if self.cuda:
            self.host.copy_(token.reshape(1), non_blocking=True)
            self.event.record()
        else:
            self.pending = token

    def value(self) -> int:
        if self.cuda:
            self.event.synchronize()
            return int(self.host[0])
        return int(self.pending.item())


def generate_stream(
    model: Gemma4Model,
    cache: KVCache,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: set[int],
    chunk: int,
    state: GenerationState,
    memory_cap_mib: int | None,
    backend: Backend,
    logprobs: int | None = None,
    logprob_list: list[TokenLogprobs] | None = None,
) -> Iterator[int]:
    """Yield new token ids one by one; a stop id ends the stream without being yielded.

    Stops at `max_new_tokens` or when the context is full ('length'). Closing the generator
    stops it at the next token. The arguments were checked by the caller (`Engine.stream`:
    check_prompt, SamplingParams.validate, max_new_tokens >= 0) before the first token was
    asked for. `backend`: the engine's (its decoder is made once and kept). With `logprobs` k
    each yielded token's TokenLogprobs (engine/logprobs.py: the raw logits' log_softmax, the
    top k) is appended to `logprob_list` before the token is yielded.
    """
    sampler = Sampler(sampling, model.device)
    state.finish_reason = None
    if max_new_tokens == 0:
        state.finish_reason = "length"
        return
    step = backend.step()
    if backend.last_token_by_step:
        logits = read_prompt(model, cache, prompt, chunk, step, memory_cap_mib,
                             backend.prefill_body())  # fmt: skip
    else:
        logits = read_prompt(model, cache, prompt, chunk, None, memory_cap_mib)
    token = sampler(logits)  # [1] int64 on the device
    lp = one_row(logits, token, logprobs) if logprobs is not None else None
    position = torch.tensor([len(prompt)], dtype=torch.int64, device=model.device)
    next_pos = len(prompt)
    reader = _TokenReader(model.device)
    made = 0
    while True:
        # The step that reads `token` is launched before `token` reaches the host, so the GPU
        # decodes token n+1 while the host checks, yields and streams token n. Had the token
        # been a stop id, that step is wasted: it wrote one cache slot past the sequence, inside
        # the context, which the next sequence overwrites (a cache is reset per sequence).
        more = made + 1 < max_new_tokens and next_pos < cache.max_context
        reader.request(token)
        if more:
            out = step(token, position)[0]
            following = sampler(out)
            following_lp = one_row(out, following, logprobs) if logprobs is not None else None
            position += 1
        tok = reader.value()
        if tok in stop_ids:
            state.finish_reason = "stop"
            return
        if lp is not None and logprob_list is not None:
            logprob_list.append(lp.to_host([tok])[0])
        made += 1
        if not more:
            state.finish_reason = "length"
            yield tok
            return
        yield tok
        token = following
        if logprobs is not None:
            lp = following_lp
        next_pos += 1
