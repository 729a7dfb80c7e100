"""Text in, text out, with timings: `GenerationResult`, the one result type of a generation,
and `generate_text`, the function behind `gpurig engine generate`.

The OpenAI server (engine/server/queue.py) and the CLI both turn tokens into text with
engine/detokenize.py (the CLI through `TextStream` over `Engine.stream`) and describe the outcome
with a `GenerationResult`; the CLI adds where it ran and the bandwidth achieved
(`GenerationReport`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import BaseModel

from engine.chat.render import ChatFormat, encode_prompt
from engine.detokenize import TextStream
from engine.errors import GenerationError
from engine.generation import Timings
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.runtime import Engine


class GenerationResult(BaseModel):
    """One finished generation: its text, token counts, why it ended and how fast each phase
    ran. prefill: reading the prompt up to the first new token; decode: the first new token to
    the last; decode_tokens: the tokens decode steps made (the ending stop id included);
    decode_tokens_per_s is None when no decode step ran. finish_reason: "stop" (a stop id or
    stop string), "length", or "cancelled" (the server's: a client that left)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    new_tokens: int
    time_to_first_token_seconds: float
    prefill_seconds: float
    prefill_tokens_per_s: float
    decode_seconds: float
    decode_tokens: int
    decode_tokens_per_s: float | None

    @classmethod
    def of(cls, stream: TextStream, finish_reason: str | None = None) -> GenerationResult:
        """The result of a finished (or closed) text stream; finish_reason overrides its own."""
        gen = stream.generation
        return cls.of_run(stream.text, finish_reason or stream.finish_reason, gen.prompt_tokens,
                          gen.completion_tokens, gen.timings)  # fmt: skip

    @classmethod
    def of_run(cls, text: str, finish_reason: str | None, prompt_tokens: int, new_tokens: int,
               t: Timings) -> GenerationResult:  # fmt: skip
        """The result of a run whose text, counts and timings are known."""
        rate = t.decode_tokens_per_s
        return cls(
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            time_to_first_token_seconds=round(t.time_to_first_token, 6),
            prefill_seconds=round(t.prompt_seconds, 6),
            prefill_tokens_per_s=round(prompt_tokens / max(t.prompt_seconds, 1e-9), 2),
            decode_seconds=round(t.decode_seconds, 6),
            decode_tokens=t.decode_tokens,
            decode_tokens_per_s=round(rate, 2) if rate else None,
        )


class GenerationReport(GenerationResult):
    """What `gpurig engine generate` prints: the result, where it ran, and the weight bytes one
    decode step reads against the bandwidth that achieved (the figure gpt-fast reports)."""

    model: str
    device: str
    cpu_threads: int | None = None  # torch's CPU threads, on the CPU (the speed depends on it)
    weight_bytes_per_token: int
    effective_gb_per_s: float | None


def prompt_ids(
    engine: Engine, prompt: str | None = None, chat: str | None = None
) -> tuple[list[int], list[int] | None]:
    """Token ids for raw text (bos + text) or one user message through the chat template, and
    the stop ids: None (the checkpoint's eos ids) for raw text, ChatFormat.stop_ids for a chat
    reply (as the server's)."""
    if (prompt is None) == (chat is None):
        raise GenerationError(
            "give exactly one of prompt text or a chat message", "use --prompt or --chat"
        )
    if prompt is not None:
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False).ids
        return ([engine.bos_id] if engine.bos_id is not None else []) + list(ids), None
    fmt = ChatFormat.of(engine.tokenizer, engine.chat_template, engine.bos_id, engine.eos_ids)
    text = fmt.render([{"role": "user", "content": chat or ""}])
    return encode_prompt(engine.tokenizer, text), list(fmt.stop_ids)


def generate_text(
    engine: Engine,
    prompt: str | None = None,
    chat: str | None = None,
    params: SamplingParams | None = None,
    on_text: Callable[[str], None] | None = None,
) -> GenerationReport:
    """Generate a reply and time it.

    params: what to make (SamplingParams; its stop_ids None means the prompt's: the eos ids for
    raw text, the chat format's for a chat reply; () generates exactly max_tokens, as vLLM's
    ignore_eos). on_text, if given, receives the reply's text piece by piece as tokens arrive
    (a piece that ends inside a multi-byte character waits for the next token)."""
    ids, stops = prompt_ids(engine, prompt, chat)
    params = params or SamplingParams(max_tokens=128)
    if params.stop_ids is None and stops is not None:
        params = replace(params, stop_ids=tuple(stops))
    generation = engine.stream(ids, params)
    stream = TextStream(generation, engine.tokenizer)
    for piece in stream:
        if piece and on_text is not None:
            on_text(piece)
    result = GenerationResult.of(stream)
    bytes_per_token = engine.model.decode_weight_bytes()
    rate = result.decode_tokens_per_s
    return GenerationReport(
        **result.model_dump(),
        model=engine.model_name,
        device=str(engine.device),
        cpu_threads=_cpu_threads(engine),
        weight_bytes_per_token=bytes_per_token,
        effective_gb_per_s=round(bytes_per_token * rate / 1e9, 3) if rate else None,
    )


def _cpu_threads(engine: Engine) -> int | None:
    if engine.device.type != "cpu":
        return None
    import torch

    return torch.get_num_threads()
