"""How much a request may ask of the server, decided before any heavy work is done.

Three bounds keep one request from freezing or monopolising the server:

- a body size: a hard cap (8 MiB by default, `--max-body-mib`), tightened to what could still fit
  in the context: every prompt byte costs at most 6 bytes of JSON (`\\u0001`), so a body over
  6 x (the context in bytes) + 1 MiB of structure cannot be a prompt the model can read;
- a text size: a prompt of N bytes makes at least N / B tokens, where B is the most bytes one token
  can stand for in this tokenizer (its longest vocabulary entry, in UTF-8). Text over
  context x B bytes is refused without tokenising it (tokenising megabytes takes seconds);
- a completion size: `max_tokens` is capped server-side (`--max-tokens-limit`, 4096 by default),
  so a request without one cannot hold the single generation queue for the whole context.

B is only computed for tokenizers whose pipeline never drops or shrinks text (BPE over bytes or
with byte fallback; normalizers that only replace or prepend); for any other the text bound is
off and only the body cap applies, so a valid prompt is never refused on a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.serve_options import DEFAULT_MAX_BODY_MIB, DEFAULT_MAX_TOKENS_LIMIT

DEFAULT_MAX_BODY_BYTES = DEFAULT_MAX_BODY_MIB * 1024 * 1024
JSON_BYTES_PER_TEXT_BYTE = 6  # "\u0001" is six bytes of JSON for one byte of text
BODY_SLACK_BYTES = 1024 * 1024  # field names, message wrappers, sampling fields

_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


@dataclass(frozen=True)
class ServerOptions:
    """What `gpurig engine serve` sets beyond the engine: who may call, and the bounds above.
    max_tokens_limit None means no server-side cap (up to the context)."""

    api_key: str | None = None
    max_tokens_limit: int | None = DEFAULT_MAX_TOKENS_LIMIT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class Limits:
    """The bounds in force for one served model (see the module docstring)."""

    body_bytes: int
    text_bytes: int | None  # None: the tokenizer can shrink text, no pre-check
    bytes_per_token: int | None
    max_tokens: int | None


def compute_limits(options: ServerOptions, tokenizer: Any, max_context: int) -> Limits:
    bpt = max_bytes_per_token(tokenizer)
    if bpt is None:
        return Limits(options.max_body_bytes, None, None, options.max_tokens_limit)
    text = max_context * bpt
    body = min(options.max_body_bytes, text * JSON_BYTES_PER_TEXT_BYTE + BODY_SLACK_BYTES)
    return Limits(body, text, bpt, options.max_tokens_limit)


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of input one token of `tokenizer` can cover, or None when its
    pipeline may drop or shrink text (then no sound bound exists)."""
    to_str = getattr(tokenizer, "to_str", None)
    if to_str is None:
        return None
    try:
        spec = json.loads(to_str())
    except (ValueError, TypeError):
        return None
    model = spec.get("model") or {}
    pre = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    if model.get("type") != "BPE" or any(p.get("type") not in _SAFE_PRE_TOKENIZERS for p in pre):
        return None
    if any(p.get("type") == "Split" and p.get("behavior") == "Removed" for p in pre):
        return None
    if not (model.get("byte_fallback") or any(p.get("type") == "ByteLevel" for p in pre)):
        return None  # unknown characters could be dropped
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    vocab = model.get("vocab") or {}
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    longest = max((len(t.encode("utf-8", "replace")) for t in [*vocab, *added]), default=0)
    return max(1, longest * shrink)


def _flatten(node: Any, key: str) -> list[dict[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get(key) or [] for p in _flatten(child, key)]
    return [node]


def _normalizer_shrink(node: Any) -> int | None:
    """How many times shorter the normalizer can make a text (1: never shorter); None when it
    can delete text or is of a kind not understood here."""
    factor = 1
    for n in _flatten(node, "normalizers"):
        kind = n.get("type")
        if kind == "Prepend":
            continue
        if kind != "Replace":
            return None
        pattern = (n.get("pattern") or {}).get("String")
        content = n.get("content") or ""
        if pattern is None or not content:
            return None
        factor *= max(1, -(-len(pattern.encode()) // len(content.encode())))
    return factor
