"""The Gemma 4 text configuration the engine needs, read from a checkpoint's config.json.

A real checkpoint is a `Gemma4ForConditionalGeneration` (model_type "gemma4", the text part under
"text_config"); a `Gemma4ForCausalLM` save is flat (model_type "gemma4_text"). Both give the same
`TextConfig`. Everything the forward pass depends on is resolved here once (per-layer head
widths, which layer stores or reuses K/V, RoPE per layer type), so the model code reads plain
attributes and never re-derives transformers' rules. transformers 5.24's Gemma4TextConfig is the
reference for every default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError

SLIDING = "sliding_attention"
FULL = "full_attention"

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type: 'default' rotates every dim, 'proportional' a leading fraction."""

    rope_type: str
    theta: float
    head_dim: int
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def rotated_pairs(self) -> int:
        """How many of the head_dim / 2 dim pairs rotate (the rest have frequency zero).

        'default' rotates all; 'proportional' (full layers of Gemma 4) the first
        int(p * head_dim / 2), with exponent 2j / head_dim (the FULL width as denominator).
        """
        if self.rope_type == "default":
            return self.head_dim // 2
        if self.rope_type == "proportional":
            return int(self.partial_rotary_factor * self.head_dim // 2)
        raise CheckpointError(
            f"RoPE type {self.rope_type!r} is not supported by the engine",
            "use a Gemma 4 checkpoint (RoPE 'default' on sliding layers, 'proportional' on full)",
        )


@dataclass(frozen=True)
class QuantSpec:
    """The compressed-tensors quantization the checkpoint declares (W4A16 pack-quantized)."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    format: str = "pack-quantized"
    ignore: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextConfig:
    """Every field of the Gemma 4 text model the engine uses, plus per-layer derived facts."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    sliding_window: int
    num_kv_shared_layers: int
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    rope: dict[str, RopeSpec]
    final_logit_softcapping: float | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    use_double_wide_mlp: bool
    attention_k_eq_v: bool
    hidden_activation: str
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quant: QuantSpec | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived facts -------------------------------------------------------------------
    @property
    def first_shared_layer(self) -> int:
        """Index of the first layer that reuses another layer's K/V (num_layers when none)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_producer(self, layer: int) -> int:
        """The layer whose cached K/V `layer` attends over: itself, or for a shared layer the
        last own-KV layer of the same type (transformers' kv_sharing_modes 'store')."""
        if layer < self.first_shared_layer:
            return layer
        kind = self.layer_types[layer]
        for i in range(self.first_shared_layer - 1, -1, -1):
            if self.layer_types[i] == kind:
                return i
        raise CheckpointError(
            f"layer {layer} ({kind}) shares K/V but no earlier layer of that type computes any",
            "fix layer_types / num_kv_shared_layers in config.json",
        )

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def mlp_width(self, layer: int) -> int:
        doubled = self.use_double_wide_mlp and layer >= self.first_shared_layer
        return self.intermediate_size * (2 if doubled else 1)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @property
    def per_layer_embed_scale(self) -> float:
        return math.sqrt(self.hidden_size_per_layer_input)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict, or a CheckpointError saying what is missing."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist",
            "point at a checkpoint directory holding config.json (make one with "
            "`gpurig engine make-checkpoint`)",
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}", "restore the file") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object", "restore the file")
    return raw


def load_config(model_dir: Path) -> TextConfig:
    """Read and validate config.json (and generation_config.json for the stop ids)."""
    raw = read_config_json(model_dir)
    cfg = parse_config(raw)
    eos = read_generation_config(Path(model_dir)).eos_token_ids
    if eos:
        cfg = replace(cfg, eos_token_ids=eos)
    return cfg


@dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint's generation_config.json says about generating: its stop ids, and
    whether (and how) it samples by default."""

    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling defaults a server applies, as vLLM does: a checkpoint that samples by
        default (do_sample) gets its temperature/top_p/top_k; otherwise greedy."""
        if not self.do_sample:
            return {"temperature": 0.0}
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def read_generation_config(model_dir: Path) -> GenerationConfig:
    """generation_config.json of a checkpoint; the defaults when it has none. A file that is
    not a JSON object is a CheckpointError (refused at load, not guessed around)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}", "restore the file") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object", "restore the file")
    top_k, top_p, temperature = raw.get("top_k"), raw.get("top_p"), raw.get("temperature")
    return GenerationConfig(
        eos_token_ids=_as_ids(raw.get("eos_token_id")),
        do_sample=bool(raw.get("do_sample")),
        temperature=float(temperature) if isinstance(temperature, int | float) else 1.0,
        # transformers reads top_k 0 and top_p 1.0 as "off"; so do we
        top_k=top_k if isinstance(top_k, int) and top_k > 0 else None,
        top_p=float(top_p) if isinstance(top_p, int | float) and 0 < top_p < 1 else None,
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_config(raw: dict[str, Any]) -> TextConfig:
    """Turn a config.json dict (multimodal or text-only) into a `TextConfig`."""
    model_type = raw.get("model_type")
    if model_type == "gemma4":
        text = dict(raw.get("text_config") or {})
        if not text:
            raise CheckpointError("config.json of a gemma4 model has no text_config", "restore it")
        quant_raw = raw.get("quantization_config") or text.get("quantization_config")
        tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    elif model_type == "gemma4_text":
        text = dict(raw)
        quant_raw = raw.get("quantization_config")
        tie = bool(raw.get("tie_word_embeddings", True))
    else:
        archs = raw.get("architectures")
        raise CheckpointError(
            f"config.json describes model_type {model_type!r} (architectures {archs}); "
            "the engine runs Gemma 4 only (model_type 'gemma4' or 'gemma4_text')",
            "use a Gemma 4 checkpoint, e.g. one written by `gpurig engine make-checkpoint`",
        )
    if text.get("enable_moe_block"):
        raise CheckpointError(
            "this Gemma 4 checkpoint uses mixture-of-experts blocks, which the engine does not run",
            "use a dense Gemma 4 (E2B / E4B class) checkpoint",
        )
    if text.get("attention_bias"):
        raise CheckpointError(
            "this checkpoint's attention projections have biases (attention_bias), which the "
            "engine does not apply",
            "use a Gemma 4 checkpoint without attention biases (every released one)",
        )
    if text.get("use_bidirectional_attention") == "all":
        raise CheckpointError(
            "bidirectional attention ('all') is not a causal language model",
            "use a causal Gemma 4 checkpoint",
        )
    return _text_config(text, quant_raw, tie, raw)


def _text_config(
    text: dict[str, Any], quant_raw: dict[str, Any] | None, tie: bool, raw: dict[str, Any]
) -> TextConfig:
    def need(key: str) -> Any:
        if key not in text or text[key] is None:
            raise CheckpointError(
                f"config.json lacks the text field {key!r}", "restore config.json"
            )
        return text[key]

    n_layers = int(need("num_hidden_layers"))
    layer_types = text.get("layer_types") or [
        SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)
    ]
    layer_types = list(layer_types)
    if len(layer_types) != n_layers or any(t not in (SLIDING, FULL) for t in layer_types):
        raise CheckpointError(
            f"layer_types must list {n_layers} entries of {SLIDING!r}/{FULL!r}",
            "fix layer_types in config.json",
        )
    layer_types[-1] = FULL  # transformers forces the last layer to full attention
    head_dim = int(text.get("head_dim", 256) or need("hidden_size") // need("num_attention_heads"))
    kv_heads = int(need("num_key_value_heads"))
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    head_dims, layer_kv = _per_layer_shapes(text, layer_types, head_dim, kv_heads, k_eq_v)

    rope_raw = text.get("rope_parameters") or _DEFAULT_ROPE
    rope: dict[str, RopeSpec] = {}
    for kind in sorted(set(layer_types)):  # one order in every process (the repr is hashed)
        params = rope_raw.get(kind) or _DEFAULT_ROPE[kind]
        first = layer_types.index(kind)
        rope[kind] = RopeSpec(
            rope_type=params.get("rope_type", "default"),
            theta=float(params.get("rope_theta", _DEFAULT_ROPE[kind]["rope_theta"])),
            head_dim=head_dims[first],
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
            factor=float(params.get("factor", 1.0)),
        )
        rope[kind].rotated_pairs()  # refuse an unknown type now, not at the first token

    shared = int(text.get("num_kv_shared_layers", 0) or 0)
    if not 0 <= shared < n_layers:
        raise CheckpointError(
            f"num_kv_shared_layers={shared} must be in [0, {n_layers})", "fix config.json"
        )
    cfg = TextConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=n_layers,
        num_attention_heads=int(need("num_attention_heads")),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        layer_head_dims=tuple(head_dims),
        layer_kv_heads=tuple(layer_kv),
        sliding_window=int(text.get("sliding_window", 512)),
        num_kv_shared_layers=shared,
        # absent fields take transformers' defaults (PLE on, 256 wide, over 262144 ids)
        hidden_size_per_layer_input=int(text.get("hidden_size_per_layer_input", 256) or 0),
        vocab_size_per_layer_input=int(text.get("vocab_size_per_layer_input", 262_144) or 0),
        rope=rope,
        final_logit_softcapping=text.get("final_logit_softcapping"),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=tie,
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        attention_k_eq_v=k_eq_v,
        hidden_activation=str(text.get("hidden_activation", "gelu_pytorch_tanh")),
        pad_token_id=text.get("pad_token_id", 0),
        bos_token_id=text.get("bos_token_id", 2),
        eos_token_ids=_as_ids(text.get("eos_token_id", 1)),
        quant=_quant_spec(quant_raw),
        raw=raw,
    )
    for i in range(cfg.first_shared_layer, n_layers):
        cfg.kv_producer(i)  # every shared layer must have a producer
    if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(
            f"hidden_activation {cfg.hidden_activation!r} is not supported",
            "use a Gemma 4 checkpoint (gelu_pytorch_tanh)",
        )
    return cfg


def _per_layer_shapes(
    text: dict[str, Any], layer_types: list[str], head_dim: int, kv_heads: int, k_eq_v: bool
) -> tuple[list[int], list[int]]:
    """Head width and KV-head count of each layer.

    transformers 5.24 stores the full layers' overrides in `per_layer_config` (keyed by layer
    index); older configs carry `global_head_dim` / `num_global_key_value_heads` instead.
    """
    global_head_dim = int(text.get("global_head_dim") or 512)
    global_kv = text.get("num_global_key_value_heads")
    per_layer = text.get("per_layer_config")
    dims, heads = [], []
    for i, kind in enumerate(layer_types):
        if per_layer is not None:
            over = per_layer.get(str(i)) or per_layer.get(i) or {}
        elif kind == FULL:
            over = {"head_dim": global_head_dim}
            if k_eq_v and global_kv is not None:
                over["num_key_value_heads"] = global_kv
        else:
            over = {}
        dims.append(int(over.get("head_dim", head_dim)))
        heads.append(int(over.get("num_key_value_heads", kv_heads)))
    return dims, heads


def _quant_spec(quant_raw: dict[str, Any] | None) -> QuantSpec | None:
    """The W4A16 group spec from compressed-tensors' quantization_config; refuse other schemes."""
    if not quant_raw:
        return None
    method = quant_raw.get("quant_method")
    groups = quant_raw.get("config_groups") or {}
    # compressed-tensors names the format at the top, or per group (the top then says
    # "mixed-precision" or nothing): every group must be pack-quantized
    top = quant_raw.get("format")
    formats = {(group or {}).get("format") or top for group in groups.values()} or {top}
    if method != "compressed-tensors" or formats != {"pack-quantized"}:
        shown = top if len(formats) != 1 else next(iter(formats))
        raise CheckpointError(
            f"quantization {method!r} / format {shown!r} is not supported",
            "use a compressed-tensors 'pack-quantized' W4A16 checkpoint, or `gpurig engine "
            "quantize` a 16-bit one",
        )
    fmt = "pack-quantized"
    specs = []
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("actorder") == "group":
            raise CheckpointError(
                f"quantization group {name!r} uses activation ordering ('actorder: group'), "
                "whose permuted groups the engine does not apply",
                "use a checkpoint quantized without actorder (or with actorder 'weight'), or "
                "`gpurig engine quantize` a 16-bit one",
            )
        if group.get("input_activations"):
            raise CheckpointError(
                f"quantization group {name!r} quantizes activations; only W4A16 is supported",
                "use a W4A16 checkpoint",
            )
        specs.append(
            (
                int(w.get("num_bits", 4)),
                int(w.get("group_size") or 0),
                bool(w.get("symmetric", True)),
            )
        )
    if not specs:
        raise CheckpointError("quantization_config has no config_groups", "restore config.json")
    if len(set(specs)) != 1:
        raise CheckpointError(
            f"quantization groups differ ({sorted(set(specs))}); the engine needs one W4A16 scheme",
            "requantize with `gpurig engine quantize`",
        )
    bits, group_size, symmetric = specs[0]
    if bits != 4 or not symmetric or group_size <= 0 or group_size % 8:
        raise CheckpointError(
            f"weights are {bits}-bit, symmetric={symmetric}, group_size={group_size}; the engine "
            "runs symmetric 4-bit groups (a multiple of 8 wide)",
            "requantize with `gpurig engine quantize` (W4A16, group 32, symmetric)",
        )
    return QuantSpec(
        num_bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        format=fmt,
        ignore=tuple(quant_raw.get("ignore") or ()),
    )
