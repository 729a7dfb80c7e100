"""The fast path's pieces wired into the model: fused decode step, fused projections, and the
Triton branches of the ops dispatch points, against the engine's reference (tiny preset, fp32,
on the CPU interpreter here and compiled on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_support import prefill, reset, sequence_cache

import engine
from engine import ops
from engine.checkpoint_maker import make_checkpoint
from engine.fast import ops_fast
from engine.fast.batch_decode import BatchDecoder, supported
from engine.fast.fuse import fuse_projections
from engine.fast.ops_fast import FastOps
from engine.options import EngineOptions
from engine.sampling import SamplingParams

FORCE = EngineOptions(fast="force")  # the Triton path on any device (the CPU interpreter here)
OFF = EngineOptions(fast="off")


class _OneRow:
    """The fused step of a batch of one row (what every single sequence runs) over `cache`'s
    pool slot: `step(token [1], position [1]) -> logits [1, V]`."""

    def __init__(self, model, cache) -> None:
        self.decoder = BatchDecoder(model, cache.pool, fuse_projections(model), FastOps(), 1)
        self.slots = torch.tensor([cache.slot], dtype=torch.int32, device=model.device)

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.decoder.step(token, position, self.slots)


def _decoder(model, cache) -> _OneRow:
    return _OneRow(model, cache)


def _three_steps_match_the_reference(model, cache, decoder, logits, n_prompt) -> None:
    """Three greedy steps of `decoder` against the model's reference step on `cache`."""
    tok = logits.argmax().view(1)
    pos = torch.tensor([n_prompt], device=model.device)
    for _ in range(3):
        ref = model.decode_step(tok, pos, cache)[0]
        fast = decoder.step(tok, pos)[0]
        assert (ref - fast).abs().max().item() < 1e-4
        tok, pos = ref.argmax().view(1), pos + 1


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_emb4")
    make_checkpoint(path, preset="tiny", seed=3, emb4=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return engine.load(path, device=dev, dtype=torch.float32, max_context=256, options=OFF)


def test_fused_decode_step_matches_the_reference_step(tiny_engine):
    eng = tiny_engine
    model = eng.model
    assert supported(model, fuse_projections(model))  # every matrix the prologues need packed
    prompt = [2] + [int(t) for t in torch.randint(3, 500, (40,))]
    logits = prefill(model, sequence_cache(eng), prompt, 16)  # 40 > window 16: the rings wrap
    fused_cache = copy.deepcopy(sequence_cache(eng))
    decoder = _decoder(model, fused_cache)
    tok_ref = tok_fast = logits.argmax().view(1)
    pos = torch.tensor([len(prompt)], device=model.device)
    for _ in range(4):
        ref = model.decode_step(tok_ref, pos, sequence_cache(eng))[0]
        fast = decoder.step(tok_fast, pos)[0]
        assert (ref - fast).abs().max().item() < 1e-4
        tok_ref, tok_fast = ref.argmax().view(1), fast.argmax().view(1)
        assert tok_ref.item() == tok_fast.item()
        pos = pos + 1
    for i, layer in sequence_cache(eng).layers.items():
        other = fused_cache.layers[i]
        # the batched step writes K/V rows, not positions (kv_pool: the kernels need none)
        assert torch.allclose(layer.k, other.k, atol=1e-5) and torch.allclose(
            layer.v, other.v, atol=1e-5
        )


def test_fused_step_covers_layers_whose_values_are_their_keys(tmp_path):
    """attention_k_eq_v: the full layers carry no v projection (q|k only); their value comes
    from the key in qkv_rope, and the step and cache equal the reference's."""
    make_checkpoint(tmp_path, preset="tiny", seed=3, emb4=True,
                    overrides={"attention_k_eq_v": True})  # fmt: skip
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256, options=OFF)
    model = eng.model
    assert any(w.k is not None and w.v is None for w in model.layers)
    prompt = [2] + list(range(10, 50))  # 40 > window 16: the rings wrap
    logits = prefill(model, sequence_cache(eng), prompt, 16)
    fused_cache = copy.deepcopy(sequence_cache(eng))
    decoder = _decoder(model, fused_cache)
    _three_steps_match_the_reference(model, sequence_cache(eng), decoder, logits, len(prompt))
    for i, layer in sequence_cache(eng).layers.items():
        other = fused_cache.layers[i]
        # the batched step writes K/V rows, not positions (kv_pool: the kernels need none)
        assert torch.allclose(layer.k, other.k, atol=1e-5), i
        assert torch.allclose(layer.v, other.v, atol=1e-5), i


