"""Config parsing against transformers' Gemma4TextConfig, and the E2B shape facts (no weights:
the e2b preset's 4.6 B random parameters are only written by hand, never in tests)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.checkpoint_maker import PRESETS, text_config_dict
from engine.config import FULL, SLIDING, parse_config
from engine.errors import CheckpointError
from engine.kv_pool import KVPool, plan_geometry
from engine.model import rope_inv_freq

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parse_agrees_with_transformers(preset):
    raw = text_config_dict(preset)
    ours = parse_config(raw)
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    modes = theirs.kv_sharing_modes
    for i in range(ours.num_hidden_layers):
        layer = theirs.per_layer_config[i]
        assert ours.layer_head_dims[i] == layer.head_dim
        assert ours.layer_kv_heads[i] == layer.num_key_value_heads
        assert (modes[i] == "reuse") == (i >= ours.first_shared_layer)
    stores = {i for i, mode in enumerate(modes) if mode == "store"}
    producers = {
        ours.kv_producer(j) for j in range(ours.first_shared_layer, ours.num_hidden_layers)
    }
    assert stores == producers  # the layers transformers stores K/V from are the engine's producers
    rot = (
        transformers.Gemma4ForCausalLM._from_config(theirs, dtype=torch.float32).model.rotary_emb
        if preset == "tiny"
        else None
    )
    if rot is not None:
        for kind in (SLIDING, FULL):
            assert torch.equal(getattr(rot, f"{kind}_inv_freq"), rope_inv_freq(ours.rope[kind]))


def test_absent_fields_take_transformers_defaults():
    absent = ("head_dim", "hidden_size_per_layer_input", "vocab_size_per_layer_input")
    raw = {k: v for k, v in text_config_dict("tiny").items() if k not in absent}
    ours = parse_config(raw)
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    dims = [theirs.per_layer_config[i].head_dim for i in range(ours.num_hidden_layers)]
    assert list(ours.layer_head_dims) == dims and 256 in dims
    assert ours.hidden_size_per_layer_input == theirs.hidden_size_per_layer_input
    assert ours.vocab_size_per_layer_input == theirs.vocab_size_per_layer_input


def test_e2b_shape():
    cfg = parse_config(text_config_dict("e2b"))
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [4, 9, 14, 19, 24, 29, 34]
    assert cfg.first_shared_layer == 15
    assert {cfg.kv_producer(i) for i in range(15, 35)} == {13, 14}
    assert cfg.kv_producer(19) == 14 and cfg.kv_producer(20) == 13
    assert cfg.mlp_width(14) == 6144 and cfg.mlp_width(15) == 12288
    assert cfg.layer_head_dims[4] == 512 and cfg.layer_head_dims[0] == 256
    full = rope_inv_freq(cfg.rope[FULL])
    assert full.shape == (256,) and (full[:64] > 0).all() and (full[64:] == 0).all()
    assert math.isclose(full[1].item(), 1e6 ** (-2 / 512), rel_tol=1e-6)  # denominator: all 512

    # 15 layers own a cache: 12 sliding rings of 512 and 3 full; one sequence of 131072 tokens
    # in bf16 ~ 774 MiB, plus the padding slot's ring and block (a one-sequence pool)
    geometry = plan_geometry(cfg, torch.bfloat16, 131072, 1 << 62, 1)
    pool = KVPool(cfg, geometry, torch.device("meta"), torch.bfloat16)
    kinds = [cfg.layer_types[i] for i in pool.k]
    assert kinds.count(SLIDING) == 12 and kinds.count(FULL) == 3
    assert geometry.num_blocks * geometry.block_size == 131072 + geometry.block_size
    kv = sum(t.numel() * t.element_size() for t in (*pool.k.values(), *pool.v.values()))
    own = 12 * 512 * 2 * 256 * 2 + 3 * 131072 * 2 * 512 * 2
    assert kv == own + 12 * 512 * 2 * 256 * 2 + 3 * geometry.block_size * 2 * 512 * 2
    assert round(own / 2**20) == 774


def test_e2b_parameter_count():
    cfg = parse_config(text_config_dict("e2b"))
    h, p, n = cfg.hidden_size, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    total = cfg.vocab_size * h + cfg.vocab_size_per_layer_input * n * p + n * p * h
    for i in range(n):
        hd, q = cfg.layer_head_dims[i], cfg.num_attention_heads * cfg.layer_head_dims[i]
        kv = 2 * hd * h if i < cfg.first_shared_layer else 0
        total += 2 * q * h + kv + 3 * h * cfg.mlp_width(i) + 2 * h * p
    assert round(total / 1e9, 2) == 4.63


def test_refusals():
    raw = text_config_dict("tiny")
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        parse_config({**raw, "enable_moe_block": True})
    with pytest.raises(CheckpointError, match="attention_bias"):
        parse_config({**raw, "attention_bias": True})
    with pytest.raises(CheckpointError, match="num_kv_shared_layers"):
        parse_config({**raw, "num_kv_shared_layers": 6})
    with pytest.raises(CheckpointError, match="vocab_size"):
        parse_config({k: v for k, v in raw.items() if k != "vocab_size"})
    bad_q = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 8, "symmetric": True, "group_size": 32}}},
    }
    with pytest.raises(CheckpointError, match="8-bit"):
        parse_config({**raw, "quantization_config": bad_q})
    with pytest.raises(CheckpointError, match="RoPE"):
        parse_config(
            {**raw, "rope_parameters": {SLIDING: {"rope_type": "yarn", "rope_theta": 1.0}}}
        )
    # the format named per group (the top level "mixed-precision" or absent) is read there
    per_group = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": {
            "g": {
                "format": "pack-quantized",
                "weights": {"num_bits": 4, "symmetric": True, "group_size": 128},
            }
        },
    }
    assert parse_config({**raw, "quantization_config": per_group}).quant.group_size == 128
    no_top = {k: v for k, v in per_group.items() if k != "format"}
    assert parse_config({**raw, "quantization_config": no_top}).quant.group_size == 128
    other = {**per_group, "config_groups": {"g": {**per_group["config_groups"]["g"]}}}
    other["config_groups"]["g"]["format"] = "float-quantized"
    with pytest.raises(CheckpointError, match="not supported"):
        parse_config({**raw, "quantization_config": other})
    actorder = {**per_group, "config_groups": {"g": {**per_group["config_groups"]["g"]}}}
    actorder["config_groups"]["g"]["weights"] = {
        **per_group["config_groups"]["g"]["weights"],
        "actorder": "group",
    }
    with pytest.raises(CheckpointError, match="actorder"):
        parse_config({**raw, "quantization_config": actorder})
    # a multimodal config with its text part under text_config
    outer = {"model_type": "gemma4", "text_config": raw}
    assert parse_config(outer).num_hidden_layers == raw["num_hidden_layers"]


def _options_table() -> dict[str, str]:
    """engine/options.py's table: field -> its GPURIG_* variable."""
    import re

    from engine import options

    rows = re.findall(r"^\| (GPURIG_\w+)\s*\| (\w+)\s*\|", options.__doc__ or "", re.M)
    return {field: name for name, field in rows}


