"""The engine against transformers' Gemma4ForCausalLM loaded from the very same checkpoint files.

transformers 5.24 loads a compressed-tensors W4A16 checkpoint on the CPU and decompresses it to
16/32-bit on its first forward; in float32 both sides then multiply the same exact weights
(q * scale is exact in fp32), so the only differences are summation order. Tolerances (logits are
O(1), |max| ~ 4):
- float32: |engine - transformers| < 1e-4 on every logit (observed <= 2e-5, the size of
  transformers' own float32-vs-float64 difference on these models);
- float64 (both sides; transformers still takes its softmax in fp32, which is what is left):
  < 2e-5 (observed <= 5e-6; 2e-16 when the prompt is read in one chunk);
- greedy continuations: identical.

For each tiny configuration (layer count, head widths, GQA, window, KV-shared layers, PLE width
including none and one not divisible by the group, so a plain linear is exercised) the engine
reads a prompt longer than the sliding window in chunks that do not divide it (33, 65, 97, and
one token at a time), then decodes 64+ tokens across the window; compared are
- every logit row (teacher-forced on the continuation, read in the first and the last chunk
  size) with transformers' one full forward, and
- the engine's own greedy continuation with transformers' argmax at every step given that prefix
  (which is transformers' greedy continuation), and once with transformers' generate().
"""

from __future__ import annotations

import pytest
import torch
from engine_support import prefill, sequence_cache

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.ops import PackedLinear, PlainLinear
from engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

LOGIT_ATOL = 1e-4
LOGIT_ATOL_FP64 = 2e-5
NEW_TOKENS = 48  # past every config's sliding window (the widest is 32)
PROMPT_LEN = 100  # over every window too: the prompt overflows the ring

_S, _F = "sliding_attention", "full_attention"

CONFIGS = {
    # the tiny preset: 6 layers, window 16, 2 shared layers, PLE 32, head widths 32 / 64
    "tiny-preset": ({}, [33, 65, 97, 512]),
    # no KV sharing, 2 KV heads for 4 query heads, wider heads, window 32, PLE 64
    "gqa-noshare": (
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "global_head_dim": 128,
            "sliding_window": 32,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 64,
            "layer_types": [_S, _F, _S, _F],
        },
        [65, 97],
    ),
    # most layers shared, window 8, PLE 16 (per_layer_projection stays plain: 16 % 32 != 0)
    "many-shared-ple16": (
        {
            "hidden_size": 96,
            "intermediate_size": 192,
            "num_hidden_layers": 7,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "global_head_dim": 64,
            "sliding_window": 8,
            "num_kv_shared_layers": 4,
            "hidden_size_per_layer_input": 16,
            "layer_types": [_S, _F, _S, _S, _F, _S, _F],
        },
        [33, 1],  # chunks of one token (the float64 pass below takes the first: 33)
    ),
    # full layers whose values are their raw keys (attention_k_eq_v: no v_proj there)
    "k-eq-v": ({"attention_k_eq_v": True}, [65]),
    # no per-layer embeddings, single-width MLP, no sharing (transformers 5.24 itself fails on
    # PLE-less models with KV sharing: _maybe_slice_kv_shared_inputs indexes a None)
    "no-ple": (
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "global_head_dim": 32,
            "sliding_window": 24,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "layer_types": [_S, _F, _F],
            "vocab_size": 1024,
        },
        [97],
    ),
}


def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def hf_reference(path, dtype=torch.float32):
    _quiet_transformers()
    model = transformers.Gemma4ForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval().to(dtype)