def test_fusion_keeps_one_copy_and_the_same_products(tiny_engine) -> None:
    model = tiny_engine.model
    fused = fuse_projections(model)
    w = model.layers[0]
    assert fused[0].qkv is not None and fused[0].gate_up is not None
    assert w.q.packed.data_ptr() == fused[0].qkv.packed.data_ptr()  # a view, not a copy
    x = torch.randn(3, w.q.in_features, device=model.device)
    whole = ops.linear(x, fused[0].qkv)
    parts = torch.cat([ops.linear(x, p) for p in (w.q, w.k, w.v)], dim=-1)
    assert torch.allclose(whole, parts, atol=1e-5)
    gu = ops.linear(x, fused[0].gate_up)  # interleaved rows: gate_i, up_i
    assert torch.allclose(gu[:, 0::2], ops.linear(x, w.gate), atol=1e-5)
    assert torch.allclose(gu[:, 1::2], ops.linear(x, w.up), atol=1e-5)


def test_fast_ops_agree_with_the_reference_ops(tiny_engine) -> None:
    fast_ops = FastOps()
    model = tiny_engine.model
    dev = model.device
    w = model.layers[1].down
    for rows in (1, 9):  # GEMV and the dequantise + matmul path
        x = torch.randn(rows, w.in_features, device=dev)
        assert torch.allclose(fast_ops.linear4(x, w), ops.linear4(x, w), atol=1e-4)
    ids = torch.tensor([0, 5, 511], device=dev)
    got = fast_ops.embed4_rows(ids, model.embed, torch.float32)
    assert torch.equal(got, ops.embed4_rows(ids, model.embed, torch.float32))
    # decode attention over a wrapped sliding ring and over a full cache, slots from the cache
    cache = copy.deepcopy(sequence_cache(tiny_engine))
    prefill(model, cache, list(range(2, 60)), 32)
    for i, window in ((0, model.cfg.sliding_window), (2, None)):
        lc = cache.layers[i]
        d = lc.k.shape[-1]
        q = torch.randn(1, model.cfg.num_attention_heads, d, device=dev)
        pos = torch.tensor([57], device=dev)
        want = ops.attention_decode(q, lc.k, lc.v, lc.pos, pos, window)
        got = fast_ops.attention_decode(q, lc.k, lc.v, lc.pos, pos, window)
        assert torch.allclose(got, want, atol=1e-4), i


def test_shapes_outside_the_kernels_fall_back(tiny_engine, monkeypatch) -> None:
    """Shapes the kernels do not cover run the reference bodies (never a kernel call)."""
    dev = tiny_engine.model.device
    fast_ops = FastOps()

    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran for a shape it does not cover")

    monkeypatch.setattr(fast_ops, "attention_for", no_kernel)
    monkeypatch.setattr(ops_fast, "w4_gemv", no_kernel)
    q = torch.randn(2, 4, 32, device=dev)  # two query tokens
    k = torch.randn(8, 1, 32, device=dev)
    pos = torch.arange(8, device=dev)
    qpos = torch.tensor([7, 7], device=dev)
    want = ops.attention_decode(q, k, k, pos, qpos, None)
    assert torch.equal(fast_ops.attention_decode(q, k, k, pos, qpos, None), want)
    k2 = torch.randn(8, 2, 32, device=dev)  # two KV heads
    want = ops.attention_decode(q[:1], k2, k2, pos, pos[-1:], None)
    assert torch.equal(fast_ops.attention_decode(q[:1], k2, k2, pos, pos[-1:], None), want)
    odd = ops.PackedLinear(torch.zeros(4, 2, dtype=torch.int32, device=dev),
                           torch.ones(4, 1, device=dev), 4, 16, group_size=16)  # fmt: skip
    x = torch.randn(1, 16, device=dev)
    assert torch.equal(fast_ops.linear4(x, odd), ops.linear4(x, odd))


