"""Write random-weight Gemma 4 checkpoints in the real format, and quantize 16-bit ones to W4A16.

`make_checkpoint` produces what a published W4A16 Gemma 4 text checkpoint holds: config.json with a
compressed-tensors `quantization_config`, safetensors (sharded past 2 GiB), generation_config.json,
a synthetic byte-level tokenizer.json with the real special ids, tokenizer_config.json and the
project's chat template. Presets: `tiny` and `small` for tests on a CPU, `e2b` for the real E2B
shape (4.6 B parameters: its weights are generated, quantized and written one tensor at a time, so
it fits in host memory). `quantize_checkpoint` turns a 16-bit Gemma 4 checkpoint into the same
W4A16 format, tensor by tensor.

Which weights are 4-bit: every Linear of the text model (attention, MLP, the per-layer-input gate
and projection, per_layer_model_projection) whose input width is a multiple of the group size;
the others are stored plain and listed in `ignore`, as is lm_head (tied to embed_tokens). The
embedding tables stay 16-bit unless `emb4`, which stores embed_tokens and embed_tokens_per_layer
as 4-bit codes in the same packed layout (see engine/FORMAT.md). An emb4 checkpoint is for this
engine only: transformers cannot load 4-bit embeddings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from engine.checkpoint import CheckpointReader, ShardWriter
from engine.config import FULL, SLIDING, parse_config, read_config_json
from engine.errors import CheckpointError
from engine.quantize import pack_codes, quantize_groups
from engine.tokenizer_synth import GENERATION_EOS_IDS, build_tokenizer, tokenizer_config

GROUP_SIZE = 32
LINEAR_SUFFIXES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
)
EMBED_TABLES = ("embed_tokens", "embed_tokens_per_layer")
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat" / "gemma4_chat_template.jinja"

_S, _F = SLIDING, FULL

# The last layer owning a KV cache is full and the one before it sliding, as in the real E2B
# (layers 14 and 13): llama.cpp's Gemma 4 takes a KV-shared layer's cache from exactly those two
# (tools/llamacpp.py refuses other orders), so every preset exports to a GGUF it can load.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 64,
        "sliding_window": 16,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 32,
        "layer_types": [_S, _S, _S, _F, _S, _F],
        "max_position_embeddings": 4096,
    },
    "small": {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "global_head_dim": 128,
        "sliding_window": 64,
        "num_kv_shared_layers": 3,
        "hidden_size_per_layer_input": 64,
        "layer_types": [_S, _S, _S, _S, _F, _S, _S, _F],
        "max_position_embeddings": 8192,
    },
    "e2b": {
        "vocab_size": 262144,
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "sliding_window": 512,
        "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256,
        "layer_types": [_F if i % 5 == 4 else _S for i in range(35)],
        "max_position_embeddings": 131072,
    },
}


class CheckpointInfo(BaseModel):
    """What a make / quantize run wrote."""

    path: str
    preset: str | None
    parameters: int
    bytes_on_disk: int
    files: list[str]
    quantized_linears: int
    plain_linears: int
    emb4: bool


def text_config_dict(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """config.json of a Gemma4ForCausalLM for a preset, as transformers 5.24 saves one."""
    if preset not in PRESETS:
        raise CheckpointError(f"unknown preset {preset!r}", f"use one of {', '.join(PRESETS)}")
    p = {**PRESETS[preset], **overrides}
    n = p["num_hidden_layers"]
    layer_types = list(p.get("layer_types") or [_F if i % 6 == 5 else _S for i in range(n)])
    if len(layer_types) != n:
        raise CheckpointError(
            f"layer_types has {len(layer_types)} entries for {n} layers", "fix the overrides"
        )
    global_head_dim = p.pop("global_head_dim")
    cfg: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "enable_moe_block": False,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
        "num_experts": None,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            _F: {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
                "rope_type": "proportional",
            },
            _S: {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        "tie_word_embeddings": True,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": True,
    }
    cfg.update({k: v for k, v in p.items() if k != "layer_types"})
    cfg["layer_types"] = layer_types
    cfg.setdefault("vocab_size_per_layer_input", cfg["vocab_size"])
    cfg["per_layer_config"] = {
        str(i): {"head_dim": global_head_dim} for i, t in enumerate(layer_types) if t == _F
    }
    return cfg


# ---------------------------------------------------------------------------------------------
# random weights


def _random_weights(cfg: dict[str, Any], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's 16-bit (bf16) weights, one tensor at a time, in a fixed order.

    Linears ~ N(0, 1/in), embeddings ~ N(0, 1/hidden) (so embed * sqrt(hidden) is unit scale),
    norm weights 1 + N(0, 0.1), q/k norm weights scaled by head_dim**-0.25 (attention scale is
    1.0, so this keeps scores O(1) as a trained model's norms do), layer_scalar U(0.5, 1): random
    but well-conditioned, so greedy tokens are not decided by rounding noise.
    """
    tc = parse_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    h, p, n = tc.hidden_size, tc.hidden_size_per_layer_input, tc.num_hidden_layers

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16)
        rows = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
        for start in range(0, shape[0], rows):  # in blocks: the e2b tables are billions of values
            block = torch.randn((min(rows, shape[0] - start), *shape[1:]), generator=gen) * std
            out[start : start + block.shape[0]] = block.to(torch.bfloat16)
        return out

    def linear(n_out: int, n_in: int) -> torch.Tensor:
        return normal((n_out, n_in), n_in**-0.5)

    def norm(width: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * (1.0 + 0.1 * torch.randn(width, generator=gen))).to(torch.bfloat16)

    yield "embed_tokens.weight", normal((tc.vocab_size, h), h**-0.5)
    if p:
        yield (
            "embed_tokens_per_layer.weight",
            normal((tc.vocab_size_per_layer_input, n * p), p**-0.5),
        )
        yield "per_layer_model_projection.weight", linear(n * p, h)
        yield "per_layer_projection_norm.weight", norm(p)
    for i in range(n):
        hd, kvh, hq = tc.layer_head_dims[i], tc.layer_kv_heads[i], tc.num_attention_heads
        pre = f"layers.{i}."
        yield pre + "input_layernorm.weight", norm(h)
        yield pre + "self_attn.q_proj.weight", linear(hq * hd, h)
        yield pre + "self_attn.q_norm.weight", norm(hd, hd**-0.25)
        if i < tc.first_shared_layer:
            yield pre + "self_attn.k_proj.weight", linear(kvh * hd, h)
            if not (tc.attention_k_eq_v and not tc.is_sliding(i)):  # k_eq_v: values = keys
                yield pre + "self_attn.v_proj.weight", linear(kvh * hd, h)
            yield pre + "self_attn.k_norm.weight", norm(hd, hd**-0.25)
        yield pre + "self_attn.o_proj.weight", linear(h, hq * hd)
        yield pre + "post_attention_layernorm.weight", norm(h)
        yield pre + "pre_feedforward_layernorm.weight", norm(h)
        width = tc.mlp_width(i)
        yield pre + "mlp.gate_proj.weight", linear(width, h)
        yield pre + "mlp.up_proj.weight", linear(width, h)
        yield pre + "mlp.down_proj.weight", linear(h, width)
        yield pre + "post_feedforward_layernorm.weight", norm(h)
        if p:
            yield pre + "per_layer_input_gate.weight", linear(p, h)
            yield pre + "per_layer_projection.weight", linear(h, p)
            yield pre + "post_per_layer_input_norm.weight", norm(h)
        yield pre + "layer_scalar", (0.5 + 0.5 * torch.rand(1, generator=gen)).to(torch.bfloat16)
    yield "norm.weight", norm(h)


