"""Checkpoint I/O: the real compressed-tensors format, codes reaching the device unchanged,
sharded files with either key prefix, quantization, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import engine
from engine.checkpoint import INDEX_NAME, CheckpointReader, ShardWriter
from engine.checkpoint_maker import make_checkpoint, quantize_checkpoint
from engine.errors import CheckpointError
from engine.ops import PackedLinear, unpack_codes
from engine.quantize import dequantize_codes, pack_codes, quantize_groups
from engine.sampling import SamplingParams

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(path, "tiny", seed=1)
    return path


def _stored(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                out[key] = f.get_tensor(key)
    return out


def _device_linears(model) -> dict[str, PackedLinear]:
    """Every packed weight the loaded model holds, by its module name in the checkpoint."""
    found = {
        "embed_tokens": model.embed,
        "embed_tokens_per_layer": model.ple_table,
        "per_layer_model_projection": model.ple_projection,
    }
    names = {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
        "ple_gate": "per_layer_input_gate",
        "ple_proj": "per_layer_projection",
    }
    for i, layer in enumerate(model.layers):
        for attr, name in names.items():
            found[f"layers.{i}.{name}"] = getattr(layer, attr)
    return {k: v for k, v in found.items() if isinstance(v, PackedLinear)}


def test_files_and_config_are_the_real_format(tiny):
    files = {p.name for p in tiny.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= files
    cfg = json.loads((tiny / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["quantization_status"] == "compressed" and "lm_head" in q["ignore"]
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 32, True, "group")
    stored = _stored(tiny)
    packed = stored["model.layers.0.self_attn.q_proj.weight_packed"]
    scale = stored["model.layers.0.self_attn.q_proj.weight_scale"]
    shape = stored["model.layers.0.self_attn.q_proj.weight_shape"].tolist()
    assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16
    assert list(packed.shape) == [shape[0], shape[1] // 8]
    assert list(scale.shape) == [shape[0], shape[1] // 32]
    assert "model.embed_tokens.weight" in stored  # 16-bit tables without --emb4
    # compressed-tensors' own config model accepts it
    from compressed_tensors.quantization import QuantizationConfig

    QuantizationConfig.model_validate(q)
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == [1, 106, 50]


def test_packing_matches_compressed_tensors():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (48, 256), generator=gen, dtype=torch.int8)
    ours = pack_codes(codes)
    theirs = ct_helpers.pack_to_int32(codes, 4)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_codes(ours, 256), codes)
    assert torch.equal(ct_helpers.unpack_from_int32(ours, 4, torch.Size([48, 256])), codes)


def test_quantization_rule():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 128, generator=gen) * torch.rand(16, 1, generator=gen)
    codes, scales = quantize_groups(w, 32)
    groups = w.reshape(16, 4, 32).abs().amax(-1)
    assert torch.equal(scales, (groups / 7.5).to(torch.bfloat16))
    assert codes.min() >= -8 and codes.max() <= 7 and (codes == -8).any()
    err = (dequantize_codes(codes, scales) - w).abs().reshape(16, 4, 32).amax(-1)
    assert (err <= 0.55 * scales.float()).all()  # half a step (+ the bf16 rounding of the step)


@pytest.mark.parametrize("emb4", [False, True])
def test_every_code_reaches_the_device_unchanged(tmp_path, emb4):
    path = tmp_path / "ckpt"
    make_checkpoint(path, "tiny", seed=2, emb4=emb4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    eng = engine.load(path, device=device, max_context=64)
    on_device = _device_linears(eng.model)
    stored = _stored(path)
    packed_keys = [k for k in stored if k.endswith(".weight_packed")]
    assert len(packed_keys) == len(on_device) and packed_keys
    for key in packed_keys:
        name = key.removeprefix("model.").removesuffix(".weight_packed")
        w = on_device[name]
        assert w.packed.device.type == device
        shape = torch.Size(stored[key.replace("_packed", "_shape")].tolist())
        file_codes = ct_helpers.unpack_from_int32(stored[key], 4, shape)
        assert torch.equal(unpack_codes(w.packed.cpu(), w.in_features), file_codes), name
        assert torch.equal(w.packed.cpu(), stored[key]), name
        file_scale = stored[key.replace("_packed", "_scale")]
        assert w.scales.dtype == file_scale.dtype and torch.equal(w.scales.cpu(), file_scale), name
    assert ("model.embed_tokens.weight_packed" in stored) == emb4


def _as_multimodal_sharded(src: Path, dst: Path, max_shard_bytes: int) -> None:
    """Rewrite a Gemma4ForCausalLM checkpoint as a Gemma4ForConditionalGeneration one (text under
    model.language_model.*, config under text_config), in several shards."""
    cfg = json.loads((src / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    quant["ignore"] = [
        n.replace("model.", "model.language_model.", 1) if n != "lm_head" else n
        for n in quant["ignore"]
    ]
    outer = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": cfg,
        "quantization_config": quant,
        "tie_word_embeddings": True,
    }
    reader = CheckpointReader(src)
    with ShardWriter(dst, max_shard_bytes=max_shard_bytes, prefix="model.language_model.") as w:
        for name in reader.names():
            w.add(name, reader.tensor(name))
        w.add_raw("model.vision_tower.dummy.weight", torch.zeros(4, 4))  # ignored by the engine
        w.write_file("config.json", json.dumps(outer))
        for side in ("tokenizer.json", "generation_config.json"):
            w.copy_file(src / side, side)


def test_sharded_multimodal_prefix_loads_the_same(tiny, tmp_path):
    mm = tmp_path / "mm"
    _as_multimodal_sharded(tiny, mm, max_shard_bytes=60_000)
    index = json.loads((mm / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (mm / "model.safetensors").exists()
    assert all(
        k.startswith(("model.language_model.", "model.vision_tower.")) for k in index["weight_map"]
    )
    prompt = [2] + list(range(50, 90))
    a = engine.load(tiny, device="cpu", max_context=128).generate(
        prompt, SamplingParams(max_tokens=20, stop_ids=())
    )
    b = engine.load(mm, device="cpu", max_context=128).generate(
        prompt, SamplingParams(max_tokens=20, stop_ids=())
    )
    assert a == b

    index_path = mm / INDEX_NAME
    misplaced = json.loads(index_path.read_text())
    key = "model.language_model.norm.weight"
    misplaced["weight_map"][key] = next(s for s in shards if s != index["weight_map"][key])
    index_path.write_text(json.dumps(misplaced))
    with pytest.raises(CheckpointError, match="norm.weight"):  # the index points elsewhere
        engine.load(mm, device="cpu", max_context=128)
    index_path.write_text(json.dumps(index))

    (mm / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=shards[1]):
        engine.load(mm, device="cpu", max_context=128)


def test_refuses_other_model_types(tiny, tmp_path):
    other = tmp_path / "llama"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="Gemma 4") as info:
        engine.load(other, device="cpu")
    assert info.value.remedy


def test_refuses_missing_files(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        engine.load(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text("[1, 2]")  # JSON, but not a config
    with pytest.raises(CheckpointError, match="not a JSON object"):
        engine.load(tmp_path, device="cpu")
    partial = tmp_path / "partial"
    shutil.copytree(tiny, partial)
    (partial / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        engine.load(partial, device="cpu")


def test_refuses_to_overwrite(tiny):
    with pytest.raises(CheckpointError, match="not empty"):
        make_checkpoint(tiny, "tiny")
    assert (tiny / "model.safetensors").is_file()  # untouched


def test_quantize_equals_make(tmp_path):
    """quantize(16-bit random checkpoint) == the W4A16 checkpoint made from the same weights."""
    plain, quant, made = tmp_path / "bf16", tmp_path / "q", tmp_path / "made"
    make_checkpoint(
        plain, "tiny", seed=4, quantized=False, overrides={"hidden_size_per_layer_input": 16}
    )
    info = quantize_checkpoint(plain, quant)
    make_checkpoint(made, "tiny", seed=4, overrides={"hidden_size_per_layer_input": 16})
    a, b = _stored(quant), _stored(made)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    qa = json.loads((quant / "config.json").read_text())["quantization_config"]
    qb = json.loads((made / "config.json").read_text())["quantization_config"]
    assert qa == qb and "model.layers.0.per_layer_projection" in qa["ignore"]
    assert info.plain_linears == 6 and info.quantized_linears > 0
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(quant, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_untied_lm_head_is_loaded_separately(tiny, tmp_path):
    untied = tmp_path / "untied"
    reader = CheckpointReader(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    with ShardWriter(untied) as w:
        for name in reader.names():
            w.add(name, reader.tensor(name))
        lm_head = reader.tensor("embed_tokens.weight").clone()  # same values, its own copy
        w.add("lm_head.weight", lm_head)
        w.write_file("config.json", json.dumps(cfg))
        w.copy_file(tiny / "tokenizer.json", "tokenizer.json")
    a = engine.load(tiny, device="cpu", max_context=64)
    b = engine.load(untied, device="cpu", max_context=64)
    assert b.model.lm_head is not b.model.embed and a.model.lm_head is a.model.embed
    assert b.memory_report().lm_head_bytes == a.memory_report().embed_lm_head_bytes
    prompt = [2] + list(range(10, 30))
    assert a.generate(prompt, SamplingParams(max_tokens=8, stop_ids=())) == b.generate(
        prompt, SamplingParams(max_tokens=8, stop_ids=())
    )


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails half way (here: after two shards are on disk) leaves neither the
    target directory nor a temporary sibling behind."""
    import engine.checkpoint_maker as maker

    calls = {"n": 0}
    real = maker._quantize_in_blocks

    def failing(w):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError("disk full")
        return real(w)

    monkeypatch.setattr(maker, "_quantize_in_blocks", failing)
    with pytest.raises(CheckpointError, match="disk full") as info:
        make_checkpoint(tmp_path / "out", "tiny", max_shard_bytes=20_000)
    assert calls["n"] == 20 and info.value.remedy
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create"):  # its parent is a file
        make_checkpoint(tmp_path / "a-file" / "out", "tiny")
