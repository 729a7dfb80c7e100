"""The decode step with fused kernels: the same function as Gemma4Model.decode_step, in 10
launches per layer instead of ~95.

Per layer: the q|k|v GEMV (fused at load) whose prologue makes the previous layer's last
residual+norm and this layer's input norm; one kernel for the q/k/v norms + RoPE + cache write;
the split-cache attention (split + combine); the o GEMV; one residual+norm kernel
(post-attention norm, residual, pre-FFN norm); one GEMV over the interleaved gate|up rows that
applies GELU(gate)*up itself; the down GEMV; the per-layer gate GEMV whose prologue makes the
down's residual+norm and which applies GELU*input itself; the per-layer projection GEMV.
H200: 611 tok/s against 576 for the arrangement with every residual+norm a kernel, logits
bit-identical (bench/NOTES.md v7). Other arrangements (residual+norm in GEMV epilogues, q/k/v
work inside the attention, a gate|up prologue, PDL and L2 prefetch) were measured no faster and
are gone; their numbers stay in bench/NOTES.md. Every intermediate is rounded to the compute
dtype where the reference rounds it, so the logits equal the reference's up to summation order.

Shapes it covers (`supported`): one token, one KV head per layer, power-of-two head widths,
every q|k|v, gate|up and per-layer gate packed in the kernels' layout. Any other model decodes
with the model's own step (engine.backend.Backend).
"""

from __future__ import annotations

import torch

from engine.fast.fuse import FusedLayer
from engine.fast.ops_fast import FastOps, packed_ok
from engine.kernels.fused import ple_mix, qkv_rope, residual_norm, rmsnorm_rows
from engine.kernels.w4dequant import w4_gather_rows
from engine.kernels.w4gemv import w4_gemv_after_residual, w4_gemv_glu


def _qkv_matrices(model, fused: list[FusedLayer]) -> list:
    """The one matrix each layer's q|k|v GEMV reads (KV-shared layers: q alone)."""
    return [
        fl.qkv if fl.qkv is not None else w.q if w.k is None and w.v is None else None
        for fl, w in zip(fused, model.layers, strict=True)
    ]


def supported(model, fused: list[FusedLayer]) -> bool:
    """True when every layer fits the fused kernels (E2B and the tiny presets do)."""
    cfg = model.cfg
    for i in range(cfg.num_hidden_layers):
        d = cfg.layer_head_dims[i]
        if cfg.layer_kv_heads[i] != 1 or d & (d - 1) or d < 16:
            return False
    if model.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return (
        all(q is not None and packed_ok(q) for q in _qkv_matrices(model, fused))
        and all(fl.gate_up is not None and packed_ok(fl.gate_up) for fl in fused)
        and all(packed_ok(w.ple_gate) for w in model.layers if model.ple_table is not None)
    )


