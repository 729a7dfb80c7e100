"""The decode step of a batch: B sequences, one new token each, through every layer at once.

Why: one decode step reads ~1.28 GB of 4-bit weights on E2B whatever the number of rows, so
sixteen sequences sharing a step cost little more than one. Every batch size runs it, one row
included (a single sequence is a batch of one):

* the products are the int4 GEMM for 2..16 rows (engine/kernels/w4gemm.py), which reads each
  weight word once for all rows; a one-row batch keeps the single-token GEMV whose prologue
  makes the residual+norm before it (the measured-fastest arrangement for one stream);
* the q/k/v head norms and RoPE are one launch for all rows (qkv_rope_rows), which writes the
  new K/V rows straight into the pool, at rows computed once per step from the block tables,
  with the RoPE tables, in one launch (step_tables);
* attention reads each row's sequence through its block table (full layers) or its ring
  (sliding layers) with the paged split kernel (engine/kernels/attention_paged.py).

A one-row step makes the residual+norm before the per-layer gate and before the next layer's
q|k|v in that GEMV's prologue: only GEMVs of few programs take one (every program recomputes
the two norms over the whole vector, which the q|k|v and per-layer gate GEMVs absorb, but
gate|up and the lm_head would pay ~30% more instructions); the residual alternates between two
buffers, since a prologue reads one while its program 0 writes the other. Other arrangements
(residual+norm in GEMV epilogues, q/k/v work inside the attention, a gate|up prologue, PDL and
L2 prefetch, folding the residual+norm into the product before it, a CUDA C++ GEMV) were
measured no faster; their numbers stay in lab/journal.md.

A batch of up to PROLOGUE_ROWS rows makes the residual+norm before the per-layer gate in that
GEMV's prologue too, one grid row per batch row (the gate is a small matrix on E2B, whose GEMV
per row beats the mma kernel there). The mma product of up to AHEAD_ROWS rows requests a step's
scales and activations one step early, with its weights. The soft-cap and the greedy ids are
two launches (engine/kernels/greedy_tail.py).

Every intermediate is rounded where the reference rounds it, so a
row's logits equal the reference's for that sequence up to summation order (fp32: the tokens of
a batched row equal the same request run alone; tests/test_batching*.py).
"""

from __future__ import annotations

import torch

from engine.fast.fuse import FusedLayer
from engine.fast.ops_fast import FastOps, packed_ok
from engine.kernels.attention_paged import PagedDecodeAttention
from engine.kernels.fused import ple_mix, qkv_rope_rows, residual_norm, rmsnorm_rows
from engine.kernels.greedy_tail import cap_and_pick
from engine.kernels.step_inputs import step_tables
from engine.kernels.w4dequant import w4_gather_rows
from engine.kernels.w4gemm import w4_gemm
from engine.kernels.w4gemv import w4_gemv, w4_gemv_after_residual, w4_gemv_glu
from engine.kv_pool import KVPool

GEMM_ROWS = 16  # the most rows one int4 GEMM launch takes
GEMV_ROWS = 1  # rows past this go to w4_gemm (see BatchDecoder._mm)
GEMV_MAX_N = 65536  # the lm_head (262,144 rows) is read once by the GEMM at any row count
PROLOGUE_ROWS = 8  # the most rows whose per-layer gate takes the GEMV prologue
PROLOGUE_MAX_N = 512  # ... and the widest matrix (E2B's per-layer gate: 256 rows)
AHEAD_ROWS = 8  # the most rows whose mma products request operands a step early


