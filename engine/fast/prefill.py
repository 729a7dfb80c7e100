"""Prompt chunks through the KV-producing layers with fused kernels: the same function as
`Gemma4Model.prefill_chunk(..., last=False)` in ~60 launches per layer instead of ~140.

Why: reading a prompt is bound by the host, not the GPU. On the H200 a 32-token prompt
launched 3,507 kernels that ran for 7 ms inside a 92 ms read (bench/NOTES.md, v7); each eager
PyTorch op or Triton launch costs the host ~20 us however little it computes. Here every
RMSNorm is one kernel instead of seven ops, each residual+norm pair is one kernel that also
makes the next norm, q|k|v and gate|up are one dequantise + one matmul each (the matrices fused
at load for decode), the q/k/v head norms and RoPE are one launch, and GELU(gate)*up reads the interleaved gate|up output directly. The
attention over the prompt and the cache write stay the reference's ops. Every intermediate is
rounded where the reference rounds it, so the cache equals the reference's up to the matmuls'
summation order. The q/k/v head norms and RoPE are one kernel for the whole chunk.

Only the body of a prompt comes here: the last token goes through the decode step
(engine.generate.read_prompt), so the KV-shared layers never run on a prompt chunk.
"""

from __future__ import annotations

import torch

from engine import ops
from engine.fast.fuse import fuse_projections
from engine.kernels.fused import (
    gelu_mul,
    gelu_mul_pairs,
    qkv_rope_rows,
    residual_norm,
    rmsnorm_rows,
)


def supported(model) -> bool:
    """True when every KV-producing layer has packed, fusable q|k|v and gate|up and a
    power-of-two head width (qkv_rope_rows spans a head with tl.arange) (E2B does)."""
    fused = fuse_projections(model)
    cfg = model.cfg
    n = cfg.first_shared_layer
    return model.dtype in (torch.bfloat16, torch.float16, torch.float32) and all(
        fl.qkv is not None
        and fl.gate_up is not None
        and model.layers[i].k is not None
        and not cfg.layer_head_dims[i] & (cfg.layer_head_dims[i] - 1)
        for i, fl in enumerate(fused[:n])
    )


class FusedPrefill:
    """`chunk(ids [T], start, cache)`: what `prefill_chunk(ids, start, cache, last=False)` does."""

    def __init__(self, model) -> None:
        self.model = model
        self.fused = fuse_projections(model)

    @torch.inference_mode()
    def chunk(self, ids: torch.Tensor, start: int, cache) -> None:
        m, cfg = self.model, self.model.cfg
        eps, t = cfg.rms_norm_eps, ids.shape[0]
        positions = torch.arange(start, start + t, device=m.device)
        h, ple = m._embed(ids)
        h = h.contiguous()
        rope = m._rope(positions)
        layers = m.layers
        n = cfg.first_shared_layer
        x = rmsnorm_rows(h, layers[0].input_norm, eps)
        for i in range(n):
            w, fl = layers[i], self.fused[i]
            hq, kvh, hd = cfg.num_attention_heads, cfg.layer_kv_heads[i], cfg.layer_head_dims[i]
            cos, sin = rope[cfg.layer_types[i]]
            qkv = ops.linear(x, fl.qkv)
            q, k, v = qkv_rope_rows(qkv, w.q_norm, w.k_norm, cos, sin, hq, kvh, hd, eps,
                                    v_from_k=w.v is None)  # fmt: skip
            lc = cache.layers[i]
            if lc.window is None:  # full layer: the filled prefix
                ck, cv, cp = lc.k[:start], lc.v[:start], lc.pos[:start]
            else:  # sliding ring: all of it
                ck, cv, cp = lc.k, lc.v, lc.pos
            window = cfg.sliding_window if cfg.is_sliding(i) else None
            attn = ops.attention_prefill(q, k, v, ck, cv, cp, positions, window)
            lc.write(k, v, positions)
            o = ops.linear(attn.reshape(t, -1), w.o).contiguous()
            h, x2 = residual_norm(h, o, w.post_attn_norm, eps, w_next=w.pre_ffn_norm, h_out=h)
            act = gelu_mul_pairs(ops.linear(x2, fl.gate_up).contiguous())
            d = ops.linear(act, w.down).contiguous()
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
            if ple is None:
                h, x = residual_norm(h, d, w.post_ffn_norm, eps, scalar=w.layer_scalar,
                                     w_next=nxt, h_out=h)  # fmt: skip
                continue
            h, _ = residual_norm(h, d, w.post_ffn_norm, eps, h_out=h)
            g = ops.linear(h, w.ple_gate).contiguous()
            a2 = gelu_mul(g, ple[:, i].contiguous())
            p = ops.linear(a2, w.ple_proj).contiguous()
            h, x = residual_norm(h, p, w.ple_norm, eps, scalar=w.layer_scalar, w_next=nxt,
                                 h_out=h)  # fmt: skip