def engine_logits(eng, seq: list[int], prompt_len: int, chunk: int) -> torch.Tensor:
    """The engine's logits for positions prompt_len-1 .. len(seq)-2, teacher-forced on `seq`."""
    eng.prefill_chunk = chunk
    rows = [prefill(eng.model, sequence_cache(eng), seq[:prompt_len], chunk)]
    for pos in range(prompt_len, len(seq) - 1):
        tok = torch.tensor([seq[pos]])
        rows.append(eng.model.decode_step(tok, torch.tensor([pos]), sequence_cache(eng))[0])
    return torch.stack(rows)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    overrides, chunks = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    make_checkpoint(path, "tiny", seed=7, overrides=overrides)
    gen = torch.Generator().manual_seed(3)
    vocab = overrides.get("vocab_size", 512)
    prompt = [2] + torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=gen).tolist()
    return request.param, path, chunks, prompt, hf_reference(path)


def test_engine_matches_transformers(case):
    name, path, chunks, prompt, ref = case
    eng = engine.load(path, device="cpu", max_context=512)
    window = eng.config.sliding_window
    stored_plain = [
        w for layer in eng.model.layers for w in layer.linears() if isinstance(w, PlainLinear)
    ]
    ple_width = eng.config.hidden_size_per_layer_input
    # PLE 16 is narrower than a group of 32: per_layer_projection must stay plain, the rest 4-bit
    assert len(stored_plain) == (eng.config.num_hidden_layers if ple_width % 32 else 0)
    assert window < PROMPT_LEN  # the prompt overflows the sliding ring ...
    greedy = None
    for chunk in chunks:
        eng.prefill_chunk = chunk
        gen = eng.stream(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=()))
        out = list(gen)
        assert len(out) == NEW_TOKENS and gen.finish_reason == "length"
        if greedy is None:
            greedy = out
        assert out == greedy, f"{name}: chunk {chunk} changed the greedy continuation"

    seq = prompt + greedy
    with torch.no_grad():
        ref_logits = ref(torch.tensor([seq]), use_cache=False).logits[0].float()
    ref_rows = ref_logits[len(prompt) - 1 : len(seq) - 1]
    # ... and the decode crosses it: more new tokens than the window for every config
    assert window < NEW_TOKENS
    # transformers' greedy continuation given the same prefix is the engine's, token by token
    assert ref_rows.argmax(-1).tolist() == greedy, f"{name}: greedy tokens differ from transformers"
    for chunk in dict.fromkeys((chunks[0], chunks[-1])):  # every chunk's tokens agree (above)
        got = engine_logits(eng, seq, len(prompt), chunk)
        diff = (got.float() - ref_rows).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name}: chunk {chunk}: max |logit diff| {diff:.2e}"

    # float64 on both sides: the same comparison with a 10x tighter bound
    ref64 = hf_reference(path, torch.float64)
    with torch.no_grad():
        ref64_rows = ref64(torch.tensor([seq]), use_cache=False).logits[0, len(prompt) - 1 : -1]
    eng64 = engine.load(path, device="cpu", max_context=512, dtype=torch.float64)
    got64 = engine_logits(eng64, seq, len(prompt), chunks[0]).double()
    diff64 = (got64 - ref64_rows).abs().max().item()
    assert diff64 < LOGIT_ATOL_FP64, f"{name}: float64 max |logit diff| {diff64:.2e}"


def test_transformers_generate_agrees(tmp_path):
    """transformers' own generate() (its cache and sliding masks) gives the engine's tokens."""
    path = tmp_path / "ckpt"
    make_checkpoint(path, "tiny", seed=11)
    prompt = [2] + list(range(200, 300))
    ref = hf_reference(path)
    with torch.no_grad():
        hf = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    eng = engine.load(path, device="cpu", max_context=400, prefill_chunk=65)
    assert eng.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=())) == hf


