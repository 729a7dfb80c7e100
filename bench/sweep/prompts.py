"""The same prompts for every target: random token ids from a seed per (input length, repeat).

Prompt i of (input length n, repeat r) comes from its own generator seeded with
(seed, n, r, kind, i), so it is the same whichever cell asks for it, in whatever order, after a
resume too. Each concurrency level takes its own slice of that stream (the slices follow the
sweep's concurrency list), so a server's prefix cache never sees a measured prompt twice;
warm-up prompts are another stream (kind 1). The ids come from a pool every target can take:
[0, smallest vocabulary) without any target's special tokens, so a 512-token test model and a
262,144-token one get identical ids.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MEASURED, WARMUP, PREFIX, LENGTHS, DATASET = 0, 1, 2, 3, 4


@dataclass
class Vocab:
    """What a model's tokenizer allows: ids below `size`, minus `special`."""

    size: int
    special: set[int] = field(default_factory=set)
    source: str = ""


def read_vocab(model_dir: str | Path) -> Vocab | None:
    """The vocabulary of a local checkpoint: tokenizer.json's ids (capped at config.json's
    vocab_size, the embedding's rows) and its special added tokens; None when neither file is
    there."""
    root = Path(model_dir).expanduser()
    size: int | None = None
    special: set[int] = set()
    tok_path = root / "tokenizer.json"
    if tok_path.is_file():
        tok = load_tokenizer(root)
        size = tok.get_vocab_size(with_added_tokens=True)
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    cfg_path = root / "config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = {}
        text_cfg = cfg.get("text_config") or cfg
        n = text_cfg.get("vocab_size")
        if isinstance(n, int) and n > 0:
            size = min(size, n) if size else n
    if not size:
        return None
    return Vocab(size=size, special=special, source=str(root))


def common_pool(vocabs: list[Vocab]) -> tuple[int, list[int]]:
    """(pool size, excluded ids) valid for every vocabulary given."""
    size = min(v.size for v in vocabs)
    exclude = sorted({i for v in vocabs for i in v.special if i < size})
    return size, exclude


def pool_ids(size: int, exclude: list[int]) -> np.ndarray:
    ids = np.arange(size, dtype=np.int64)
    if exclude:
        ids = np.setdiff1d(ids, np.asarray(exclude, dtype=np.int64))
    if ids.size == 0:
        raise ValueError("the prompt pool is empty")
    return ids


def prompt_seed(seed: int, input_len: int, repeat: int) -> int:
    """The seed of (input length, repeat), one 32-bit number (what a report shows and what
    `vllm bench serve --seed` gets)."""
    return int(np.random.SeedSequence([seed, input_len, repeat]).generate_state(1)[0])


def slice_start(loads: list, load: object, per_cell: list[int]) -> int:
    """Where load level `load` (a concurrency, or a (concurrency, rate) pair) starts in the
    (input length, repeat) stream; a level not in the list (a search's) starts after them all,
    at an offset of its own."""
    start = 0
    for level, n in zip(loads, per_cell, strict=True):
        if level == load:
            return start
        start += n
    c, rate = load if isinstance(load, tuple) else (load, None)
    return start + 1_000_000 * (1 + int(c)) + (int(rate * 1000) if rate else 0)


def token_prompt(
    pool: np.ndarray,
    seed: int,
    input_len: int,
    repeat: int,
    index: int,
    kind: int = MEASURED,
    turn: int = 0,
    length: int | None = None,
) -> list[int]:
    """Prompt `index` of (input length, repeat): `length` ids (default input_len) from its own
    generator; a later turn of a conversation, or a prefix (kind), draws from another."""
    parts = [seed, input_len, repeat, kind, index] + ([turn] if turn else [])
    rng = np.random.default_rng(parts)
    return pool[rng.integers(0, pool.size, size=length or input_len)].tolist()


def token_prompts(
    pool: np.ndarray,
    seed: int,
    input_len: int,
    repeat: int,
    start: int,
    count: int,
    kind: int = MEASURED,
) -> list[list[int]]:
    return [
        token_prompt(pool, seed, input_len, repeat, i, kind) for i in range(start, start + count)
    ]


def sha(prompt: list[int] | str) -> str:
    """A short fingerprint of a prompt as sent, to show two targets got the same one."""
    data = prompt.encode() if isinstance(prompt, str) else np.asarray(prompt, "<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def text_prompt(codec, ids: list[int], input_len: int) -> str:
    """Text that the tokenizer encodes (without special tokens) to exactly `input_len` tokens,
    started from `ids`: decode, re-encode, trim or extend, repeat. ValueError when it cannot.
    `codec`: a bench.sweep.vocab Codec (a local or a server's tokenizer), or a Tokenizer."""
    from bench.sweep.vocab import LocalCodec

    if not hasattr(codec, "ids"):
        codec = LocalCodec(codec)
    extra = list(ids)
    text = codec.text(ids)
    for _ in range(8):
        enc = codec.ids(text)
        if len(enc) == input_len:
            return text
        if len(enc) > input_len:
            text = codec.text(enc[:input_len])
        else:
            more = extra[: input_len - len(enc)] or extra[:1]
            text = codec.text(enc + more)
    raise ValueError(f"no text of exactly {input_len} tokens could be made from these ids")


@functools.lru_cache(maxsize=4)
def _tokenizer_file(path: str, _mtime_ns: int, _size: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer.json, parsed once while the file is unchanged (a Gemma one is
    ~30 MB; text prompts need it in every cell and warm-up, in a possibly long-lived process)."""
    path = Path(model_dir).expanduser() / "tokenizer.json"
    st = path.stat()
    return _tokenizer_file(str(path), st.st_mtime_ns, st.st_size)
