"""The decode step with fused kernels: the same function as Gemma4Model.decode_step, in 10
launches per layer instead of ~95.

By default (GPURIG_PROLOGUE=1, `_step_prologue`) the residual+norm before the per-layer gate
and before the next layer's q|k|v runs in that GEMV's prologue, which makes 10 launches of the
12 below (H200: 611 vs 576 tok/s, bit-identical logits; bench/NOTES.md v7).

Per layer (the arrangement without prologues): one GEMV for q|k|v (fused at load), one kernel for the
q/k/v norms + RoPE + cache write, the split-cache attention (2), the o GEMV, one residual+norm
kernel (post-attention norm, residual, pre-FFN norm), one GEMV over the interleaved gate|up rows
that applies GELU(gate)*up itself, the down GEMV, a residual+norm kernel, and the per-layer-input
block (a gate GEMV that applies GELU*input itself, the projection GEMV, residual+norm+scalar+next
layer's input norm). GPURIG_EPILOGUES and GPURIG_FUSE_QKV_ATTN rearrange it (residual+norm in
the GEMVs' last program; the q/k/v work inside the attention): measured, neither was faster on
the H200 (bench/NOTES.md). Every intermediate is rounded to the compute dtype where the
reference rounds it, so the logits equal the reference's up to summation order.

Shapes it covers: one token, one KV head per layer, power-of-two head widths, packed linears
(plain ones fall back to engine/ops.py per matrix). `FusedDecoder.supported` says whether a
model qualifies; otherwise the engine decodes with the model's own step.
"""

from __future__ import annotations

import os

import torch

from engine import ops
from engine.fast import ops_fast
from engine.fast.fuse import fuse_projections
from engine.kernels.fused import gelu_mul, ple_mix, qkv_rope, residual_norm, rmsnorm_rows
from engine.kernels.w4dequant import w4_gather_rows
from engine.kernels.w4gemv import (
    w4_gemv_after_residual,
    w4_gemv_gelu_mul,
    w4_gemv_glu,
    w4_gemv_residual,
)


def _epilogues_on() -> bool:
    """GEMVs finish the GELU work themselves (GPURIG_EPILOGUES=0: separate kernels)."""
    return os.environ.get("GPURIG_EPILOGUES", "glu") != "0"


def _fuse_qkv_attention() -> bool:
    """GPURIG_FUSE_QKV_ATTN=1: the q/k/v norms, RoPE and cache write run inside the attention's
    split kernel instead of a kernel of their own. Off by default: on the H200 it saved
    nothing (1.806 vs 1.810 ms per token, bench/NOTES.md), the fused work stays on the
    dependent chain; it is one launch fewer per layer where launches cost more."""
    return os.environ.get("GPURIG_FUSE_QKV_ATTN", "0") == "1"


def _residual_epilogues_on() -> bool:
    """GPURIG_EPILOGUES=all: the o, down and per-layer projection GEMVs also add their output
    to the residual and compute the next norm, in their last program. Off by default: on the
    H200 that serial tail cost ~2.6 us per GEMV, and one separate residual+norm kernel was 2%
    faster end to end (bench/NOTES.md)."""
    return os.environ.get("GPURIG_EPILOGUES", "glu") in ("1", "all")


def _prologue_mode() -> str:
    """GPURIG_PROLOGUE: where a residual+norm is made in the prologue of the GEMV that reads it.
    "1" (default): before the per-layer gate and before the next layer's q|k|v, 10 launches per
    layer instead of 12 (H200: 610 vs 576 tok/s, logits bit-identical, bench/NOTES.md v7).
    "all": also before gate|up (9 launches). "0": every residual+norm is its own kernel."""
    mode = os.environ.get("GPURIG_PROLOGUE", "1")
    return mode if mode in ("0", "1", "all") else "1"


def _packed(w) -> bool:
    return isinstance(w, ops.PackedLinear) and ops_fast._packed_ok(w)


def _lin(x: torch.Tensor, w) -> torch.Tensor:
    if isinstance(w, ops.PackedLinear):
        y = ops_fast.linear4(x, w)
        if y is not None:
            return y
    return ops.linear(x, w)


def supported(model) -> bool:
    """True when every layer fits the fused kernels (E2B and the tiny presets do)."""
    cfg = model.cfg
    for i in range(cfg.num_hidden_layers):
        d = cfg.layer_head_dims[i]
        if cfg.layer_kv_heads[i] != 1 or d & (d - 1) or d < 16:
            return False
    return model.dtype in (torch.bfloat16, torch.float16, torch.float32)


