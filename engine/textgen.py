"""Text in, text out, with timings: the function behind `gpurig engine generate`.

Takes a loaded `Engine`, either raw prompt text (bos prepended, no template) or one user chat
message (rendered with the checkpoint's chat template), and returns the reply with the prompt
read time and the decode speed, plus the bytes-per-token bound figure gpt-fast reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel

from engine.errors import GenerationError
from engine.runtime import Engine


class GenerationResult(BaseModel):
    """One generation: the text, its token counts and how fast each phase ran."""

    model: str
    device: str
    cpu_threads: int | None = None  # torch's CPU threads, on the CPU (the speed depends on it)
    prompt_tokens: int
    new_tokens: int
    finish_reason: str | None
    text: str
    prefill_seconds: float
    prefill_tokens_per_s: float
    decode_seconds: float
    decode_tokens_per_s: float | None
    weight_bytes_per_token: int
    effective_gb_per_s: float | None


def prompt_ids(engine: Engine, prompt: str | None = None, chat: str | None = None) -> list[int]:
    """Token ids for raw text (bos + text) or one user message through the chat template."""
    if (prompt is None) == (chat is None):
        raise GenerationError(
            "give exactly one of prompt text or a chat message", "use --prompt or --chat"
        )
    if prompt is not None:
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False).ids
        return ([engine.bos_id] if engine.bos_id is not None else []) + list(ids)
    text = _render_chat(engine, chat or "")
    return list(engine.tokenizer.encode(text, add_special_tokens=False).ids)


def _render_chat(engine: Engine, message: str) -> str:
    """The generation prompt for one user message, with the checkpoint's template when it has one."""
    from engine.chat.render import bundled_template, render_chat

    bos = engine.tokenizer.id_to_token(engine.bos_id) if engine.bos_id is not None else None
    return render_chat(
        engine.chat_template or bundled_template(),
        [{"role": "user", "content": message}],
        bos_token=bos or "<bos>",
    )


def generate_text(
    engine: Engine,
    prompt: str | None = None,
    chat: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate a reply and time it: prefill = until the first token, decode = the rest.

    on_text, if given, receives the reply's text piece by piece as tokens arrive (a piece that
    ends inside a multi-byte character waits for the next token)."""
    ids = prompt_ids(engine, prompt, chat)
    start = time.perf_counter()
    first_at = None
    out: list[int] = []
    shown = ""
    for tok in engine.stream(ids, max_new_tokens, temperature, top_k, top_p, seed):
        if first_at is None:
            _sync(engine)
            first_at = time.perf_counter()
        out.append(tok)
        if on_text is not None:
            text = engine.tokenizer.decode(out, skip_special_tokens=False)
            if not text.endswith("\ufffd") and text.startswith(shown):
                on_text(text[len(shown) :])
                shown = text
    _sync(engine)
    if on_text is not None:
        text = engine.tokenizer.decode(out, skip_special_tokens=False)
        if text.startswith(shown) and text != shown:
            on_text(text[len(shown) :])
    end = time.perf_counter()
    first_at = first_at or end
    decode_s = end - first_at
    decode_rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None
    bytes_per_token = engine.model.decode_weight_bytes()
    return GenerationResult(
        model=engine.model_name,
        device=str(engine.device),
        cpu_threads=_cpu_threads(engine),
        prompt_tokens=len(ids),
        new_tokens=len(out),
        finish_reason=engine.last_finish_reason,
        text=engine.tokenizer.decode(out, skip_special_tokens=False),
        prefill_seconds=round(first_at - start, 4),
        prefill_tokens_per_s=round(len(ids) / max(first_at - start, 1e-9), 2),
        decode_seconds=round(decode_s, 4),
        decode_tokens_per_s=round(decode_rate, 2) if decode_rate else None,
        weight_bytes_per_token=bytes_per_token,
        effective_gb_per_s=round(bytes_per_token * decode_rate / 1e9, 3) if decode_rate else None,
    )


def _cpu_threads(engine: Engine) -> int | None:
    if engine.device.type != "cpu":
        return None
    import torch

    return torch.get_num_threads()


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)
