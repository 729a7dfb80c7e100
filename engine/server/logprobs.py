"""Log-probabilities and token ids in the replies, in OpenAI's shapes as vLLM sends them.

- completions (`logprobs: k`, 0-20): `choices[i].logprobs = {text_offset, token_logprobs,
  tokens, top_logprobs}`; each `top_logprobs` entry is a {token text: log-probability} dict of
  the sampled token and the top k (k + 1 entries when the sampled token is not among the top k,
  as vLLM gives them), and `text_offset` counts the token texts' lengths from the start of the
  completion text (of the text sent so far, in a stream);
- chat (`logprobs: true`, `top_logprobs: k`, 0-20): `choices[i].logprobs.content[j] = {token,
  logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}` (k entries);
- streams: each chunk carries the log-probabilities of the tokens it carries (a token whose text
  is still held, such as part of a multi-byte character, still gets a chunk, with empty text);
- `return_token_ids: true` (vLLM's): `prompt_token_ids` and `token_ids` on each choice (in a
  stream: prompt_token_ids on the first chunk, each chunk's new token_ids);
- `return_tokens_as_token_ids: true` (vLLM's): tokens named "token_id:N", which stays unique
  where several ids decode to the same text (every lone byte of a multi-byte character is "�").

A token's text is `tokenizer.decode([id])` with leading "▁" spaces kept, as vLLM's
detokenizer gives it. The numbers are engine/logprobs.py's: the raw logits' log_softmax,
before logit_bias, temperature and top-k/top-p (vLLM's default logprobs_mode "raw_logprobs").
Log-probabilities below -9999 are sent as -9999.0 (JSON has no -inf), as vLLM and OpenAI do.
Limits: 400 for more than 20 alternatives (OpenAI's top_logprobs maximum, vLLM's default
--max-logprobs), a negative count, top_logprobs without logprobs: true, and echo with logprobs
(that needs the prompt's log-probabilities, which this server does not compute).
"""

from __future__ import annotations

from typing import Any

from engine.server.errors import ApiError
from engine.server.schemas import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

MAX_LOGPROBS = 20
FLOOR = -9999.0


def _bounded(value: int, name: str) -> int:
    if value < 0:
        raise ApiError(
            400, f"`{name}` must be 0 or more (got {value}).", param=name, code="invalid_value"
        )
    if value > MAX_LOGPROBS:
        raise ApiError(
            400,
            f"`{name}` is {value}, above the maximum of {MAX_LOGPROBS} (OpenAI's limit and "
            f"vLLM's default --max-logprobs). Ask for {MAX_LOGPROBS} or fewer.",
            param=name,
            code="invalid_value",
        )
    return value


def completion_k(req: Any) -> int | None:
    """The number of alternatives a completions request asks for (None: no logprobs)."""
    if req.logprobs is None:
        return None
    k = _bounded(req.logprobs, "logprobs")
    if req.echo:
        raise ApiError(
            400,
            "`echo` with `logprobs` needs the prompt's log-probabilities, which this server does "
            "not compute. Send echo: false (the prompt is what you sent).",
            param="echo",
            code="unsupported_parameter",
        )
    return k


def chat_k(req: Any) -> int | None:
    """The number of alternatives a chat request asks for (None: no logprobs)."""
    if req.top_logprobs is not None and req.top_logprobs != 0 and not req.logprobs:
        raise ApiError(
            400,
            "`top_logprobs` needs `logprobs: true`.",
            param="top_logprobs",
            code="invalid_value",
        )
    if not req.logprobs:
        return None
    return _bounded(req.top_logprobs or 0, "top_logprobs")


class TokenText:
    """Each token id's text as vLLM's logprobs show it, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token}"
        text = self._cache.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False) or ""
            raw = (
                self.tokenizer.id_to_token(token) if hasattr(self.tokenizer, "id_to_token") else ""
            )
            markers = len(raw or "") - len((raw or "").lstrip("\u2581"))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            if markers and missing > 0:  # decode() stripped a leading-space marker
                text = " " * missing + text
            self._cache[token] = text
        return text


def _lp(value: float) -> float:
    return max(float(value), FLOOR)


def completion_logprobs(
    text_of: TokenText, entries: list[Any], k: int, offset: int = 0, as_ids: bool = False
) -> CompletionLogprobs:
    """entries: engine.logprobs.TokenLogprobs of the tokens, in order; offset: the text's
    length before them (in a stream, the text already sent)."""
    out = CompletionLogprobs()
    for e in entries:
        token = text_of(e.token, as_ids)
        out.text_offset.append(offset)
        offset += len(token)
        out.tokens.append(token)
        out.token_logprobs.append(_lp(e.logprob))
        top: dict[str, float] = {}
        for t, v in e.top[: k + 1]:
            top.setdefault(text_of(t, as_ids), _lp(v))  # the first (most likely) of equal texts
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    text_of: TokenText, entries: list[Any], k: int, as_ids: bool = False
) -> ChatLogprobs:
    content = []
    for e in entries:
        token = text_of(e.token, as_ids)
        top = []
        for t, v in e.top[:k]:
            name = text_of(t, as_ids)
            top.append(ChatTopLogprob(token=name, logprob=_lp(v), bytes=_bytes(name)))
        content.append(
            ChatTokenLogprob(
                token=token, logprob=_lp(e.logprob), bytes=_bytes(token), top_logprobs=top
            )  # fmt: skip
        )
    return ChatLogprobs(content=content)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