def qkv_matrices(model, fused: list[FusedLayer]) -> list:
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
    if not 1 <= len(model.inv_freq) <= 2:  # step_tables: one or two layer kinds
        return False
    return (
        all(q is not None and packed_ok(q) for q in qkv_matrices(model, fused))
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


class BatchDecoder:
    """`step(tokens [B], positions [B], slots [B]) -> logits [B, V]` over a KVPool."""

    def __init__(
        self, model, pool: KVPool, fused: list[FusedLayer], kernels: FastOps, max_batch: int
    ) -> None:
        self.model = model
        self.pool = pool
        self.fused = fused
        self.ops = kernels
        self.max_batch = max_batch
        self.qkv_lin = qkv_matrices(model, fused)
        self._attention: dict[tuple[int, bool], PagedDecodeAttention] = {}

    def _attn(self, layer: int, rows: int) -> PagedDecodeAttention:
        """The paged attention (and its partial-result buffers) for a layer kind and a batch
        size: each graph bucket gets its own, split for its size."""
        cfg, pool = self.model.cfg, self.pool
        sliding = cfg.is_sliding(layer)
        key = (rows, sliding, cfg.layer_head_dims[layer])
        att = self._attention.get(key)
        if att is None:
            att = PagedDecodeAttention(
                cfg.num_attention_heads,
                cfg.layer_head_dims[layer],
                rows,
                pool.max_context,
                pool.device,
                ring=sliding,
                ring_slots=pool.ring_slots if sliding else 0,
                window=(cfg.sliding_window or 0) if sliding else 0,
                block_size=pool.block_size,
            )
            self._attention[key] = att
        return att

    def _mm(self, x: torch.Tensor, w, epi: int = 0, aux: torch.Tensor | None = None):
        """x [B, K] @ w^T: one row by the GEMV, 2..16 rows by w4_gemm (the warp-level mma kernel
        for bf16/fp16 on sm_80+, which reads each weight once for all rows: on the H200 its
        8-row product costs 1.3x the one-row GEMV summed over the E2B matrices, against 2.1x
        for the GEMV re-reading them; lab/journal.md), more in
        launches of 16."""
        rows = x.shape[0]
        if rows <= GEMV_ROWS and epi != 2 and w.out_features < GEMV_MAX_N:
            if epi == 1:
                return w4_gemv_glu(x, w.packed, w.scales)
            return w4_gemv(x, w.packed, w.scales)
        if rows <= GEMM_ROWS:
            return w4_gemm(x, w.packed, w.scales, epi=epi, aux=aux, ahead=rows <= AHEAD_ROWS)
        parts = [
            w4_gemm(
                x[r : r + GEMM_ROWS],
                w.packed,
                w.scales,
                epi=epi,
                aux=None if aux is None else aux[r : r + GEMM_ROWS],
                ahead=GEMM_ROWS <= AHEAD_ROWS,
            )  # fmt: skip
            for r in range(0, x.shape[0], GEMM_ROWS)
        ]
        return torch.cat(parts)

    def _linear(self, x: torch.Tensor, w) -> torch.Tensor:
        return self._mm(x, w) if packed_ok(w) else self.ops.linear(x, w)

    @torch.inference_mode()
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row; row b belongs to the sequence in pool slot slots[b] and sits at
        positions[b]. Padding rows point at the pool's padding slot. Given `ids` (int64 [B]),
        each row's greedy id is written there too."""
        m, cfg, pool = self.model, self.model.cfg, self.pool
        eps, b = cfg.rms_norm_eps, tokens.shape[0]
        single = b == 1
        h, ple = embed_tokens(m, self.ops, tokens, self._linear)
        spare = torch.empty_like(h)
        # RoPE's cos/sin per layer kind and the pool rows this step writes (one set for the
        # full layers, one for the rings): one launch
        kinds = list(m.inv_freq)
        tables, full_rows, ring_rows = step_tables(
            positions, slots, pool.block_tables, pool.block_size, pool.ring_slots,
            [m.inv_freq[k] for k in kinds], m.dtype,
        )  # fmt: skip
        rope = dict(zip(kinds, tables, strict=True))

        def then(y, w_post, mat, scalar=None, w_next=None, epi=0, aux=None):
            """The residual+norm h += norm(y) (* scalar), then the product of its norm by w_next
            (or of h itself): one launch for a single row, two for a batch."""
            nonlocal h, spare
            if single or (b <= PROLOGUE_ROWS and packed_ok(mat)
                          and mat.out_features <= PROLOGUE_MAX_N):  # fmt: skip
                out = w4_gemv_after_residual(y, h, w_post, eps, mat.packed, mat.scales, spare,
                                             scalar=scalar, w_next=w_next, epi=epi,
                                             aux=aux)  # fmt: skip
                h, spare = spare, h
                return out.reshape(b, -1)
            h, x = residual_norm(h, y, w_post, eps, scalar=scalar, w_next=w_next, h_out=h)
            return self._mm(x if w_next is not None else h, mat, epi=epi, aux=aux)

        pending = None
        for i, w in enumerate(m.layers):
            fl = self.fused[i]
            hq, hd = cfg.num_attention_heads, cfg.layer_head_dims[i]
            cos, sin = rope[cfg.layer_types[i]]
            if pending is None:
                qkv = self._mm(rmsnorm_rows(h, w.input_norm, eps), self.qkv_lin[i])
            else:
                y, w_post, scalar = pending
                qkv = then(y, w_post, self.qkv_lin[i], scalar=scalar, w_next=w.input_norm)
            own = w.k is not None
            if own:
                rows = ring_rows if cfg.is_sliding(i) else full_rows
                q, _, _ = qkv_rope_rows(qkv, w.q_norm, w.k_norm, cos, sin, hq,
                                        cfg.layer_kv_heads[i], hd, eps, v_from_k=w.v is None,
                                        kv_out=(pool.k[i], pool.v[i], rows))  # fmt: skip
            else:
                q, _, _ = qkv_rope_rows(qkv, w.q_norm, w.q_norm, cos, sin, hq, 0, hd, eps)
            src = cfg.kv_producer(i)
            attn = self._attn(i, b)(q, pool.k[src][:, 0], pool.v[src][:, 0], positions, slots,
                                    pool.block_tables)  # fmt: skip
            attn = attn.reshape(b, hq * hd)
            o = self._linear(attn, w.o)
            _, x2 = residual_norm(h, o, w.post_attn_norm, eps, w_next=w.pre_ffn_norm, h_out=h)
            act = self._mm(x2, fl.gate_up, epi=1)
            d = self._linear(act, w.down)
            if ple is None:
                pending = (d, w.post_ffn_norm, w.layer_scalar)
                continue
            a2 = then(d, w.post_ffn_norm, w.ple_gate, epi=2, aux=ple[:, i])
            pending = (self._linear(a2, w.ple_proj), w.ple_norm, w.layer_scalar)
        y, w_post, scalar = pending
        _, x = residual_norm(h, y, w_post, eps, scalar=scalar, w_next=m.final_norm, h_out=h)
        out = self.ops.lm_head(x, m.lm_head) if single else self._lm_head(x)
        # the soft-capped logits (capped in place), and each row's greedy id into `ids`
        return cap_and_pick(out, self.model.cfg.final_logit_softcapping, ids)

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        table = self.model.lm_head
        if packed_ok(table):
            return self._mm(x, table)
        return self.ops.lm_head(x, table)
