"""Generation (what Engine.stream returns), the one incremental detokeniser, TextStream with stop
strings, the one chat format and generation_config.json reader, and tiny temperatures."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

import engine
from engine.chat.render import ChatFormat, bundled_template
from engine.checkpoint_maker import make_checkpoint
from engine.config import GenerationConfig, read_generation_config
from engine.detokenize import MAX_HELD, Detokenizer, TextStream
from engine.errors import CheckpointError
from engine.generation import Generation
from engine.sampling import SamplingParams
from engine.sequence import Output, Sequence
from engine.textgen import GenerationResult
from engine.tokenizer_synth import build_byte_level_tokenizer, build_tokenizer, byte_token_ids

PROMPT = [2] + list(range(40, 70))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = tmp_path_factory.mktemp("generation") / "tiny"
    make_checkpoint(path, "tiny", seed=4)
    return engine.load(path, device="cpu", max_context=128, prefill_chunk=16)


# ---- Generation on the engine ---------------------------------------------------------------


def test_generation_reports_length_counts_and_timings(eng):
    gen = eng.stream(PROMPT, SamplingParams(max_tokens=7, stop_ids=()))
    assert isinstance(gen, Generation) and gen.finish_reason is None and not gen.done
    first = next(gen)
    assert gen.finish_reason is None and gen.completion_tokens == 1  # still running
    rest = list(gen)
    assert [first, *rest] == gen.tokens and len(gen.tokens) == 7
    assert gen.finish_reason == "length" and gen.done
    assert gen.prompt_tokens == len(PROMPT) and gen.completion_tokens == 7
    t = gen.timings
    assert t.decode_tokens == 6  # the tokens after the first
    assert 0 < t.prompt_seconds <= t.time_to_first_token and t.decode_seconds > 0
    assert t.decode_tokens_per_s == pytest.approx(6 / t.decode_seconds)
    assert gen.timings == t  # final once done
    assert eng.generate(PROMPT, SamplingParams(max_tokens=7, stop_ids=())) == gen.tokens


def test_generation_stopped_by_a_stop_id_counts_the_stop_as_decoded(eng):
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=12, stop_ids=()))
    stop = greedy[5]
    cut = greedy.index(stop)
    gen = eng.stream(PROMPT, SamplingParams(max_tokens=12, stop_ids=(stop,)))
    assert list(gen) == greedy[:cut] and gen.finish_reason == "stop"
    assert gen.completion_tokens == cut
    # the stop id was made by a decode step too (unless it was the first token)
    assert gen.timings.decode_tokens == (cut - 1 + 1 if cut else 0)
    none = eng.stream(PROMPT, SamplingParams(max_tokens=0))
    assert list(none) == [] and none.finish_reason == "length"
    assert none.timings.decode_tokens == 0 and none.timings.decode_tokens_per_s is None


def test_generation_closed_early_has_no_finish_reason(eng):
    with eng.stream(PROMPT, SamplingParams(max_tokens=20, stop_ids=())) as gen:
        got = [next(gen), next(gen)]
    assert gen.done and gen.finish_reason is None and gen.tokens == got
    gen.close()  # again: harmless
    with pytest.raises(StopIteration):
        next(gen)
    assert eng.generate(PROMPT, SamplingParams(max_tokens=3, stop_ids=()))  # its slot was freed


def test_tiny_temperatures_are_greedy(eng):
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=5, stop_ids=()))
    for t in (1e-40, 9.9e-6):  # 1e-40 made softmax of inf: "probability tensor contains nan"
        assert (
            eng.generate(PROMPT, SamplingParams(max_tokens=5, temperature=t, stop_ids=())) == greedy
        )
    sampled = {
        tuple(
            eng.generate(PROMPT, SamplingParams(max_tokens=5, temperature=5.0, seed=s, stop_ids=()))
        )
        for s in range(3)
    }
    assert len(sampled) > 1  # a real temperature still samples


# ---- Generation as a pure iterator ----------------------------------------------------------


class _Engine:
    """Steps that hand a sequence prepared outputs, one per step, `delay` apart."""

    def __init__(self, seq: Sequence, outputs: list[Output], delay: float = 0.0) -> None:
        self.seq, self.outputs, self.delay = seq, outputs, delay
        self.steps = 0

    def step(self) -> bool:
        time.sleep(self.delay)
        self.steps += 1
        if self.steps == 1:
            self.seq.started_at = time.perf_counter()
        out = self.outputs.pop(0)
        if out.tokens and self.seq.first_token_at is None:
            self.seq.first_token_at = time.perf_counter()
        if out.finished:
            self.seq.finished, self.seq.finish_reason = True, out.finish_reason
            self.seq.ended_at = time.perf_counter()
        self.seq.sink(self.seq, out)
        return bool(self.outputs)


def _seq() -> Sequence:
    return Sequence([2, 3, 4, 5], SamplingParams(max_tokens=8), frozenset(), 4, None)


def test_generation_timings_follow_its_phases():
    seq = _seq()
    outs = [Output([]), Output([5]), Output([6]), Output([7], finished=True, finish_reason="stop")]
    stepper = _Engine(seq, outs, 0.02)
    gen = Generation(stepper, seq)
    assert list(gen) == [5, 6, 7] and gen.finish_reason == "stop" and stepper.steps == 4
    t = gen.timings
    assert t.prompt_seconds >= 0.015 and t.decode_seconds >= 0.03
    assert t.decode_tokens == 3  # two after the first, and the stop id
    assert gen.timings == t  # final once done

    failing = _seq()
    error = RuntimeError("device lost")
    gen = Generation(
        _Engine(failing, [Output([1]), Output([], finished=True, error=error)]), failing
    )
    assert next(gen) == 1
    with pytest.raises(RuntimeError):
        next(gen)
    assert gen.done and gen.finish_reason is None


# ---- the detokeniser -------------------------------------------------------------------------


def _byte_token_ids(tokenizer) -> list[int]:
    """The ids of the byte tokens <0x00>..<0xFF> (the synthetic tokenizer is a byte-fallback
    BPE, as Gemma 4's)."""
    return byte_token_ids(tokenizer)


def _byte_level_ids(tokenizer) -> list[int]:
    """The ids of the one-byte tokens for bytes 0..255 of the byte-level tokenizer that older
    checkpoints ship (GPT-2's byte-to-character map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [tokenizer.token_to_id(chars[b]) for b in range(256)]


def test_detokeniser_matches_decode_over_random_byte_tokens():
    """Byte-level BPE (older checkpoints): decode is a lossy UTF-8 decode of all the bytes, so
    the pieces joined equal it even over broken UTF-8."""
    tokenizer = build_byte_level_tokenizer(512)
    rng = random.Random(7)
    bytes_ = _byte_level_ids(tokenizer)
    high = bytes_[0x80:]
    specials = [1, 2, 48, 105, 106]
    for trial in range(600):
        pool = high if trial % 3 == 0 else bytes_  # every third: mostly broken UTF-8
        seq = [
            rng.choice(specials) if rng.random() < 0.05 else rng.choice(pool)
            for _ in range(rng.randint(0, 50))
        ]
        for skip in (False, True):
            d = Detokenizer(tokenizer, skip)
            pieces = [d.push(i) for i in seq] + [d.flush()]
            assert "".join(pieces) == tokenizer.decode(seq, skip_special_tokens=skip), seq


def test_detokeniser_matches_decode_over_random_byte_fallback_text(tokenizer):
    """Byte-fallback BPE (Gemma 4's kind): merged pieces, `▁` word starts, characters spelled as
    byte tokens and specials, mixed at random; the pieces joined equal decode and hold whole
    characters only. (Over broken UTF-8, ByteFallback turns a whole run of byte tokens into one
    U+FFFD per byte, even a valid character inside it, which no streaming decoder can know in
    advance; the detokeniser releases such a character as it completes.)"""
    rng = random.Random(7)
    words = tokenizer.encode('the model is thinking {"a": 1}\n', add_special_tokens=False).ids
    chars = ["é", "東", "🙂", "€", "ß"]
    specials = [1, 2, 48, 105, 106]
    for _ in range(300):
        seq: list[int] = []
        for _ in range(rng.randint(0, 30)):
            r = rng.random()
            if r < 0.1:
                seq.append(rng.choice(specials))
            elif r < 0.5:
                seq += [tokenizer.token_to_id(f"<0x{b:02X}>") for b in rng.choice(chars).encode()]
            else:
                seq.append(rng.choice(words))
        for skip in (False, True):
            d = Detokenizer(tokenizer, skip)
            pieces = [d.push(i) for i in seq] + [d.flush()]
            assert "".join(pieces) == tokenizer.decode(seq, skip_special_tokens=skip), seq
            assert not any("\ufffd" in p for p in pieces)


class _CountingTokenizer:
    """Counts the ids decoded: the work per token."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokeniser_work_per_token_stays_flat_on_broken_utf8(tokenizer):
    """A run of lone continuation bytes never forms a character: a window that waits for one
    would re-decode the whole run every token (quadratic)."""
    rng = random.Random(1)
    cont = _byte_token_ids(tokenizer)[0x80:0xC0]
    counting = _CountingTokenizer(tokenizer)
    seq = [rng.choice(cont) for _ in range(3000)]
    d = Detokenizer(counting)
    out = "".join(d.push(i) for i in seq) + d.flush()
    assert out == tokenizer.decode(seq)
    assert counting.decoded / len(seq) < 8 * MAX_HELD  # a bounded window, not the whole run


# ---- TextStream: text and stop strings -------------------------------------------------------


class _FakeGeneration:
    """An id iterator with Generation's finish_reason and close (what TextStream reads)."""

    def __init__(self, ids: list[int]) -> None:
        self._it = iter(ids)
        self.finish_reason: str | None = None
        self.closed = False

    def __iter__(self):
        return self

    def __next__(self) -> int:
        try:
            return next(self._it)
        except StopIteration:
            self.finish_reason = "length"
            raise

    def close(self) -> None:
        self.closed = True


def test_text_stream_cuts_at_a_stop_string_split_over_byte_tokens(tokenizer):
    ids = tokenizer.encode("price: 3€ END of €€ story", add_special_tokens=False).ids
    gen = _FakeGeneration(ids)
    stream = TextStream(gen, tokenizer, stop_strings=["€€", "zz"])
    pieces = list(stream)
    assert "".join(pieces) == stream.text == "price: 3€ END of "
    assert stream.stop_hit == "€€" and stream.finish_reason == "stop" and gen.closed
    gen = _FakeGeneration(ids)
    whole = TextStream(gen, tokenizer, stop_strings=["€x"])
    assert "".join(whole) == tokenizer.decode(ids) and whole.finish_reason == "length"


def test_generation_result_of_a_text_stream(eng):
    stream = TextStream(
        eng.stream(PROMPT, SamplingParams(max_tokens=9, stop_ids=())), eng.tokenizer
    )
    pieces = [p for p in stream if p]
    result = GenerationResult.of(stream)
    # a random model's ids: its text is the streaming decode of them (over a broken run of byte
    # tokens ByteFallback's one-shot decode differs, see the byte-fallback detokeniser test)
    d = Detokenizer(eng.tokenizer, True)
    streamed = "".join(d.push(i) for i in stream.generation.tokens) + d.flush()
    assert result.text == "".join(pieces) == streamed
    assert result.finish_reason == "length" and result.new_tokens == 9
    assert result.prompt_tokens == len(PROMPT) and result.decode_tokens == 8
    assert result.decode_tokens_per_s and result.decode_tokens_per_s > 0
    assert GenerationResult.of(stream, "cancelled").finish_reason == "cancelled"


# ---- one chat format, one generation_config reader -------------------------------------------


def test_chat_format_falls_back_to_the_bundled_template_and_bos_text(tokenizer, eng):
    fmt = ChatFormat.of(tokenizer)  # no template, no bos id
    assert fmt.template == bundled_template() and fmt.bos_token == "<bos>"
    assert ChatFormat.of(tokenizer, bos_id=2).bos_token == tokenizer.id_to_token(2)
    own = ChatFormat.of(eng.tokenizer, eng.chat_template, eng.bos_id, eng.eos_ids)
    assert own.template == eng.chat_template
    # a reply ends on the eos ids and the end-of-turn markers, found by their text
    assert own.stop_ids == (1, 50, 106) and ChatFormat.of(tokenizer).stop_ids == (1, 50, 106)
    assert ChatFormat.of(tokenizer, eos_ids=[7]).stop_ids == (1, 7, 50, 106)
    text = own.render([{"role": "user", "content": "hi"}])
    assert text.startswith("<bos>") and "hi" in text


def test_one_generation_config_reader(tmp_path: Path):
    assert read_generation_config(tmp_path) == GenerationConfig()
    assert GenerationConfig().sampling_defaults() == {"temperature": 0.0}
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [1, 106], "do_sample": True, "top_k": 0}))
    cfg = read_generation_config(tmp_path)
    assert cfg.eos_token_ids == (1, 106) and cfg.top_k is None
    assert cfg.sampling_defaults() == {"temperature": 1.0, "top_p": None, "top_k": None}
    path.write_text(json.dumps({"eos_token_id": 1}))
    assert read_generation_config(tmp_path).eos_token_ids == (1,)
    for bad in ("{nope", "[1, 2]"):
        path.write_text(bad)
        with pytest.raises(CheckpointError, match="generation_config.json"):
            read_generation_config(tmp_path)
