"""Prompt chunks through the KV-producing layers with fused kernels: the same function as
`Gemma4Model.prefill_chunk(..., last=False)` in ~60 launches per layer instead of ~140.

Why: reading a prompt is bound by the host, not the GPU. On the H200 a 32-token prompt
launched 3,507 kernels that ran for 7 ms inside a 92 ms read (lab/journal.md, v7); each eager
PyTorch op or Triton launch costs the host ~20 us however little it computes. Here every
RMSNorm is one kernel instead of seven ops, each residual+norm pair is one kernel that also
makes the next norm, q|k|v and gate|up are one dequantise + one matmul each (the matrices fused
at load for decode), the q/k/v head norms and RoPE are one launch, and GELU(gate)*up reads the interleaved gate|up output directly. The
attention over the prompt and the cache write stay the reference's ops. Every intermediate is
rounded where the reference rounds it, so the cache equals the reference's up to the matmuls'
summation order. The q/k/v head norms and RoPE are one kernel for the whole chunk.

Only the body of a prompt comes here: the last token goes through the decode step (the
scheduler feeds it as the sequence's first decode row), so the KV-shared layers never run on a
prompt chunk.
"""

from __future__ import annotations

import torch

from engine.fast.fuse import FusedLayer
from engine.fast.ops_fast import FastOps, linear_in, packed_ok, prefill_dtype
from engine.fast.prefill_attention import PassAttention, to_device
from engine.kernels.fused import (
    gelu_mul,
    gelu_mul_pairs,
    ple_mix,
    qkv_rope_rows,
    residual_norm,
    rmsnorm_rows,
)
from engine.kernels.w4dequant import w4_dequantize, w4_gather_rows


