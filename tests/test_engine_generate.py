"""Generation: sampling, stop ids, streaming and cancellation, the context limit, the cache and
the attention reference (checked against a per-query loop at the chunk sizes that broke SDPA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import prefill, read_prompt, sequence_cache

import engine
from engine import ops
from engine.checkpoint_maker import make_checkpoint
from engine.errors import ContextLengthError, EngineError, GenerationError
from engine.sampling import SamplingParams

PROMPT = [2] + list(range(40, 80))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "tiny"
    make_checkpoint(path, "tiny", seed=9)
    return path


@pytest.fixture(scope="module")
def eng(ckpt):
    return engine.load(ckpt, device="cpu", max_context=256, prefill_chunk=33)


def test_surface(eng, ckpt):
    assert eng.eos_ids == [1, 106, 50] and eng.bos_id == 2
    assert eng.model_dir == ckpt and eng.model_name == "tiny" and eng.max_context == 256
    assert eng.device.type == "cpu" and eng.chat_template and "<|turn>" in eng.chat_template
    ids = eng.tokenizer.encode("<|turn>user\nhi<turn|>", add_special_tokens=False).ids
    assert ids[0] == 105 and ids[-1] == 106


def test_a_hugging_face_snapshot_is_named_by_its_repo(ckpt, tmp_path):
    import shutil

    snap = tmp_path / "models--google--gemma-4-tiny" / "snapshots" / "0123abcd"
    shutil.copytree(ckpt, snap)
    assert engine.load(snap, device="cpu", max_context=16).model_name == "google/gemma-4-tiny"


def test_sampling_is_seeded_and_bounded(eng):
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=16, stop_ids=()))
    a = eng.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=5, stop_ids=()))
    b = eng.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=5, stop_ids=()))
    c = eng.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=6, stop_ids=()))
    assert a == b and a != c and a != greedy
    assert (
        eng.generate(
            PROMPT, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=1, stop_ids=())
        )
        == greedy
    )
    assert (
        eng.generate(
            PROMPT, SamplingParams(max_tokens=16, temperature=0.7, top_p=1e-6, seed=1, stop_ids=())
        )
        == greedy
    )
    # top-k 3: every sampled token is among the 3 most likely at its step
    out = eng.generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=2.0, top_k=3, seed=2, stop_ids=())
    )
    logits = [prefill(eng.model, sequence_cache(eng), PROMPT, 33)]
    for i, tok in enumerate(out[:-1]):
        pos = torch.tensor([len(PROMPT) + i])
        logits.append(eng.model.decode_step(torch.tensor([tok]), pos, sequence_cache(eng))[0])
    for tok, row in zip(out, logits, strict=True):
        assert tok in row.topk(3).indices.tolist()


@pytest.mark.parametrize("prompt_len", [1, 2, 34, 41])  # 1: no chunk at all; 34: 33 + 1
def test_reading_the_last_prompt_token_with_the_decode_step_equals_prefill(eng, prompt_len):
    """read_prompt with a step: the body through chunks that skip the KV-shared layers, the last
    token through the decode step. Same logits and the same cache as the full prefill."""
    model, cache = eng.model, sequence_cache(eng)
    prompt = PROMPT[:prompt_len]
    want = prefill(model, cache, prompt, 33).clone()
    want_cache = {i: (c.k.clone(), c.v.clone(), c.pos.clone()) for i, c in cache.layers.items()}
    for c in cache.layers.values():  # stale state the reset must clear
        c.k.normal_(), c.v.normal_(), c.pos.fill_(7)

    def step(token, position):
        return model.decode_step(token, position, cache)

    got = read_prompt(model, cache, prompt, 33, step)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=0)
    assert got.argmax() == want.argmax()
    for i, c in cache.layers.items():
        k, v, pos = want_cache[i]
        assert torch.equal(c.pos, pos), i
        filled = pos >= 0
        assert torch.allclose(c.k[filled], k[filled], atol=1e-5)
        assert torch.allclose(c.v[filled], v[filled], atol=1e-5)


def test_stop_ids_end_without_the_stop_token(eng):
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=24, stop_ids=()))
    j = 6
    stop = greedy[j]
    first = greedy.index(stop)
    gen = eng.stream(PROMPT, SamplingParams(max_tokens=24, stop_ids=(stop,)))
    assert list(gen) == greedy[:first] and gen.finish_reason == "stop"
    gen = eng.stream(PROMPT, SamplingParams(max_tokens=5, stop_ids=()))
    assert list(gen) == greedy[:5] and gen.finish_reason == "length"
    gen = eng.stream(PROMPT, SamplingParams(max_tokens=0))
    assert list(gen) == [] and gen.finish_reason == "length"


def test_stream_yields_and_cancels(eng):
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=12, stop_ids=()))
    it = eng.stream(PROMPT, SamplingParams(max_tokens=12, stop_ids=()))
    got = [next(it) for _ in range(4)]
    it.close()
    assert got == greedy[:4]
    with pytest.raises(StopIteration):
        next(it)
    assert (
        eng.generate(PROMPT, SamplingParams(max_tokens=12, stop_ids=())) == greedy
    )  # the cache is fine afterwards


def test_context_limit(ckpt):
    small = engine.load(ckpt, device="cpu", max_context=48, prefill_chunk=16)
    with pytest.raises(ContextLengthError) as info:
        small.stream(
            list(range(3, 52)), SamplingParams(max_tokens=4)
        )  # raised at the call, before any token
    assert (info.value.requested, info.value.limit) == (49, 48)
    gen = small.stream(
        PROMPT, SamplingParams(max_tokens=100, stop_ids=())
    )  # 41 prompt tokens: room for 8 positions
    assert len(list(gen)) == 48 - len(PROMPT) + 1 and gen.finish_reason == "length"
    assert (
        len(small.generate(list(range(3, 51)), SamplingParams(max_tokens=5, stop_ids=()))) == 1
    )  # prompt fills it exactly
    with pytest.raises(EngineError, match="max_context"):
        engine.load(ckpt, device="cpu", max_context=10**7)
    for bad in ("bogus", "meta"):
        with pytest.raises(EngineError, match="device") as info:
            engine.load(ckpt, device=bad)
        assert info.value.remedy


def test_bad_requests(eng):
    for kwargs in ({"temperature": -1.0}, {"top_k": 0}, {"top_p": 1.5}):
        with pytest.raises(GenerationError):
            eng.generate(PROMPT, SamplingParams(max_tokens=4, **kwargs))
    with pytest.raises(GenerationError, match="empty"):
        eng.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(GenerationError, match="vocabulary"):
        eng.generate([2, 10_000], SamplingParams(max_tokens=4))
    with pytest.raises(GenerationError, match="negative"):  # at the call, before any token
        eng.stream(PROMPT, SamplingParams(max_tokens=-1))
    with pytest.raises(GenerationError, match="logit_bias"):
        eng.stream(PROMPT, SamplingParams(max_tokens=4, logit_bias=((10_000, 1.0),)))


def test_logit_bias_moves_greedy_and_sampled_choices(eng):
    free = eng.generate(PROMPT, SamplingParams(max_tokens=6, stop_ids=()))
    assert (
        eng.generate(PROMPT, SamplingParams(max_tokens=6, stop_ids=(), logit_bias=((77, 100.0),)))
        == [77] * 6
    )
    banned = eng.generate(
        PROMPT, SamplingParams(max_tokens=6, stop_ids=(), logit_bias=((free[0], -100.0),))
    )
    assert banned[0] != free[0] and free[0] not in banned
    sampled = eng.generate(
        PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=((77, 100.0),))
    )
    assert sampled == [77] * 6


def test_cache_ring_and_memory(ckpt):
    eng = engine.load(ckpt, device="cpu", max_context=100, prefill_chunk=7)
    cfg = eng.config
    prefill(eng.model, sequence_cache(eng), list(range(3, 43)), 7)  # 40 tokens, window 16
    for i, lc in sequence_cache(eng).layers.items():
        if cfg.is_sliding(i):
            assert lc.slots == cfg.sliding_window
            assert sorted(lc.pos.tolist()) == list(range(24, 40))
            assert all(p % lc.slots == s for s, p in enumerate(lc.pos.tolist()))
        else:
            assert lc.pos[:40].tolist() == list(range(40)) and (lc.pos[40:] == -1).all()
    assert set(sequence_cache(eng).layers) == set(
        range(cfg.first_shared_layer)
    )  # shared layers own none
    # a one-sequence pool: the context rounded up to whole blocks plus block 0 (the padding
    # slot's) in every full layer, a ring per slot (the sequence's and the padding slot's) in
    # every sliding one, each row K + V + its position; and the block table
    g = eng.pool.geometry
    assert (g.max_seqs, g.num_blocks) == (1, -(-100 // g.block_size) + 1)
    expected = (
        sum(
            (2 * cfg.sliding_window if cfg.is_sliding(i) else g.num_blocks * g.block_size)
            * (2 * cfg.layer_kv_heads[i] * cfg.layer_head_dims[i] * 4 + 8)
            for i in range(cfg.first_shared_layer)
        )
        + 2 * g.max_blocks_per_seq * 4
    )
    report = eng.memory_report()
    assert report.cache_bytes == expected
    assert report.total_bytes == (
        report.embed_lm_head_bytes
        + report.layers_bytes
        + report.per_layer_table_bytes
        + report.cache_bytes
        + report.other_bytes
    )
    assert report.layers_bytes > 0 and report.per_layer_table_bytes == 512 * 6 * 32 * 2


@pytest.mark.parametrize("chunk", [33, 65, 97])
def test_attention_prefill_matches_a_per_query_loop(chunk):
    """Plain matmul + softmax over cache + chunk equals attending query by query (the seed saw
    torch SDPA's memory-efficient kernel return a wrong last row at these sizes)."""
    gen = torch.Generator().manual_seed(chunk)
    hq, hkv, d, window, start = 8, 1, 32, 40, 70
    q = torch.randn(chunk, hq, d, generator=gen)
    k_new, v_new = torch.randn(2, chunk, hkv, d, generator=gen)
    ring_k, ring_v = torch.randn(2, window, hkv, d, generator=gen)
    first = start - window  # the ring holds positions first..start-1, slot = position % window
    ring_pos = torch.tensor([first + (s - first) % window for s in range(window)])
    q_pos = torch.arange(start, start + chunk)
    got = ops.attention_prefill(q, k_new, v_new, ring_k, ring_v, ring_pos, q_pos, window)
    keys, values = torch.cat([ring_k, k_new])[:, 0], torch.cat([ring_v, v_new])[:, 0]
    pos = torch.cat([ring_pos, q_pos])
    for t in range(chunk):
        p = int(q_pos[t])
        sel = (pos <= p) & (pos > p - window)
        w = torch.softmax(q[t] @ keys[sel].T, dim=-1)
        assert torch.allclose(got[t], w @ values[sel], atol=1e-5), f"row {t} of {chunk}"


def test_attention_in_row_blocks_is_the_same(monkeypatch):
    """Long prompts attend in blocks of query rows (bounded score memory): same result."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(97, 4, 32, generator=gen)
    k, v = torch.randn(2, 300, 2, 32, generator=gen)
    kp, qp = torch.arange(300), torch.arange(203, 300)
    whole = ops._attend(q, k, v, kp, qp, 64)
    monkeypatch.setattr(ops, "SCORE_BUDGET", 4 * 300 * 10)  # blocks of 10 rows
    assert torch.equal(ops._attend(q, k, v, kp, qp, 64), whole)


def test_two_open_streams_each_get_their_alone_tokens(eng):
    """One engine design: a second request on a one-sequence engine waits in the line while the
    first keeps its slot, then runs; both get the tokens they get alone."""
    greedy = eng.generate(PROMPT, SamplingParams(max_tokens=6, stop_ids=()))
    short = eng.generate(PROMPT[:20], SamplingParams(max_tokens=3, stop_ids=()))
    old = eng.stream(PROMPT, SamplingParams(max_tokens=6, stop_ids=()))
    assert next(old) == greedy[0]
    assert eng.generate(PROMPT[:20], SamplingParams(max_tokens=3, stop_ids=())) == short
    assert [greedy[0], *old] == greedy and old.finish_reason == "length"


def test_generate_text_streams_the_same_text(eng):
    from engine.textgen import generate_text

    pieces: list[str] = []
    params = SamplingParams(max_tokens=20)
    res = generate_text(eng, chat="Tell me a story", params=params, on_text=pieces.append)
    assert "".join(pieces) == res.text and res.new_tokens == 20 and len(pieces) > 1
    assert res.prompt_tokens > 10 and res.weight_bytes_per_token == eng.model.decode_weight_bytes()


def test_read_prompt_returns_logits_the_next_step_does_not_overwrite(eng):
    """On CUDA the decode step returns its graph's output buffer; read_prompt's logits must
    survive the next step (the bench compares prompt modes after further steps)."""
    model, cache = eng.model, sequence_cache(eng)
    out = torch.zeros(1, model.cfg.vocab_size)

    def step(token, position):  # a step that hands out one shared buffer, as a graph does
        out.copy_(model.decode_step(token, position, cache))
        return out

    got = read_prompt(model, cache, PROMPT, 33, step)
    kept = got.clone()
    step(torch.tensor([5]), torch.tensor([len(PROMPT)]))
    assert torch.equal(got, kept) and got.data_ptr() != out.data_ptr()
