"""The byte bound that lets the server refuse an over-long prompt without tokenising it: real
`tokenizers` pipelines, checked against what they actually produce."""

from __future__ import annotations

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from engine.server.limits import ServerOptions, compute_limits, max_bytes_per_token
from engine.tokenizer_synth import build_tokenizer


def _bpe(vocab: dict[str, int], byte_fallback: bool = True) -> Tokenizer:
    return Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=byte_fallback))


def test_the_bound_holds_for_the_byte_level_tokenizer():
    tok = build_tokenizer(512)
    bpt = max_bytes_per_token(tok)
    assert bpt is not None and bpt >= 1
    for text in ("hello world", "<|tool_response>" * 50, "é🙂" * 30, "\x00\n\t" * 10):
        tokens = len(tok.encode(text, add_special_tokens=False).ids)
        assert tokens >= -(-len(text.encode()) // bpt), text  # N bytes make >= N / B tokens


def test_a_sentencepiece_style_pipeline_gets_a_bound():
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁▁▁▁": 256, "hello": 257}
    tok = _bpe(vocab)
    tok.normalizer = normalizers.Replace(" ", "▁")
    bpt = max_bytes_per_token(tok)
    assert bpt == len("▁▁▁▁".encode())  # an over-estimate of the 4 spaces it stands for: sound
    text = " " * 400 + "hello" * 10
    assert len(tok.encode(text).ids) >= len(text.encode()) / bpt


def test_pipelines_that_can_drop_or_shrink_text_get_no_bound():
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"ab": 256}
    shrinking = [
        normalizers.NFKC(),
        normalizers.Strip(),
        normalizers.Lowercase(),
        normalizers.Replace(" ", ""),
    ]
    for norm in shrinking:
        tok = _bpe(vocab)
        tok.normalizer = norm
        assert max_bytes_per_token(tok) is None, norm
    tok = _bpe(vocab)
    tok.normalizer = normalizers.Replace("  ", " ")  # halves runs of spaces
    assert max_bytes_per_token(tok) == 2 * len(b"<0x00>")
    tok = _bpe(vocab)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace
    assert max_bytes_per_token(tok) is None
    tok = _bpe(vocab, byte_fallback=False)  # unknown characters vanish
    assert max_bytes_per_token(tok) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_bytes_per_token(wordpiece) is None  # one [UNK] can stand for a whole word
    assert max_bytes_per_token(object()) is None


def test_limits_follow_the_context_under_the_hard_cap():
    tok = build_tokenizer(512)
    bpt = max_bytes_per_token(tok)
    small = compute_limits(ServerOptions(), tok, 4096)
    assert small.text_bytes == 4096 * bpt and small.body_bytes < 8 * 1024 * 1024
    big = compute_limits(ServerOptions(max_body_bytes=1000), tok, 131072)
    assert big.body_bytes == 1000
    assert compute_limits(ServerOptions(max_tokens_limit=None), tok, 64).max_tokens is None