def test_engine_picks_the_fast_path_once_at_load(tmp_path, monkeypatch) -> None:
    """EngineOptions(fast="force") sends the CPU through the branches CUDA takes by default:
    the generated tokens must be those of the reference path; the choice is the engine's
    (the environment is not read after load)."""
    make_checkpoint(tmp_path, preset="tiny", seed=3, emb4=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref_eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256, options=OFF)
    # no warm-up at load: on CUDA the graph is then captured inside generate, below, so the
    # counter sees the kernels' Python entry points run
    fast_eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256,
                           options=FORCE, warm_up=False)  # fmt: skip
    assert type(ref_eng.model.ops) is ops.Ops and isinstance(fast_eng.model.ops, FastOps)
    prompt = [2] + list(range(10, 50))
    ref = ref_eng.generate(prompt, SamplingParams(max_tokens=4, stop_ids=()))
    calls = {"gemv": 0}
    original = ops_fast.w4_gemv

    def counting(*a, **k):
        calls["gemv"] += 1
        return original(*a, **k)

    monkeypatch.setattr(ops_fast, "w4_gemv", counting)
    monkeypatch.setenv("GPURIG_FAST", "0")  # read by no one after load
    fast = fast_eng.generate(prompt, SamplingParams(max_tokens=4, stop_ids=()))
    assert calls["gemv"] > 0  # the dispatch really went through the Triton branches
    assert fast == ref
    assert fast_eng.runner.batched  # the fused step of a batch, one row here


def test_prologue_step_of_a_model_without_per_layer_inputs(tmp_path) -> None:
    """A model with no per-layer inputs: the down GEMV's residual+norm (with the layer scalar)
    goes into the next layer's q|k|v prologue."""
    overrides = {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                 "use_double_wide_mlp": False}  # fmt: skip
    make_checkpoint(tmp_path, preset="tiny", seed=5, emb4=True, overrides=overrides)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256)
    model = eng.model
    assert model.ple_table is None and supported(model, fuse_projections(model))
    prompt = [2] + list(range(10, 50))
    logits = prefill(model, sequence_cache(eng), prompt, 16)
    fused_cache = copy.deepcopy(sequence_cache(eng))
    decoder = _decoder(model, fused_cache)
    _three_steps_match_the_reference(model, sequence_cache(eng), decoder, logits, len(prompt))


@pytest.mark.parametrize("per_layer_inputs", [True, False])
def test_fused_prefill_chunks_fill_the_cache_as_the_reference_does(tmp_path, per_layer_inputs):
    """FusedPrefill.chunks against prefill_chunk(last=False): three 16-token chunks over a
    window-16 ring (it wraps), with and without per-layer inputs; every cache the same."""
    from engine.fast import prefill as fast_prefill

    overrides = {} if per_layer_inputs else {"hidden_size_per_layer_input": 0}
    make_checkpoint(tmp_path, preset="tiny", seed=4, emb4=True, overrides=overrides)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256)
    model = eng.model
    fused_layers = fuse_projections(model)
    assert fast_prefill.supported(model, fused_layers)
    assert (model.ple_table is not None) == per_layer_inputs
    ids = torch.tensor([2] + [int(t) for t in torch.randint(3, 500, (47,))], device=dev)
    ref_cache = sequence_cache(eng)
    reset(ref_cache)
    fast_cache = copy.deepcopy(ref_cache)
    fused = fast_prefill.FusedPrefill(model, fused_layers, FastOps())
    for start in (0, 16, 32):
        model.prefill_chunk(ids[start : start + 16], start, ref_cache, last=False)
        fused.chunks([(ids[start : start + 16], start, fast_cache)])
    assert len(ref_cache.layers) == model.cfg.first_shared_layer
    for i, layer in ref_cache.layers.items():
        other = fast_cache.layers[i]
        assert torch.equal(layer.pos, other.pos), i
        assert (layer.pos >= 0).any(), i  # the chunks really wrote
        assert torch.allclose(layer.k, other.k, atol=1e-5), i
        assert torch.allclose(layer.v, other.v, atol=1e-5), i


