"""Where a sweep's prompt vocabulary comes from when a target is known only by its URL.

A token-id prompt must hold ids the server's model can take, and a text prompt of exactly N
tokens needs that model's tokenizer. In order of preference (`plan` decides once per sweep):
a checkpoint directory the caller named; the server's own `/tokenize` and `/detokenize` (vLLM's
routes and shapes; `gpurig engine serve` has both), from which the pool is the distinct ids of
a fixed corpus (ordinary ids only: no special token is ever produced by encoding text); the
served model's tokenizer in the Hugging Face cache; else text of an approximate length, seeded
words, which the report marks as approximate.

`Codec` is the one interface text prompts need (encode, decode), for a local tokenizer and for a
server alike.
"""

from __future__ import annotations

from typing import Protocol

import httpx
import numpy as np

TIMEOUT_S = 10.0
WORDS_PER_TOKEN = 0.75  # English prose through a BPE tokenizer, roughly
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "this",
    "which",
    "or",
    "are",
    "an",
    "be",
    "had",
    "not",
    "but",
    "were",
    "have",
    "one",
    "all",
    "their",
    "there",
    "been",
    "has",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "river",
    "stone",
    "light",
    "green",
    "blue",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "small",
    "large",
    "early",
    "late",
    "open",
    "close",
    "value",
    "model",
    "engine",
    "token",
    "prompt",
    "server",
    "signal",
    "market",
    "energy",
    "winter",
    "summer",
    "garden",
    "window",
]


class Codec(Protocol):
    def ids(self, text: str) -> list[int]: ...

    def text(self, ids: list[int]) -> str: ...


class LocalCodec:
    """A `tokenizers.Tokenizer` (tokenizer.json) as a Codec: no special tokens either way."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class ServerCodec:
    """A server's POST /tokenize and /detokenize (at its root, beside /v1) as a Codec, in
    vLLM's shapes (`prompt` in, `prompt` out; the engine server's too) or llama-server's
    (`content` in and out). The first call finds which: llama-server ignores a `prompt` field
    and tokenises its empty `content`, so an empty answer to a non-empty text means its shape."""

    def __init__(self, root_url: str, model: str | None = None) -> None:
        self.root_url = root_url.rstrip("/")
        self.model = model
        self.shape: str | None = None  # "vllm" or "llamacpp", once known

    def _post(self, path: str, body: dict) -> dict:
        if self.model and self.shape != "llamacpp":
            body = {**body, "model": self.model}
        resp = httpx.post(self.root_url + path, json=body, timeout=TIMEOUT_S)
        resp.raise_for_status()
        return resp.json()

    def _tokenize(self, text: str, shape: str) -> list[int]:
        if shape == "llamacpp":
            body = {"content": text, "add_special": False, "parse_special": False}
        else:
            body = {"prompt": text, "add_special_tokens": False}
        return [int(i) for i in self._post("/tokenize", body)["tokens"]]

    def ids(self, text: str) -> list[int]:
        if self.shape is not None:
            return self._tokenize(text, self.shape)
        try:
            ids = self._tokenize(text, "vllm")
        except httpx.HTTPStatusError:
            ids = []
        if ids or not text:
            self.shape = "vllm"
            return ids
        self.shape = "llamacpp"
        return self._tokenize(text, "llamacpp")

    def text(self, ids: list[int]) -> str:
        answer = self._post("/detokenize", {"tokens": list(ids)})
        return str(answer["content"] if self.shape == "llamacpp" else answer["prompt"])


def corpus(n_words: int = 4000, seed: int = 0) -> str:
    """A fixed text to learn ordinary token ids from: common words, their capitalised forms,
    digits and punctuation, in a seeded order (the same text for every server)."""
    rng = np.random.default_rng(seed)
    words = _WORDS + [w.capitalize() for w in _WORDS] + [str(i) for i in range(100)]
    words += list(".,;:!?()-'\"/")
    return " ".join(words[i] for i in rng.integers(0, len(words), size=n_words))


def root_of(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def server_pool(base_url: str, model: str | None = None) -> list[int] | None:
    """The distinct ids the server's tokenizer gives the corpus, checked by a round trip
    through /detokenize; None when the server has no such routes (or is down)."""
    codec = ServerCodec(root_of(base_url), model)
    try:
        ids = codec.ids(corpus())
        if not ids or not codec.text(ids[:32]).strip():
            return None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return sorted(set(ids))


def approx_words(seed_parts: list[int], n_tokens: int) -> str:
    """Seeded English-like words, about `n_tokens` tokens long (WORDS_PER_TOKEN): the prompt
    when no tokenizer is known; the report says the lengths are approximate."""
    rng = np.random.default_rng(seed_parts)
    n_words = max(1, round(n_tokens * WORDS_PER_TOKEN))
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n_words))


def approx_tokens(text: str) -> int:
    """A token estimate of `text` (dataset replies when no tokenizer is known)."""
    return max(1, round(len(text.split()) / WORDS_PER_TOKEN))
