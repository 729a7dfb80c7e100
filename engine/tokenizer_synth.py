"""A synthetic Gemma 4 tokenizer for random-weight checkpoints (no real tokenizer can be downloaded).

Structurally Gemma 4's own tokenizer.json, small: a SentencePiece-style BPE with byte fallback.

- the normalizer replaces every space with `▁` (U+2581), which then marks word starts; no dummy
  prefix is added (Gemma's `add_dummy_prefix` is off), the pre-tokenizer splits on spaces (after
  the normalizer there are none: a no-op, as in the real file);
- the vocabulary holds the special tokens at Gemma 4's real ids (pad 0, eos 1, bos 2, unk 3, the
  tool / channel / turn markers), the 256 byte tokens `<0x00>`..`<0xFF>`, one token per
  character of a small alphabet (printable ASCII, newline, tab, `▁`), then the tokens of BPE
  merges learned deterministically from a fixed English/JSON text (`▁the`, `ing`, ...);
  every other id holds an `<unused_N>` placeholder, so the vocabulary is exactly vocab_size;
- a character outside the vocabulary is spelled as the byte tokens of its UTF-8 encoding, so
  every text encodes and decodes back losslessly;
- the decoder is Gemma's: `▁` back to a space, byte tokens back to bytes (ByteFallback), Fuse.

llama.cpp's converter accepts it (gguf-py's LlamaHfVocab reads a BPE with byte_fallback and a
Sequence decoder). Checkpoints written with the byte-level tokenizer of earlier versions keep
loading: the engine reads whatever tokenizer.json a checkpoint ships; `build_byte_level_tokenizer`
still writes that older kind for tests of it.
"""

from __future__ import annotations

import json
from collections import Counter

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

# Gemma 4's special tokens at their real ids.
SPECIAL_TOKENS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
GENERATION_EOS_IDS = [
    1,
    106,
    50,
]  # as E2B's generation_config.json: <eos>, <turn|>, <|tool_response>
MIN_VOCAB = 512  # the specials (up to id 106), 256 byte tokens and the alphabet fit
WORD_START = "\u2581"  # ▁
MAX_MERGES = 4000
RESERVED_UNUSED = 32  # <unused_N> placeholders kept free (tests script new pieces into them)
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
ALPHABET = [WORD_START, "\n", "\t", *(chr(c) for c in range(33, 127))]

# The text the merges are learned from: English, chat-turn words, JSON and tool-call shapes.
_MERGE_TEXT = """
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thank
you. What is the capital of France? The capital of France is Paris. Please write a short story
about a robot that learns to paint. Once upon a time there was a robot named Ada, and she lived
in a small house by the sea. Every morning she would walk along the shore and look at the waves.
Explain the difference between a list and a tuple in Python. A list is mutable and a tuple is
not. The function returns the number of tokens in the string. This is a test of the system. We
want to measure the time to first token and the throughput of the server under load. The model
answered the question correctly. Translate the following sentence into German: the weather is
nice. Summarize the text below in one sentence. There are many ways to solve this problem, and
the best one depends on the size of the input. system user model assistant thought call
declaration response description parameters properties required type string number integer
boolean object array name value location weather city temperature unit celsius fahrenheit
{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
def main(): return 0 if __name__ == "__main__": print("hello", 1, 2, 3) for i in range(10):
0 1 2 3 4 5 6 7 8 9 10 12 24 42 100 2024 3.14 1,000 - + = * / < > ( ) [ ] { } : ; , . ! ?
"""


def _learn_merges(text: str, budget: int) -> list[tuple[str, str]]:
    """Up to `budget` BPE merges, most frequent pair first (ties: the smaller pair), learned
    within words, SentencePiece style (`▁` starts a word)."""
    words: Counter[tuple[str, ...]] = Counter()
    for line in text.split("\n"):
        for i, w in enumerate(line.split(" ")):
            if w:
                words[tuple(w if i == 0 else WORD_START + w)] += 1
                words[tuple(WORD_START + w)] += 1
    merges: list[tuple[str, str]] = []
    seen: set[str] = set(ALPHABET)
    while len(merges) < budget:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for a, b in zip(symbols, symbols[1:], strict=False):
                pairs[(a, b)] += n
        best = min(
            (p for p, n in pairs.items() if n >= 2), key=lambda p: (-pairs[p], p), default=None
        )
        if best is None:
            break
        joined = best[0] + best[1]
        if joined not in seen:  # a new token (the same string by two routes gets one id)
            seen.add(joined)
            merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for symbols, n in words.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A Gemma-4-style tokenizer (BPE, byte fallback, `▁` word starts) of exactly `vocab_size`
    ids with Gemma 4's special ids."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"the synthetic tokenizer needs vocab_size >= {MIN_VOCAB}, got {vocab_size}"
        )
    free_ids = [i for i in range(vocab_size) if i not in SPECIAL_TOKENS]
    room = len(free_ids) - len(BYTE_TOKENS) - len(ALPHABET) - RESERVED_UNUSED
    budget = max(0, min(MAX_MERGES, room))
    merges = _learn_merges(_MERGE_TEXT, budget)
    pieces = [*BYTE_TOKENS, *ALPHABET, *(a + b for a, b in merges)]
    vocab: dict[str, int] = dict(zip(pieces, free_ids, strict=False))
    for i in free_ids[len(pieces) :]:
        vocab[f"<unused_{i}>"] = i
    for i, tok in SPECIAL_TOKENS.items():
        vocab[tok] = i
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", WORD_START)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(WORD_START, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for _, t in sorted(SPECIAL_TOKENS.items())]
    )
    _check_special_ids(tok)
    return tok


def build_byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """The byte-level BPE (no merges, one token per byte) that checkpoints written before the
    Gemma-style tokenizer ship; kept so tests can check that such checkpoints still load."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"the synthetic tokenizer needs vocab_size >= {MIN_VOCAB}, got {vocab_size}"
        )
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    free = (i for i in range(vocab_size) if i not in SPECIAL_TOKENS)
    for ch in byte_chars:
        vocab[ch] = next(free)
    for i in free:
        vocab[f"<unused_{i}>"] = i
    for i, t in SPECIAL_TOKENS.items():
        vocab[t] = i
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for _, t in sorted(SPECIAL_TOKENS.items())]
    )
    _check_special_ids(tok)
    return tok


def _check_special_ids(tok: Tokenizer) -> None:
    for i, t in SPECIAL_TOKENS.items():
        if tok.token_to_id(t) != i:  # guard: the library must keep the ids we gave
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")


def byte_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of the byte tokens `<0x00>`..`<0xFF>` of a Gemma-style tokenizer, by byte."""
    ids = [tokenizer.token_to_id(t) for t in BYTE_TOKENS]
    if any(i is None for i in ids):
        raise ValueError("this tokenizer has no <0xXX> byte tokens (not a byte-fallback BPE)")
    return ids  # type: ignore[return-value]


def tokenizer_config(max_length: int) -> str:
    """tokenizer_config.json naming the special tokens (for transformers' AutoTokenizer)."""
    return (
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "model_max_length": max_length,
                "add_bos_token": False,
                "add_eos_token": False,
                "padding_side": "left",
            },
            indent=2,
        )
        + "\n"
    )
