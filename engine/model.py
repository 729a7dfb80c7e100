"""The Gemma 4 text model in PyTorch: the engine's reference forward pass (CPU and GPU).

Weights stay as stored: packed 4-bit linears (`PackedLinear`), plain ones (`PlainLinear`), and the
embedding tables plain or 4-bit; every product and lookup goes through engine/ops.py, which
dequantizes one weight at a time (the model is never expanded to a 16-bit copy).

Facts followed (transformers 5.24 `Gemma4ForCausalLM` is the reference, checked against it by
tests/test_engine_parity.py):
embeddings scaled by sqrt(hidden) rounded to the compute dtype; per-layer embeddings (PLE) mixed
from a table lookup and a projection of the embeddings; q/k RMS-normed with weights, v without;
attention scale 1.0; RoPE 'default' on sliding layers and 'proportional' (partial) on full
layers; post-attention / post-feedforward norms; a per-layer-input residual; the layer output
multiplied by layer_scalar; the last num_kv_shared_layers reuse the K/V of the last own-KV layer
of their type (and may have a double-wide MLP); final logits soft-capped.

One layer body (`_layer`) serves every entry point; only its attention differs, handed in as a
strategy (engine/paged_attention_ref.py). Over a KVPool (a single sequence is a pool of one):
`read_chunks` reads prompt chunks of several sequences in one pass through the own-KV layers
(the KV-shared layers write nothing, so only a prompt's last token needs them), and
`decode_rows` runs one new token of each of B sequences through every layer, B being a tensor
dimension. `prefill_chunk` / `decode_step` are the single-sequence entry points over a cache
(`KVCache` or `KVPool.view(slot)`), kept while their callers are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import ops
from engine.checkpoint import CheckpointReader
from engine.config import RopeSpec, TextConfig
from engine.errors import CheckpointError
from engine.packed import Linear
from engine.paged_attention_ref import (
    Attend,
    CacheAttention,
    ChunksAttention,
    RowsAttention,
    SequenceCacheLike,
    segment,
)

if TYPE_CHECKING:
    from engine.kv_pool import KVPool


@dataclass
class LayerWeights:
    """One decoder layer's weights as stored; k/v/k_norm are None on KV-shared layers."""

    input_norm: torch.Tensor
    q: Linear
    q_norm: torch.Tensor
    k: Linear | None
    v: Linear | None  # None with attention_k_eq_v: values are the raw keys
    k_norm: torch.Tensor | None
    o: Linear
    post_attn_norm: torch.Tensor
    pre_ffn_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear
    post_ffn_norm: torch.Tensor
    ple_gate: Linear | None
    ple_proj: Linear | None
    ple_norm: torch.Tensor | None
    layer_scalar: torch.Tensor

    def linears(self) -> list[Linear]:
        """Every weight matrix once."""
        parts = (self.q, self.k, self.v, self.gate, self.up, self.o, self.down)
        return [w for w in (*parts, self.ple_gate, self.ple_proj) if w is not None]

    def nbytes(self) -> int:
        tensors = [
            self.input_norm,
            self.q_norm,
            self.k_norm,
            self.post_attn_norm,
            self.pre_ffn_norm,
            self.post_ffn_norm,
            self.ple_norm,
            self.layer_scalar,
        ]
        return sum(w.nbytes() for w in self.linears()) + sum(
            t.numel() * t.element_size() for t in tensors if t is not None
        )