def embed_tokens(
    model, ops: FastOps, tokens: torch.Tensor, linear
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hidden states [B, H] and per-layer inputs [B, layers, width] (None without PLE) of B
    decode tokens, from the 4-bit tables (one gather each) and one mix kernel; `linear` makes
    the per-layer-input projection (the GEMV for one row, the batched product for more)."""
    m, cfg = model, model.cfg
    b = tokens.shape[0]
    if packed_ok(m.embed):
        h = w4_gather_rows(tokens, m.embed.packed, m.embed.scales, dtype=m.dtype,
                           mul=m.embed_scale)  # fmt: skip
    else:
        h = ops.embed_rows(tokens, m.embed, m.dtype) * m.embed_scale
    h = h.contiguous()
    if m.ple_table is None:
        return h, None
    n, p = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
    if packed_ok(m.ple_table):
        tok = w4_gather_rows(tokens, m.ple_table.packed, m.ple_table.scales, dtype=m.dtype,
                             mul=m.ple_scale)  # fmt: skip
    else:
        tok = ops.embed_rows(tokens, m.ple_table, m.dtype) * m.ple_scale
    proj = linear(h, m.ple_projection).contiguous()
    ple = ple_mix(proj.view(b * n, p), tok.contiguous().view(b * n, p), m.ple_projection_norm,
                  b * n, p, cfg.rms_norm_eps, cfg.hidden_size**-0.5, 2.0**-0.5)  # fmt: skip
    return h, ple.view(b, n, p)


class FusedDecoder:
    """`step(token [1], position [1]) -> logits [1, V]`, writing the cache like decode_step."""

    def __init__(self, model, cache, fused: list[FusedLayer], kernels: FastOps) -> None:
        self.model = model
        self.cache = cache
        self.fused = fused
        self.ops = kernels
        self.qkv_lin = _qkv_matrices(model, fused)

    def _embed(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, ple = embed_tokens(self.model, self.ops, token, self.ops.linear)
        return h, (ple[0] if ple is not None else None)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head of the final-normed hidden state, soft-capped as the model caps it."""
        out = self.ops.lm_head(x, self.model.lm_head)
        cap = self.model.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def _attention(self, i, w, qkv, position, rope):
        """q/k/v norms + RoPE + cache write, then the split-cache attention: [1, hq * hd]."""
        cfg, cache = self.model.cfg, self.cache
        hq, hd, eps = cfg.num_attention_heads, cfg.layer_head_dims[i], cfg.rms_norm_eps
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        cos, sin = rope[cfg.layer_types[i]]
        own = w.k is not None
        src = cache.layers[cfg.kv_producer(i)]
        q = qkv_rope(qkv, w.q_norm, w.k_norm, cos, sin, hq, hd, eps, position,
                     cache=cache.layers[i] if own else None, v_from_k=own and w.v is None)  # fmt: skip
        q3 = q.view(1, hq, hd)
        attn = self.ops.attention_decode(q3, src.k, src.v, src.pos, position, window)
        return attn.reshape(1, hq * hd)

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One token through every layer; the residual+norm before the per-layer gate and
        before the next layer's q|k|v is made in that GEMV's prologue.

        Only GEMVs of few programs take a prologue: every program recomputes the two norms over
        the whole vector, which the q|k|v (~300 programs) and per-layer gate (64) GEMVs absorb,
        but gate|up (1,536 one-warp programs) and lm_head (8,192) would pay ~30% more
        instructions (SASS here). The residual alternates between two buffers: a prologue
        reads one while its program 0 writes the other."""
        m, cfg = self.model, self.model.cfg
        eps = cfg.rms_norm_eps
        h, ple = self._embed(token)
        h = h.contiguous()
        spare = torch.empty_like(h)
        rope = m.rope(position)
        layers = m.layers
        lin, half2 = self.ops.linear, self.ops.half2

        def after(y, w_post, mat, scalar=None, w_next=None, epi=0, aux=None):
            nonlocal h, spare
            out = w4_gemv_after_residual(y, h, w_post, eps, mat.packed, mat.scales, spare,
                                         scalar=scalar, w_next=w_next, epi=epi, aux=aux,
                                         half2=half2)  # fmt: skip
            h, spare = spare, h
            return out

        pending = None  # (y, w_post, scalar) of the residual+norm the next q|k|v GEMV makes
        for i, w in enumerate(layers):
            fl = self.fused[i]
            if pending is None:
                qkv = lin(rmsnorm_rows(h, w.input_norm, eps), self.qkv_lin[i])
            else:
                y, w_post, scalar = pending
                qkv = after(y, w_post, self.qkv_lin[i], scalar=scalar, w_next=w.input_norm)
            attn = self._attention(i, w, qkv, position, rope)
            o = lin(attn, w.o)
            _, x2 = residual_norm(h, o, w.post_attn_norm, eps, w_next=w.pre_ffn_norm, h_out=h)
            act = w4_gemv_glu(x2, fl.gate_up.packed, fl.gate_up.scales, half2=half2)
            d = lin(act, w.down)
            if ple is None:
                pending = (d, w.post_ffn_norm, w.layer_scalar)
                continue
            a2 = after(d, w.post_ffn_norm, w.ple_gate, epi=2, aux=ple[i])
            pending = (lin(a2, w.ple_proj), w.ple_norm, w.layer_scalar)
        y, w_post, scalar = pending
        _, x = residual_norm(h, y, w_post, eps, scalar=scalar, w_next=m.final_norm, h_out=h)
        return self._logits(x)
