"""A synthetic Gemma 4 tokenizer for random-weight checkpoints (no real tokenizer can be downloaded).

Byte-level BPE with no merges: every byte of any text is one token, so every text encodes and
decodes back losslessly; the special tokens keep Gemma 4's real ids (pad 0, eos 1, bos 2, the
tool / channel / turn markers), so chat templates and stop ids behave as with the real model.
Ids not used by a special or a byte hold `<unused_N>` placeholders, so the vocabulary is exactly
the config's vocab_size.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

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
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
GENERATION_EOS_IDS = [
    1,
    106,
    50,
]  # as E2B's generation_config.json: <eos>, <turn|>, <|tool_response>
MIN_VOCAB = 512  # the specials (up to id 106) plus 256 byte tokens fit


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer of exactly `vocab_size` ids with Gemma 4's special ids."""
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
    for i, tok in SPECIAL_TOKENS.items():
        vocab[tok] = i
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for _, t in sorted(SPECIAL_TOKENS.items())]
    )
    for i, t in SPECIAL_TOKENS.items():
        if tok.token_to_id(t) != i:  # guard: the library must keep the ids we gave
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    return tok


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
                "padding_side": "left",
            },
            indent=2,
        )
        + "\n"
    )