@pytest.mark.gpu  # ~70 s in the CPU interpreter; the sliced attention is tested on the CPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fused_prefill_in_score_slices_equals_one_whole_pass(tmp_path) -> None:
    """A prompt four windows long read by FusedPrefill in 24-token chunks whose attention
    walks slices of ~40 keys (full layers without a prefix mask): the cache and the last
    token's logits equal the reference's one whole pass."""
    from engine_support import read_prompt, sequence_cache

    from engine.fast import prefill as fast_prefill

    make_checkpoint(tmp_path, preset="tiny", seed=5, emb4=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256)
    model, cache = eng.model, sequence_cache(eng)
    prompt = [2] + [int(t) for t in torch.randint(3, 500, (63,))]
    whole = prefill(model, cache, prompt, len(prompt), score_budget=1 << 30).clone()
    want = {i: (c.k.clone(), c.v.clone()) for i, c in cache.layers.items()}
    fused = fast_prefill.FusedPrefill(model, fuse_projections(model), FastOps())
    reset(cache)
    ids = torch.tensor(prompt, device=dev)
    for start in range(0, len(prompt), 24):
        fused.chunks([(ids[start : start + 24], start, cache)], score_budget=2 * 24 * 40)
    for i, (k, v) in want.items():
        assert torch.allclose(cache.layers[i].k, k, atol=1e-5), i
        assert torch.allclose(cache.layers[i].v, v, atol=1e-5), i

    def step(token, position):
        return model.decode_step(token, position, cache)

    got = read_prompt(model, cache, prompt, 24, step)
    assert (got - whole).abs().max() < 1e-4


def test_generate_reads_prompts_through_the_fused_prefill(tmp_path, monkeypatch) -> None:
    """With the fast path forced, generate's prompt goes through FusedPrefill (body) and the
    decode step (last token); its greedy tokens equal the reference path's."""
    from engine.fast import prefill as fast_prefill

    calls = {"chunks": 0}
    real = fast_prefill.FusedPrefill.chunks

    def counted(self, segments, score_budget=None):
        calls["chunks"] += len(segments)
        return real(self, segments, score_budget)

    make_checkpoint(tmp_path, preset="tiny", seed=3, emb4=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prompt = [2] + list(range(30, 70))
    ref_eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256, options=OFF)
    ref = ref_eng.generate(prompt, SamplingParams(max_tokens=2, stop_ids=()))
    fast_eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256,
                           options=FORCE)  # fmt: skip
    monkeypatch.setattr(fast_prefill.FusedPrefill, "chunks", counted)
    fast = fast_eng.generate(prompt, SamplingParams(max_tokens=2, stop_ids=()))
    assert calls["chunks"] == -(-(len(prompt) - 1) // fast_eng.prefill_chunk)
    assert fast == ref


def test_fused_prefill_leaves_head_widths_its_kernel_cannot_span_to_the_model(tmp_path) -> None:
    """qkv_rope_rows spans a head with tl.arange, which takes powers of two only: a model with
    24/48-wide heads must read its prompt chunks through its own layer code, not crash."""
    from engine.fast import prefill as fast_prefill

    overrides = {"head_dim": 24, "global_head_dim": 48}
    make_checkpoint(tmp_path, preset="tiny", seed=6, emb4=True, overrides=overrides)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256, options=OFF)
    fast_eng = engine.load(tmp_path, device=dev, dtype=torch.float32, max_context=256,
                           options=FORCE)  # fmt: skip
    assert not fast_prefill.supported(fast_eng.model, fuse_projections(fast_eng.model))
    prompt = [2] + list(range(30, 50))
    ref = eng.generate(prompt, SamplingParams(max_tokens=3, stop_ids=()))
    assert fast_eng.generate(prompt, SamplingParams(max_tokens=3, stop_ids=())) == ref