def test_emb4_matches_dequantized_reference(tmp_path):
    """4-bit embeddings: the reference is transformers with embed_tokens (= lm_head) and the
    per-layer table replaced by the dequantized codes of the emb4 file (transformers cannot load
    4-bit embeddings itself); the linears come from the plain-embedding twin of the same seed."""
    from safetensors.torch import load_file

    from engine.ops import unpack_codes
    from engine.quantize import dequantize_codes

    plain, emb4 = tmp_path / "plain", tmp_path / "emb4"
    make_checkpoint(plain, "tiny", seed=5)
    make_checkpoint(emb4, "tiny", seed=5, emb4=True)
    ref = hf_reference(plain)
    stored = load_file(str(emb4 / "model.safetensors"))
    for table, module in (
        ("embed_tokens", ref.model.embed_tokens),
        ("embed_tokens_per_layer", ref.model.embed_tokens_per_layer),
    ):
        packed = stored[f"model.{table}.weight_packed"]
        width = int(stored[f"model.{table}.weight_shape"][1])
        w = dequantize_codes(unpack_codes(packed, width), stored[f"model.{table}.weight_scale"])
        with torch.no_grad():
            module.weight.copy_(w)
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()  # tied

    eng = engine.load(emb4, device="cpu", max_context=300, prefill_chunk=33)
    assert isinstance(eng.model.embed, PackedLinear) and isinstance(
        eng.model.ple_table, PackedLinear
    )
    assert eng.model.lm_head is eng.model.embed  # one copy serves both
    prompt = [2] + list(range(100, 180))
    out = eng.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=()))
    seq = prompt + out
    with torch.no_grad():
        ref_rows = ref(torch.tensor([seq]), use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    assert ref_rows.argmax(-1).tolist() == out
    got = engine_logits(eng, seq, len(prompt), 33)
    assert (got.float() - ref_rows).abs().max().item() < LOGIT_ATOL


def test_bfloat16_matches_transformers_bfloat16(tmp_path):
    """The GPU compute dtype, checked on the CPU: greedy tokens identical for 64 tokens, the
    prompt's last logit row equal within bf16 rounding (observed: exactly equal)."""
    path = tmp_path / "ckpt"
    make_checkpoint(path, "tiny", seed=7)
    _quiet_transformers()
    ref = transformers.Gemma4ForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(3)
    prompt = [2] + torch.randint(3, 512, (PROMPT_LEN - 1,), generator=gen).tolist()
    eng = engine.load(path, device="cpu", max_context=512, dtype=torch.bfloat16, prefill_chunk=33)
    out = eng.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=()))
    seq = prompt + out
    with torch.no_grad():
        ref_rows = ref(torch.tensor([seq]), use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    assert ref_rows.argmax(-1).tolist() == out
    first = prefill(eng.model, sequence_cache(eng), prompt, 33).float()
    assert (first - ref_rows[0]).abs().max().item() < 1e-2


def test_quantized_transformers_save_matches(tmp_path):
    """`quantize` on a checkpoint written by transformers' save_pretrained (bf16): transformers
    loads the W4A16 result, and the engine agrees with it."""
    from engine.checkpoint_maker import quantize_checkpoint, text_config_dict

    raw = text_config_dict("tiny")
    cfg = transformers.Gemma4TextConfig(
        **{k: v for k, v in raw.items() if k not in ("architectures", "per_layer_config")},
        global_head_dim=64,
    )
    torch.manual_seed(0)
    _quiet_transformers()
    transformers.Gemma4ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    make_checkpoint(tmp_path / "donor", "tiny")  # only for its tokenizer.json
    (tmp_path / "bf16" / "tokenizer.json").write_bytes(
        (tmp_path / "donor" / "tokenizer.json").read_bytes()
    )
    info = quantize_checkpoint(tmp_path / "bf16", tmp_path / "w4")
    assert info.quantized_linears == 51 and info.plain_linears == 0
    ref = hf_reference(tmp_path / "w4")
    eng = engine.load(tmp_path / "w4", device="cpu", max_context=512, prefill_chunk=33)
    prompt = [2] + list(range(100, 200))
    out = eng.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=()))
    seq = prompt + out
    with torch.no_grad():
        ref_rows = ref(torch.tensor([seq]), use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    assert ref_rows.argmax(-1).tolist() == out
    got = engine_logits(eng, seq, len(prompt), 33).float()
    assert (got - ref_rows).abs().max().item() < LOGIT_ATOL