def supported(model, fused: list[FusedLayer]) -> bool:
    """True when every KV-producing layer has packed, fusable q|k|v and gate|up and a
    power-of-two head width (qkv_rope_rows spans a head with tl.arange) (E2B does)."""
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
    """`chunks([(ids [T], start, cache), ...])`: what `prefill_chunk(ids, start, cache,
    last=False)` does for each, in one pass."""

    def __init__(self, model, fused: list[FusedLayer], kernels: FastOps,
                 pass_attention: bool = True) -> None:  # fmt: skip
        self.model = model
        self.fused = fused
        self.ops = kernels
        self.weights: torch.Tensor | None = None  # one buffer every dequantised matrix reuses
        # one launch per layer for all segments where it applies (engine/fast/prefill_attention.py);
        # False: segment by segment everywhere, the tests' reference
        self.pass_attention = pass_attention
        # captured passes (engine/fast/prefill_graph.py), once the runner adds them
        self.graphs = None

    def release(self) -> None:
        """Drop the dequantisation buffer (between prompts: decode does not need it)."""
        self.weights = None

    def _linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """ops.linear for a chunk, the 4-bit matrix dequantised into the reused buffer (one
        block of the allocator for every matrix of every chunk, instead of one per call)."""
        if not packed_ok(w) or not x.is_cuda:
            return self.ops.linear(x, w)
        dt = prefill_dtype(x.device.index or 0, x.dtype)
        n, k = w.out_features, w.in_features
        buf = self.weights
        if buf is None or buf.dtype != dt or buf.numel() < n * k:
            self.weights = buf = None  # free the old one first (the cap)
            self.weights = buf = torch.empty(_largest_matrix(self.model, self.fused), dtype=dt,
                                             device=x.device)  # fmt: skip
        return linear_in(
            x, w4_dequantize(w.packed, w.scales, dtype=dt, out=buf[: n * k].view(n, k))
        )

    def _embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's hidden state and per-layer inputs from the 4-bit tables: the rows unpacked
        by one gather each, the mix by one kernel writing over the lookup (the reference's
        seven-op chain holds ~8 per-layer-input-sized temporaries per token)."""
        m, cfg = self.model, self.model.cfg
        tables = packed_ok(m.embed) and (m.ple_table is None or packed_ok(m.ple_table))
        if not (tables and ids.is_cuda):  # (the CPU interpreter would run a program per row)
            h, ple = m.embed_ids(ids)
            return h.contiguous(), ple
        h = w4_gather_rows(ids, m.embed.packed, m.embed.scales, dtype=m.dtype, mul=m.embed_scale)
        if m.ple_table is None:
            return h, None
        t, n, p = ids.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        tok = w4_gather_rows(ids, m.ple_table.packed, m.ple_table.scales, dtype=m.dtype,
                             mul=m.ple_scale)  # fmt: skip
        proj = self._linear(h, m.ple_projection).contiguous()
        ple = ple_mix(proj.view(t * n, p), tok.view(t * n, p), m.ple_projection_norm, t * n, p,
                      cfg.rms_norm_eps, cfg.hidden_size**-0.5, 2.0**-0.5, out=tok.view(t * n, p))  # fmt: skip
        return h, ple.view(t, n, p)

    @torch.inference_mode()
    def chunks(self, segments: list[tuple[torch.Tensor, int, object]],
               score_budget: int | None = None) -> None:  # fmt: skip
        """Several sequences' chunks in one pass: (ids, start, cache) each. The products, norms
        and RoPE run once over all their rows; only the attention and the cache write go
        segment by segment (each over its own cache). Why: reading a prompt is host-bound
        (~900 launches per chunk on E2B whatever its length), so eight 512-token prompts read
        together cost about what one does alone."""
        if self.graphs is not None and self.graphs.run(segments):
            return
        m = self.model
        ids = segments[0][0] if len(segments) == 1 else torch.cat([s[0] for s in segments])
        spans = []  # (first row, rows, positions, start, cache) per segment
        host = torch.cat([torch.arange(s, s + i.shape[0]) for i, s, _ in segments])
        positions = to_device(host, m.device)  # one copy for the whole pass
        row = 0
        for seg_ids, start, cache in segments:
            n_rows = seg_ids.shape[0]
            spans.append((row, n_rows, positions[row : row + n_rows], start, cache))
            row += n_rows
        joint = None
        if self.pass_attention:
            joint = PassAttention.plan([(sp[1], sp[3], sp[4]) for sp in spans], positions,
                                       m.dtype)  # fmt: skip
        self.forward(ids, positions, joint, spans, score_budget)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, joint: PassAttention | None,
                spans: list | None = None, score_budget: int | None = None) -> None:  # fmt: skip
        """The pass on device tensors: ids and positions [T], the attention by `joint` (or, where
        it is None, segment by segment over `spans`). Nothing here reads the device from the
        host, so with a `PassAttention.fresh` it can be captured as a CUDA graph."""
        m, cfg = self.model, self.model.cfg
        eps, t = cfg.rms_norm_eps, ids.shape[0]
        h, ple = self._embed(ids)
        rope = m.rope(positions)
        layers = m.layers
        n = cfg.first_shared_layer
        x = rmsnorm_rows(h, layers[0].input_norm, eps)
        for i in range(n):
            w, fl = layers[i], self.fused[i]
            hq, kvh, hd = cfg.num_attention_heads, cfg.layer_kv_heads[i], cfg.layer_head_dims[i]
            cos, sin = rope[cfg.layer_types[i]]
            qkv = self._linear(x, fl.qkv)
            q, k, v = qkv_rope_rows(qkv, w.q_norm, w.k_norm, cos, sin, hq, kvh, hd, eps,
                                    v_from_k=w.v is None)  # fmt: skip
            window = cfg.sliding_window if cfg.is_sliding(i) else None
            if joint is not None:
                attn = joint.attend(i, q, k, v, window)
                joint.write(i, k, v)
            else:
                attn = self._attend_each(i, q, k, v, spans, window, score_budget)
            o = self._linear(attn.reshape(t, -1), w.o).contiguous()
            del attn, q, k, v, qkv
            h, x2 = residual_norm(h, o, w.post_attn_norm, eps, w_next=w.pre_ffn_norm, h_out=h)
            act = gelu_mul_pairs(self._linear(x2, fl.gate_up).contiguous())
            d = self._linear(act, w.down).contiguous()
            del act
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
            if ple is None:
                h, x = residual_norm(h, d, w.post_ffn_norm, eps, scalar=w.layer_scalar,
                                     w_next=nxt, h_out=h)  # fmt: skip
                continue
            h, _ = residual_norm(h, d, w.post_ffn_norm, eps, h_out=h)
            g = self._linear(h, w.ple_gate).contiguous()
            a2 = gelu_mul(g, ple[:, i].contiguous())
            p = self._linear(a2, w.ple_proj).contiguous()
            h, x = residual_norm(h, p, w.ple_norm, eps, scalar=w.layer_scalar, w_next=nxt,
                                 h_out=h)  # fmt: skip

    def _attend_each(self, i, q, k, v, spans, window, score_budget) -> torch.Tensor:
        """Layer i's attention segment by segment, each written to its cache after (where
        `PassAttention` does not apply)."""
        parts = []
        for r0, n_rows, pos, start, cache in spans:
            lc = cache.layers[i]
            if lc.window is None:  # full layer: the filled prefix
                ck, cv, cp = lc.k[:start], lc.v[:start], lc.pos[:start]
            else:  # sliding ring: all of it
                ck, cv, cp = lc.k, lc.v, lc.pos
            qs, ks, vs = q[r0 : r0 + n_rows], k[r0 : r0 + n_rows], v[r0 : r0 + n_rows]
            # a full layer's slots 0..start-1 hold positions 0..start-1 (read in order)
            parts.append(self.ops.attention_prefill(qs, ks, vs, ck, cv, cp, pos, window,
                                                    score_budget,
                                                    prefix_visible=lc.window is None))  # fmt: skip
            lc.write(ks, vs, pos)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _largest_matrix(model, fused) -> int:
    """Elements of the largest matrix a chunk dequantises (fused q|k|v or gate|up, o, down,
    the per-layer matrices, the per-layer-input projection)."""
    mats = [model.ple_projection] if model.ple_projection is not None else []
    for i in range(model.cfg.first_shared_layer):
        w, fl = model.layers[i], fused[i]
        mats += [fl.qkv, fl.gate_up, w.o, w.down, w.ple_gate, w.ple_proj]
    return max(mt.out_features * mt.in_features for mt in mats if mt is not None)