# ---------------------------------------------------------------------------------------------
# quantizing a stream of tensors


def _is_linear(name: str) -> bool:
    return (
        name.endswith(".weight") and name[: -len(".weight")].rsplit(".", 1)[-1] in LINEAR_SUFFIXES
    )


def _is_embed_table(name: str) -> bool:
    return name in tuple(f"{t}.weight" for t in EMBED_TABLES)


class _Quantizer:
    """Turns (name, 16-bit tensor) pairs into the W4A16 tensors to store, and records `ignore`."""

    def __init__(self, emb4: bool, module_prefix: str) -> None:
        self.emb4 = emb4
        self.module_prefix = module_prefix  # "model." or "model.language_model."
        self.ignore: list[str] = ["lm_head"]
        self.quantized = 0
        self.plain = 0
        self.parameters = 0

    def convert(self, name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        self.parameters += w.numel()
        quantize = (_is_linear(name) or (self.emb4 and _is_embed_table(name))) and w.dim() == 2
        if quantize and w.shape[1] % GROUP_SIZE == 0:
            module = name[: -len(".weight")]
            packed, scales = _quantize_in_blocks(w)
            yield f"{module}.weight_packed", packed
            yield f"{module}.weight_scale", scales
            yield f"{module}.weight_shape", torch.tensor(list(w.shape), dtype=torch.int64)
            if _is_linear(name):
                self.quantized += 1
            return
        if _is_linear(name):
            self.plain += 1
            self.ignore.append(self.module_prefix + name[: -len(".weight")])
        yield name, w.to(torch.bfloat16) if w.is_floating_point() else w


def _quantize_in_blocks(w: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups + pack_codes a block of rows at a time: the E2B per-layer table is 2.3 G
    values, whose fp32 copy alone would not fit in host memory."""
    packed, scales = [], []
    for start in range(0, w.shape[0], rows):
        codes, sc = quantize_groups(w[start : start + rows], GROUP_SIZE)
        packed.append(pack_codes(codes))
        scales.append(sc)
    return torch.cat(packed), torch.cat(scales)


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors' quantization_config for W4A16 group-32 symmetric pack-quantized."""
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "group_size": GROUP_SIZE,
                    "strategy": "group",
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _emb4_note() -> dict[str, Any]:
    return {
        "tables": list(EMBED_TABLES),
        "layout": "pack-quantized rows: <table>.weight_packed int32 [V, W/8], .weight_scale bf16 "
        "[V, W/32], .weight_shape int64 [V, W]; symmetric, w = q * scale",
        "spec": "engine/FORMAT.md",
    }


def _write_side_files(writer: ShardWriter, max_length: int, vocab_size: int) -> None:
    writer.write_file("tokenizer.json", build_tokenizer(vocab_size).to_str())
    writer.write_file("tokenizer_config.json", tokenizer_config(max_length))
    writer.write_file(
        "generation_config.json",
        json.dumps(
            {
                "bos_token_id": 2,
                "eos_token_id": GENERATION_EOS_IDS,
                "pad_token_id": 0,
                "do_sample": False,
            },
            indent=2,
        )
        + "\n",
    )
    if CHAT_TEMPLATE.is_file():
        writer.copy_file(CHAT_TEMPLATE, "chat_template.jinja")


def make_checkpoint(
    out_dir: Path | str,
    preset: str = "tiny",
    seed: int = 0,
    emb4: bool = False,
    quantized: bool = True,
    overrides: dict[str, Any] | None = None,
    max_shard_bytes: int = 2 << 30,
) -> CheckpointInfo:
    """Write a random-weight Gemma 4 checkpoint (W4A16 unless `quantized=False`) to `out_dir`.

    `overrides` patches the preset's config fields (layer count, head widths, window, shared
    layers, PLE width, ...), which is how the tests build several tiny shapes.
    """
    out = Path(out_dir)
    cfg = text_config_dict(preset, **(overrides or {}))
    quant = _Quantizer(emb4=emb4 and quantized, module_prefix="model.")
    with ShardWriter(out, max_shard_bytes=max_shard_bytes) as writer:
        for name, w in _random_weights(cfg, seed):
            if quantized:
                writer.add_all(quant.convert(name, w))
            else:
                quant.parameters += w.numel()
                quant.plain += _is_linear(name)  # every linear stays 16-bit here
                writer.add(name, w)
        if quantized:
            cfg["quantization_config"] = quantization_config(quant.ignore)
            if emb4:
                cfg["gpurig_emb4"] = _emb4_note()
        writer.write_file("config.json", json.dumps(cfg, indent=2) + "\n")
        _write_side_files(writer, cfg["max_position_embeddings"], cfg["vocab_size"])
    return _info(out, preset, quant, emb4 and quantized)


def quantize_checkpoint(
    in_dir: Path | str, out_dir: Path | str, emb4: bool = False, max_shard_bytes: int = 2 << 30
) -> CheckpointInfo:
    """Quantize a 16-bit Gemma 4 checkpoint (either key prefix) to W4A16 group 32 in `out_dir`.

    Tensors outside the text model (vision / audio towers) are copied as they are and their
    modules are kept out of the quantization scheme. Side files (tokenizer, templates,
    generation_config) are copied.
    """
    src, out = Path(in_dir), Path(out_dir)
    raw = read_config_json(src)
    parse_config(raw)  # refuses a non-Gemma-4 model before anything is written
    if raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config"):
        raise CheckpointError(f"{src} is already quantized", "quantize a 16-bit checkpoint")
    reader = CheckpointReader(src)
    prefix = "model.language_model." if raw.get("model_type") == "gemma4" else "model."
    quant = _Quantizer(emb4=emb4, module_prefix=prefix)
    with ShardWriter(out, max_shard_bytes=max_shard_bytes, prefix=prefix) as writer:
        for name in reader.names():
            writer.add_all(quant.convert(name, reader.tensor(name)))
        for key, tensor in _other_towers(src):
            writer.add_raw(key, tensor)
        if raw.get("model_type") == "gemma4":
            quant.ignore += [
                "re:.*vision_tower.*",
                "re:.*audio_tower.*",
                "re:.*embed_vision.*",
                "re:.*embed_audio.*",
            ]
        raw["quantization_config"] = quantization_config(quant.ignore)
        if emb4:
            raw["gpurig_emb4"] = _emb4_note()
        writer.write_file("config.json", json.dumps(raw, indent=2) + "\n")
        for side in (
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
            "chat_template.json",
            "special_tokens_map.json",
            "processor_config.json",
            "preprocessor_config.json",
        ):
            if (src / side).is_file():
                writer.copy_file(src / side, side)
    return _info(out, None, quant, emb4)


def _other_towers(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a multimodal checkpoint outside the text model, under their full keys."""
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if key.startswith(
                    (
                        "model.vision_tower.",
                        "model.audio_tower.",
                        "model.embed_vision.",
                        "model.embed_audio.",
                    )
                ):
                    yield key, f.get_tensor(key)


def _info(out: Path, preset: str | None, quant: _Quantizer, emb4: bool) -> CheckpointInfo:
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir() if p.suffix == ".safetensors")
    return CheckpointInfo(
        path=str(out),
        preset=preset,
        parameters=quant.parameters,
        bytes_on_disk=size,
        files=files,
        quantized_linears=quant.quantized,
        plain_linears=quant.plain,
        emb4=emb4,
    )