class Gemma4Model:
    """Gemma 4 text decoder over packed weights; owns no cache (the caller passes a KVPool)."""

    def __init__(
        self,
        cfg: TextConfig,
        embed: Linear,
        lm_head: Linear,
        ple_table: Linear | None,
        ple_projection: Linear | None,
        ple_projection_norm: torch.Tensor | None,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        kernels: ops.Ops | None = None,
    ) -> None:
        self.cfg = cfg
        # the dispatch points every product, lookup and attention goes through: the reference
        # set, or engine.fast's FastOps (chosen once, at load)
        self.ops = kernels if kernels is not None else ops.Ops()
        self.embed = embed
        self.lm_head = lm_head
        self.ple_table = ple_table
        self.ple_projection = ple_projection
        self.ple_projection_norm = ple_projection_norm
        self.layers = layers
        self.final_norm = final_norm
        self.device = device
        self.dtype = dtype
        self.inv_freq = {kind: rope_inv_freq(spec).to(device) for kind, spec in cfg.rope.items()}
        # rounded to the compute dtype, as transformers rounds them to the weight dtype
        # (transformers keeps them as fp32 buffers and casts those: the same double rounding)
        self.embed_scale = _scale(cfg.embed_scale, dtype, device)
        self.ple_scale = _scale(cfg.per_layer_embed_scale, dtype, device)

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        cfg: TextConfig,
        device: torch.device,
        dtype: torch.dtype,
        kernels: ops.Ops | None = None,
    ) -> Gemma4Model:
        group = cfg.quant.group_size if cfg.quant else 32

        def lin(name: str) -> Linear:
            return reader.linear(name, device, group)

        def vec(name: str) -> torch.Tensor:
            return reader.tensor(name, device)

        embed = _table(reader, "embed_tokens", device)
        _check_shape("embed_tokens", embed, (cfg.vocab_size, cfg.hidden_size))
        if not cfg.tie_word_embeddings and (
            reader.has("lm_head.weight") or reader.has("lm_head.weight_packed")
        ):
            lm_head: Linear = lin("lm_head")
        else:
            lm_head = embed  # one copy serves both
        ple_table = ple_projection = ple_norm = None
        p = cfg.hidden_size_per_layer_input
        if p:
            ple_table = _table(reader, "embed_tokens_per_layer", device)
            _check_shape(
                "embed_tokens_per_layer",
                ple_table,
                (cfg.vocab_size_per_layer_input, cfg.num_hidden_layers * p),
            )
            ple_projection = lin("per_layer_model_projection")
            ple_norm = vec("per_layer_projection_norm.weight")
        layers = []
        for i in range(cfg.num_hidden_layers):
            pre = f"layers.{i}."
            own = i < cfg.first_shared_layer
            v_name = pre + "self_attn.v_proj"
            has_v = reader.has(v_name + ".weight") or reader.has(v_name + ".weight_packed")
            layer = LayerWeights(
                input_norm=vec(pre + "input_layernorm.weight"),
                q=lin(pre + "self_attn.q_proj"),
                q_norm=vec(pre + "self_attn.q_norm.weight"),
                k=lin(pre + "self_attn.k_proj") if own else None,
                v=lin(v_name) if own and (has_v or not cfg.attention_k_eq_v) else None,
                k_norm=vec(pre + "self_attn.k_norm.weight") if own else None,
                o=lin(pre + "self_attn.o_proj"),
                post_attn_norm=vec(pre + "post_attention_layernorm.weight"),
                pre_ffn_norm=vec(pre + "pre_feedforward_layernorm.weight"),
                gate=lin(pre + "mlp.gate_proj"),
                up=lin(pre + "mlp.up_proj"),
                down=lin(pre + "mlp.down_proj"),
                post_ffn_norm=vec(pre + "post_feedforward_layernorm.weight"),
                ple_gate=lin(pre + "per_layer_input_gate") if p else None,
                ple_proj=lin(pre + "per_layer_projection") if p else None,
                ple_norm=vec(pre + "post_per_layer_input_norm.weight") if p else None,
                layer_scalar=(
                    vec(pre + "layer_scalar")
                    if reader.has(pre + "layer_scalar")
                    else torch.ones(1, device=device)
                ).to(dtype),
            )
            hd, hq = cfg.layer_head_dims[i], cfg.num_attention_heads
            _check_shape(pre + "self_attn.q_proj", layer.q, (hq * hd, cfg.hidden_size))
            if layer.k is not None:
                _check_shape(
                    pre + "self_attn.k_proj", layer.k, (cfg.layer_kv_heads[i] * hd, cfg.hidden_size)
                )
            _check_shape(pre + "mlp.gate_proj", layer.gate, (cfg.mlp_width(i), cfg.hidden_size))
            layers.append(layer)
        return cls(
            cfg,
            embed,
            lm_head,
            ple_table,
            ple_projection,
            ple_norm,
            layers,
            vec("norm.weight"),
            device,
            dtype,
            kernels,
        )

    # ---- pieces ----------------------------------------------------------------------------
    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [T] -> hidden [T, H] and per-layer inputs [T, L, P] (None without PLE)."""
        cfg = self.cfg
        h = self.ops.embed_rows(ids, self.embed, self.dtype) * self.embed_scale
        if self.ple_table is None:
            return h, None
        t, n, p = ids.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        tok = (self.ops.embed_rows(ids, self.ple_table, self.dtype) * self.ple_scale).reshape(
            t, n, p
        )
        proj = self.ops.linear(h, self.ple_projection) * (cfg.hidden_size**-0.5)
        proj = self.ops.rms_norm(proj.reshape(t, n, p), self.ple_projection_norm, cfg.rms_norm_eps)
        return h, (proj + tok) * (2.0**-0.5)

    def rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            kind: self.ops.rope_cos_sin(positions, f, self.dtype)
            for kind, f in self.inv_freq.items()
        }

    def _layer(
        self,
        i: int,
        h: torch.Tensor,
        ple: torch.Tensor | None,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        attend: Attend,
    ) -> torch.Tensor:
        """One decoder layer on h [T, H], whatever the T rows are (one prompt chunk, chunks of
        several sequences, one new token of each of B sequences): every norm and product runs
        once over all rows. Only the attention depends on where the rows' keys live, so it is
        handed in (engine.paged_attention_ref): `attend(i, q, k, v)` writes the new K/V (None on
        a KV-shared layer) where its rows' caches keep them and returns the attention [T, Hq, D]."""
        cfg, w = self.cfg, self.layers[i]
        eps, t = cfg.rms_norm_eps, h.shape[0]
        hd, kvh = cfg.layer_head_dims[i], cfg.layer_kv_heads[i]
        cos, sin = rope[cfg.layer_types[i]]

        x = self.ops.rms_norm(h, w.input_norm, eps)
        q_out = self.ops.linear(x, w.q)
        k_out = self.ops.linear(x, w.k) if w.k is not None else None
        v_out = self.ops.linear(x, w.v) if w.v is not None else None
        q = self.ops.apply_rope(
            self.ops.rms_norm(q_out.reshape(t, -1, hd), w.q_norm, eps), cos, sin
        )
        k = v = None
        if k_out is not None:
            k_raw = k_out.reshape(t, kvh, hd)
            v_raw = v_out.reshape(t, kvh, hd) if v_out is not None else k_raw
            k = self.ops.apply_rope(self.ops.rms_norm(k_raw, w.k_norm, eps), cos, sin)
            v = self.ops.rms_norm(v_raw, None, eps)
        attn = attend(i, q, k, v)

        h = h + self.ops.rms_norm(self.ops.linear(attn.reshape(t, -1), w.o), w.post_attn_norm, eps)
        x = self.ops.rms_norm(h, w.pre_ffn_norm, eps)
        gate, up = self.ops.linear(x, w.gate), self.ops.linear(x, w.up)
        mlp = self.ops.linear(self.ops.gelu_tanh(gate) * up, w.down)
        h = h + self.ops.rms_norm(mlp, w.post_ffn_norm, eps)
        if ple is not None:
            g = self.ops.gelu_tanh(self.ops.linear(h, w.ple_gate)) * ple[:, i]
            h = h + self.ops.rms_norm(self.ops.linear(g, w.ple_proj), w.ple_norm, eps)
        return h * w.layer_scalar

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, tied lm_head and soft-capping: h [T, H] -> [T, V] in the compute dtype."""
        x = self.ops.rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)
        out = self.ops.lm_head(x, self.lm_head)
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    # ---- entry points over a KVPool (a single sequence is a pool of one) ---------------------
    @torch.inference_mode()
    def decode_rows(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One new token for each of B sequences of `pool`: tokens [B] at positions [B], row b
        the sequence in slot slots[b] -> logits [B, V].

        Every row runs through the same layer bodies together (B is the products' row count);
        each own-KV layer writes row b's K/V into its sequence's rows, records the position in
        pool.pos, and each row attends over its own sequence (paged_attention_ref.RowsAttention).
        The caller has grown every sequence to hold positions[b]. Rows in pool.pad_slot only pad
        (a graph bucket): they write the padding slot's rows; their logits mean nothing."""
        positions = positions.to(device=self.device, dtype=torch.int64)
        attend = RowsAttention(self.ops, pool, slots, positions)
        h, ple = self.embed_ids(tokens.to(self.device))
        rope = self.rope(positions)
        for i in range(self.cfg.num_hidden_layers):
            h = self._layer(i, h, ple, rope, attend)
        return self.logits(h)

    @torch.inference_mode()
    def read_chunks(
        self,
        parts: list[tuple[torch.Tensor, int, int]],
        pool: KVPool,
        score_budget: int | None = None,
    ) -> None:
        """Prompt chunks of several sequences in one pass: (ids [T_i], start_i, slot_i) each,
        at positions start_i .. start_i + T_i - 1 of the sequence in slot_i (grown to hold them,
        its positions before start_i already read).

        Only the own-KV layers run (the KV-shared ones keep nothing, so a prompt's last token
        goes through decode_rows, which gives its logits). The norms and products run once over
        every chunk's rows; the attention and the K/V write go segment by segment over each
        sequence's cache (paged_attention_ref.ChunksAttention), score_budget bounding each
        segment's scores (ops.attention_prefill). Why together: reading is host-bound, so
        several prompts read in one pass cost about what one does."""
        segments, ids, row = [], [], 0
        for seg_ids, start, slot in parts:
            n = int(seg_ids.shape[0])
            segments.append(segment(pool, row, n, int(start), int(slot)))
            ids.append(seg_ids.to(self.device))
            row += n
        if not row:
            return
        attend = ChunksAttention(self.ops, pool, segments, score_budget)
        positions = torch.cat([s.positions for s in segments])
        h, ple = self.embed_ids(torch.cat(ids))
        rope = self.rope(positions)
        for i in range(self.cfg.first_shared_layer):
            h = self._layer(i, h, ple, rope, attend)

    # ---- single-sequence entry points over a cache (until KVCache goes) ----------------------
    @torch.inference_mode()
    def prefill_chunk(
        self,
        ids: torch.Tensor,
        start: int,
        cache: SequenceCacheLike,
        last: bool,
        score_budget: int | None = None,
    ) -> torch.Tensor | None:
        """Read prompt tokens ids [T] at positions start..start+T-1 into the cache.

        Returns the logits [V] of the chunk's last token when `last` (the prompt's final chunk),
        else None: the KV-shared layers then do not run at all. score_budget: the most attention
        score elements alive at once (default ops.SCORE_BUDGET; see engine.memory.plan_prompt).
        """
        positions = torch.arange(start, start + ids.shape[0], device=self.device)
        h, ple = self.embed_ids(ids)
        rope = self.rope(positions)
        first_shared = self.cfg.first_shared_layer
        attend = CacheAttention(self.ops, self.cfg, cache, positions, start, score_budget)
        for i in range(first_shared):
            h = self._layer(i, h, ple, rope, attend)
        if not last:
            return None
        h, positions = h[-1:], positions[-1:]
        ple = ple[-1:] if ple is not None else None
        rope = {k: (c[-1:], s[-1:]) for k, (c, s) in rope.items()}
        attend = CacheAttention(self.ops, self.cfg, cache, positions, None)
        for i in range(first_shared, self.cfg.num_hidden_layers):
            h = self._layer(i, h, ple, rope, attend)
        return self.logits(h)[0]

    @torch.inference_mode()
    def decode_step(
        self, token: torch.Tensor, position: torch.Tensor, cache: SequenceCacheLike
    ) -> torch.Tensor:
        """One token: token [1] and position [1] device tensors -> logits [1, V]."""
        h, ple = self.embed_ids(token)
        rope = self.rope(position)
        attend = CacheAttention(self.ops, self.cfg, cache, position, None)
        for i in range(self.cfg.num_hidden_layers):
            h = self._layer(i, h, ple, rope, attend)
        return self.logits(h)

    # ---- sizes -----------------------------------------------------------------------------
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every linear, the lm_head and the PLE projection
        (table lookups read one row, so they do not count). Bytes / step time = the bandwidth
        achieved, the number to hold against the device's memory bandwidth."""
        total = sum(w.nbytes() for layer in self.layers for w in layer.linears())
        total += self.lm_head.nbytes()
        if self.ple_projection is not None:
            total += self.ple_projection.nbytes()
        return total

    def nbytes_by_part(self) -> dict[str, int]:
        """Bytes on the device per part: embed (also the lm_head when tied), lm_head when separate,
        the decoder layers, the per-layer table and the small rest."""
        parts = {
            "embed": self.embed.nbytes(),
            "lm_head": 0 if self.lm_head is self.embed else self.lm_head.nbytes(),
            "layers": sum(layer.nbytes() for layer in self.layers),
            "per_layer_table": self.ple_table.nbytes() if self.ple_table is not None else 0,
        }
        rest = self.final_norm.numel() * self.final_norm.element_size()
        if self.ple_projection is not None:
            rest += self.ple_projection.nbytes()
        if self.ple_projection_norm is not None:
            rest += self.ple_projection_norm.numel() * self.ple_projection_norm.element_size()
        parts["other"] = rest
        return parts


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """fp32 inverse frequencies [head_dim / 2], computed in fp32 as transformers does (a float64
    computation rounded afterwards differs in the last bit, which shows in the logits)."""
    pairs = spec.rotated_pairs()
    exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.int64).to(torch.float32) / spec.head_dim
    inv = 1.0 / (spec.theta**exponents)
    zeros = torch.zeros(spec.head_dim // 2 - pairs, dtype=torch.float32)
    return torch.cat([inv, zeros]) / spec.factor


def _scale(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device).to(dtype)


def _table(reader: CheckpointReader, name: str, device: torch.device) -> Linear:
    """An embedding table: 4-bit (emb4 layout) when `<name>.weight_packed` is stored, else plain."""
    return reader.linear(name, device, group_size=0)


def _check_shape(name: str, w: Linear, expected: tuple[int, int]) -> None:
    got = (w.out_features, w.in_features)
    if got != expected:
        raise CheckpointError(
            f"{name} has shape {got}, config.json implies {expected}",
            "the weights do not match config.json; rebuild or re-download the checkpoint",
        )