def test_engine_options_are_few_each_documented_declared_and_read():
    """At most eight switches (what a user would set, or a won feature's fallback); each has a
    row in engine/options.py's table, its variable is declared in engine/env.py, and setting
    that variable changes that field (and no other)."""
    import dataclasses
    from pathlib import Path

    from engine import env
    from engine.options import EngineOptions

    names = [f.name for f in dataclasses.fields(EngineOptions)]
    assert len(names) <= 8, names
    table = _options_table()
    assert sorted(table) == sorted(names)
    assert set(table.values()) <= set(env.VARIABLES)
    values = {"GPURIG_FAST": "0", "GPURIG_KERNEL_CACHE": "/tmp/k", "GPURIG_COMPILE_THREADS": "3"}
    default = EngineOptions()
    for field, name in table.items():
        changed = EngineOptions.from_env({name: values.get(name, "0")})
        differs = [n for n in names if getattr(changed, n) != getattr(default, n)]
        assert differs == [field], (name, differs)
    assert EngineOptions.from_env({"GPURIG_KERNEL_CACHE": "/tmp/k"}).tuning_cache_dir == Path(
        "/tmp/k"
    )


def test_the_lost_experiments_left_no_variable_behind():
    from engine import env

    lost = ("GPURIG_CUDA_GEMV", "GPURIG_CARVEOUT", "GPURIG_FOLD_RESIDUAL", "GPURIG_FOLD_TAIL",
            "GPURIG_STEPS_FIRST", "GPURIG_DEFER_OUTPUTS", "GPURIG_FAST_PREFILL",
            "GPURIG_PASS_ATTENTION", "GPURIG_BATCH_PROLOGUE", "GPURIG_MMA_AHEAD",
            "GPURIG_GREEDY_TAIL", "GPURIG_GEMV_H2", "GPURIG_PREFIX_SDPA",
            "GPURIG_EXPANDABLE_SEGMENTS")  # fmt: skip
    assert not set(lost) & set(env.VARIABLES)
    with pytest.raises(KeyError, match="not a declared"):
        env.read("GPURIG_CUDA_GEMV")