class FusedDecoder:
    """`step(token [1], position [1]) -> logits [1, V]`, writing the cache like decode_step."""

    def __init__(self, model, cache) -> None:
        self.model = model
        self.cache = cache
        self.fused = fuse_projections(model)
        m = model
        # the one matrix each layer's q|k|v GEMV reads (kv-shared layers: q alone)
        self.qkv_lin = [
            fl.qkv if fl.qkv is not None else w.q if w.k is None and w.v is None else None
            for fl, w in zip(self.fused, m.layers, strict=True)
        ]
        self.prologue_ok = (
            all(q is not None and _packed(q) for q in self.qkv_lin)
            and all(fl.gate_up is not None and _packed(fl.gate_up) for fl in self.fused)
            and all(_packed(w.ple_gate) for w in m.layers if m.ple_table is not None)
        )

    def _embed(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, cfg = self.model, self.model.cfg
        if isinstance(m.embed, ops.PackedLinear) and ops_fast._packed_ok(m.embed):
            h = w4_gather_rows(token, m.embed.packed, m.embed.scales, dtype=m.dtype,
                               mul=m.embed_scale)  # fmt: skip
        else:
            h = ops.embed_rows(token, m.embed, m.dtype) * m.embed_scale
        if m.ple_table is None:
            return h, None
        n, p = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        if isinstance(m.ple_table, ops.PackedLinear) and ops_fast._packed_ok(m.ple_table):
            tok = w4_gather_rows(token, m.ple_table.packed, m.ple_table.scales, dtype=m.dtype,
                                 mul=m.ple_scale)  # fmt: skip
        else:
            tok = ops.embed_rows(token, m.ple_table, m.dtype) * m.ple_scale
        proj = _lin(h, m.ple_projection)
        ple = ple_mix(proj, tok.contiguous(), m.ple_projection_norm, n, p, cfg.rms_norm_eps,
                      cfg.hidden_size**-0.5, 2.0**-0.5)  # fmt: skip
        return h, ple

    def _rest_fused(self, i, w, fl, attn, h, ple, nxt):
        """After attention, with the GEMV epilogues: o, gate|up (+GELU*up), down, per-layer
        gate (+GELU*input), projection; each of o, down and projection followed by its
        residual+norm kernel, or doing that work in its last program (GPURIG_EPILOGUES=all)."""
        eps = self.model.cfg.rms_norm_eps

        def resid(x, lin, w_post, scalar=None, w_next=None):
            if _packed(lin) and _residual_epilogues_on():
                return w4_gemv_residual(x, lin.packed, lin.scales, h, w_post, eps,
                                        scalar=scalar, w_next=w_next)  # fmt: skip
            _, out = residual_norm(h, _lin(x, lin), w_post, eps, scalar=scalar, w_next=w_next,
                                   h_out=h)  # fmt: skip
            return out

        x2 = resid(attn, w.o, w.post_attn_norm, w_next=w.pre_ffn_norm)
        if fl.gate_up is not None:
            act = w4_gemv_glu(x2, fl.gate_up.packed, fl.gate_up.scales)
        else:
            act = gelu_mul(_lin(x2, w.gate).contiguous(), _lin(x2, w.up).contiguous())
        if ple is None:
            return h, resid(act, w.down, w.post_ffn_norm, scalar=w.layer_scalar, w_next=nxt)
        resid(act, w.down, w.post_ffn_norm)
        if _packed(w.ple_gate):
            a2 = w4_gemv_gelu_mul(h, w.ple_gate.packed, w.ple_gate.scales, ple[i])
        else:
            a2 = gelu_mul(_lin(h, w.ple_gate).contiguous(), ple[i])
        return h, resid(a2, w.ple_proj, w.ple_norm, scalar=w.layer_scalar, w_next=nxt)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head of the final-normed hidden state, soft-capped as the model caps it."""
        out = _lin(x, self.model.lm_head)
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
        if _fuse_qkv_attention():
            attn = ops_fast.attention_from_qkv(
                qkv.reshape(-1), w.q_norm, w.k_norm, cos, sin, eps, hq, hd, position, src,
                own_kv=own, v_from_k=own and w.v is None, window=window,
            )  # fmt: skip
            if attn is not None:
                return attn.reshape(1, hq * hd)
        q = qkv_rope(qkv, w.q_norm, w.k_norm, cos, sin, hq, hd, eps, position,
                     cache=cache.layers[i] if own else None, v_from_k=own and w.v is None)  # fmt: skip
        q3 = q.view(1, hq, hd)
        attn = ops_fast.attention_decode(q3, src.k, src.v, src.pos, position, window)
        if attn is None:
            attn = ops.attention_decode(q3, src.k, src.v, src.pos, position, window)
        return attn.reshape(1, hq * hd)

    def _step_prologue(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The step with the residual+norm before the per-layer gate and before the next
        layer's q|k|v made in that GEMV's prologue (10 launches per layer instead of 12).

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
        rope = m._rope(position)
        layers = m.layers
        gate_up_too = _prologue_mode() == "all"

        def after(y, w_post, lin, scalar=None, w_next=None, epi=0, aux=None):
            nonlocal h, spare
            out = w4_gemv_after_residual(y, h, w_post, eps, lin.packed, lin.scales, spare,
                                         scalar=scalar, w_next=w_next, epi=epi,
                                         aux=aux)  # fmt: skip
            h, spare = spare, h
            return out

        pending = None  # (y, w_post, scalar) of the residual+norm the next q|k|v GEMV makes
        for i, w in enumerate(layers):
            fl = self.fused[i]
            if pending is None:
                qkv = _lin(rmsnorm_rows(h, w.input_norm, eps), self.qkv_lin[i])
            else:
                y, w_post, scalar = pending
                qkv = after(y, w_post, self.qkv_lin[i], scalar=scalar, w_next=w.input_norm)
            attn = self._attention(i, w, qkv, position, rope)
            o = _lin(attn, w.o)
            if gate_up_too:
                act = after(o, w.post_attn_norm, fl.gate_up, w_next=w.pre_ffn_norm, epi=1)
            else:
                _, x2 = residual_norm(h, o, w.post_attn_norm, eps, w_next=w.pre_ffn_norm,
                                      h_out=h)  # fmt: skip
                act = w4_gemv_glu(x2, fl.gate_up.packed, fl.gate_up.scales)
            d = _lin(act, w.down)
            if ple is None:
                pending = (d, w.post_ffn_norm, w.layer_scalar)
                continue
            a2 = after(d, w.post_ffn_norm, w.ple_gate, epi=2, aux=ple[i])
            pending = (_lin(a2, w.ple_proj), w.ple_norm, w.layer_scalar)
        y, w_post, scalar = pending
        _, x = residual_norm(h, y, w_post, eps, scalar=scalar, w_next=m.final_norm, h_out=h)
        return self._logits(x)

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if (
            self.prologue_ok
            and _prologue_mode() != "0"
            and _epilogues_on()
            and not _residual_epilogues_on()
        ):
            return self._step_prologue(token, position)
        m, cfg = self.model, self.model.cfg
        eps = cfg.rms_norm_eps
        h, ple = self._embed(token)
        h = h.contiguous()
        rope = m._rope(position)
        layers = m.layers
        x = rmsnorm_rows(h, layers[0].input_norm, eps)
        for i, w in enumerate(layers):
            fl = self.fused[i]
            if fl.qkv is not None:
                qkv = _lin(x, fl.qkv)
            else:
                qkv = torch.cat([_lin(x, p) for p in (w.q, w.k, w.v) if p is not None], dim=-1)
            attn = self._attention(i, w, qkv, position, rope)
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else m.final_norm
            if _epilogues_on():
                h, x = self._rest_fused(i, w, fl, attn, h, ple, nxt)
                continue
            o = _lin(attn, w.o)
            h, x2 = residual_norm(h, o, w.post_attn_norm, eps, w_next=w.pre_ffn_norm, h_out=h)
            if fl.gate_up is not None:  # interleaved rows: gate at even, up at odd outputs
                gu = _lin(x2, fl.gate_up)
                act = gelu_mul(gu[:, 0::2].contiguous(), gu[:, 1::2].contiguous())
            else:
                act = gelu_mul(_lin(x2, w.gate).contiguous(), _lin(x2, w.up).contiguous())
            d = _lin(act, w.down)
            if ple is not None:
                h, _ = residual_norm(h, d, w.post_ffn_norm, eps, h_out=h)
                g = _lin(h, w.ple_gate)
                a2 = gelu_mul(g, ple[i])
                p = _lin(a2, w.ple_proj)
                h, x = residual_norm(h, p, w.ple_norm, eps, scalar=w.layer_scalar, w_next=nxt,
                                     h_out=h)  # fmt: skip
            else:
                h, x = residual_norm(h, d, w.post_ffn_norm, eps, scalar=w.layer_scalar,
                                     w_next=nxt, h_out=h)  # fmt: skip
        return self._logits(x)
