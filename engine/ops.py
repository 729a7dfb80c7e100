"""The engine's kernel dispatch points, with their PyTorch reference bodies.

Every 4-bit matrix product, embedding lookup and attention of the model goes through `Ops`, the
set of these functions a model is built with (`Gemma4Model.ops`). The reference set is `Ops()`;
engine/fast/ops_fast.py's `FastOps` subclass puts the Triton kernels first, with these bodies
as the fallback. The reference bodies stay forever: they are the CPU path and the ground truth
the kernel tests compare against. This module imports nothing of the engine above it.

Conventions shared by every function:
- Activations are 16- or 32-bit floats (`x.dtype` is the compute dtype); results come back in
  that dtype. No function needs a Python int that changes from token to token: positions,
  lengths and cache-slot positions are device tensors, so a decode step can be captured in a
  CUDA graph.
- 4-bit weights arrive as a `PackedLinear`, plain (16-bit) ones as a `PlainLinear`; both and
  their layout are in engine/packed.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import attend_chunk
from engine.packed import Linear, PackedLinear, PlainLinear, dequantize, unpack_codes

__all__ = ["Linear", "PackedLinear", "PlainLinear", "dequantize", "unpack_codes"]

# ---------------------------------------------------------------------------------------------
# matrix products


def linear4(x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] with W a PackedLinear.

    Reference: dequantize the whole matrix for this call (one layer's weight at a time; the
    model never holds a 16-bit copy), then a dense matmul in x's dtype.
    Fast path (engine.fast.ops_fast.FastOps): the int4 GEMV for decode-sized x, else a Triton
    dequantise + cuBLAS.
    """
    return F.linear(x, dequantize(w, x.dtype))


def linear_plain(x: torch.Tensor, w: PlainLinear) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] for a weight stored plain."""
    return F.linear(x, w.weight.to(x.dtype))


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """Dispatch on how the weight is stored."""
    if isinstance(w, PackedLinear):
        return linear4(x, w)
    return linear_plain(x, w)


# ---------------------------------------------------------------------------------------------
# embedding tables (embed_tokens = lm_head, and the per-layer table)


def embed4_rows(ids: torch.Tensor, table: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [T] of a 4-bit table -> [T, width] in `dtype` (codes * scales, unscaled).

    The table uses the PackedLinear layout with one row per token (see engine/FORMAT.md).
    Only the looked-up rows are unpacked.
    """
    rows = PackedLinear(
        packed=table.packed.index_select(0, ids),
        scales=table.scales.index_select(0, ids),
        out_features=int(ids.numel()),
        in_features=table.in_features,
        group_size=table.group_size,
    )
    return dequantize(rows, dtype)


def embed_rows(ids: torch.Tensor, table: Linear, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table stored plain or 4-bit -> [T, width] in `dtype`."""
    if isinstance(table, PackedLinear):
        return embed4_rows(ids, table, dtype)
    return table.weight.index_select(0, ids).to(dtype)


def lm_head4(x: torch.Tensor, table: PackedLinear) -> torch.Tensor:
    """x [T, H] @ E^T -> logits [T, V] with E the 4-bit embed_tokens table (tied lm_head).

    Reference: dequantizes LM_HEAD_BLOCK vocabulary rows at a time, so the temporary stays small
    even for a 262144-row table on a small GPU. Fast path: the int4 GEMV over the same table.
    """
    out = []
    for start in range(0, table.out_features, LM_HEAD_BLOCK):
        rows = slice(start, start + LM_HEAD_BLOCK)
        packed = table.packed[rows]
        block = PackedLinear(
            packed, table.scales[rows], packed.shape[0], table.in_features, table.group_size
        )
        out.append(F.linear(x, dequantize(block, x.dtype)))
    return torch.cat(out, dim=-1)


LM_HEAD_BLOCK = 16384


def lm_head(x: torch.Tensor, table: Linear) -> torch.Tensor:
    """Logits from a plain or 4-bit output table (before soft-capping)."""
    if isinstance(table, PackedLinear):
        return lm_head4(x, table)
    return linear_plain(x, table)


# ---------------------------------------------------------------------------------------------
# attention
#
# Shapes: q [T, Hq, D] (already normed and rotated); keys / values [S, Hkv, D] with Hq a
# multiple of Hkv (query head h reads KV head h // (Hq // Hkv)); `key_pos` int64 [S] is the
# sequence position held by each key slot (-1 = empty); `q_pos` int64 [T] the positions of the
# queries. A query at p sees a key at k when 0 <= k <= p and, for sliding layers, k > p - window.
# Scale is 1.0 (Gemma 4 normalises q and k instead). Scores are computed in the activation
# dtype, softmax in fp32, as transformers' eager path does. Plain matmul + softmax on purpose:
# torch SDPA's memory-efficient kernel returned a wrong last row at chunk sizes 33, 65, 97 with an
# explicit mask and broadcast K/V (see the seed notes).


SCORE_BUDGET = 1 << 26  # score elements per block of query rows (256 MiB in fp32)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: torch.Tensor | int | None,
) -> torch.Tensor:
    """Blocks of query rows, so a long prompt's scores [heads, rows, keys] stay bounded (rows
    are independent: the result is the same as in one block)."""
    t, hq = q.shape[0], q.shape[1]
    rows = max(1, SCORE_BUDGET // max(1, hq * keys.shape[0]))
    if t <= rows:
        return _attend_block(q, keys, values, key_pos, q_pos, window)
    return torch.cat(
        [
            _attend_block(q[i : i + rows], keys, values, key_pos, q_pos[i : i + rows], window)
            for i in range(0, t, rows)
        ]
    )


def _attend_block(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: torch.Tensor | int | None,
) -> torch.Tensor:
    t, hq, d = q.shape
    s, hkv = keys.shape[0], keys.shape[1]
    group = hq // hkv
    qg = q.reshape(t, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * t, d)
    scores = torch.bmm(qg, keys.transpose(0, 1).transpose(1, 2)).view(hkv, group, t, s)
    kp = key_pos.unsqueeze(0)  # [1, S]
    qp = q_pos.unsqueeze(1)  # [T, 1]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible = visible & (kp > qp - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs.view(hkv, group * t, s), values.transpose(0, 1))  # [Hkv, G*T, D]
    return out.view(hkv, group, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)


def attention_prefill(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    cache_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    score_budget: int | None = None,
    prefix_visible: bool = False,
) -> torch.Tensor:
    """Attention of a prompt chunk: T queries over the cached keys plus the chunk's own keys.

    q [T, Hq, D]; k_new / v_new [T, Hkv, D] the chunk's keys and values (positions `q_pos`);
    cache_k / cache_v [S, Hkv, D] what the layer's cache held BEFORE this chunk is written, with
    `cache_pos` [S] their positions (-1 = empty). For a sliding layer that is the whole ring; for
    a full layer the filled prefix. The caller writes the chunk into the cache afterwards (a ring
    cannot take the chunk first: it would overwrite keys earlier queries of the chunk still see).
    Returns [T, Hq, D].

    score_budget (default SCORE_BUDGET) bounds the score elements alive at once: when the
    scores of the whole chunk fit in half of it they are made in one block as below (short
    prompts: unchanged); otherwise `engine.attention.attend_chunk` walks the keys in slices
    with an online softmax, so memory does not grow with the cache (the chunk's positions must
    then be consecutive). prefix_visible: every cached key is visible to every query (a full
    layer's filled prefix), so its slices need no mask.
    """
    budget = SCORE_BUDGET if score_budget is None else score_budget
    keys = cache_k.shape[0] + q.shape[0]
    hkv, d = k_new.shape[1], k_new.shape[2]
    # one block only while its scores and the keys it concatenates are small beside the budget
    if q.shape[1] * q.shape[0] * keys * 2 > budget or hkv * d * keys * 8 > budget:
        return attend_chunk(q, k_new, v_new, cache_k, cache_v, cache_pos, q_pos, window, budget,
                            prefix_visible)  # fmt: skip
    keys = torch.cat([cache_k, k_new.to(cache_k.dtype)]).to(q.dtype)
    values = torch.cat([cache_v, v_new.to(cache_v.dtype)]).to(q.dtype)
    key_pos = torch.cat([cache_pos, q_pos])
    return _attend(q, keys, values, key_pos, q_pos, window)


def attention_decode(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    cache_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Attention of one new token (T = 1, or the last prompt token of a KV-shared layer) over a
    cache that already holds its own key: q [T, Hq, D]; cache_k / cache_v [S, Hkv, D] the whole
    cache buffer (S = max context for full layers, the window for sliding rings); cache_pos [S]
    each slot's position (-1 = empty); q_pos [T]. Returns [T, Hq, D].
    Fast path (FastOps): the split-cache Triton kernel (one KV head, T = 1)."""
    return _attend(q, cache_k.to(q.dtype), cache_v.to(q.dtype), cache_pos, q_pos, window)


def attention_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Attention of B decode rows at once, each over its OWN keys (rows of different sequences):
    q [B, Hq, D]; keys / values [B, S, Hkv, D] row b's keys padded to S; key_pos [B, S] their
    positions (-1 = empty or padding); q_pos [B]. Returns [B, Hq, D].

    The same function as `attention_decode` on each row alone (scores in the activation dtype,
    softmax in fp32): why it exists is that one batched product replaces B calls, which on the
    CPU reference cost B times the host time. Masked scores get the lowest finite float, not
    -inf: a row with nothing visible (a padding row whose own key another padding row
    overwrote) then averages finite values instead of making NaN, which its K/V would carry into
    the padding block that live rows' masked (zero-probability) columns may still gather."""
    b, hq, d = q.shape
    hkv = keys.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, keys.to(q.dtype).permute(0, 2, 3, 1)).float()  # [B, Hkv, G, S]
    kp, qp = key_pos[:, None, None, :], q_pos.reshape(b, 1, 1, 1)
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible = visible & (kp > qp - window)
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.to(q.dtype).transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(b, hq, d)


# ---------------------------------------------------------------------------------------------
# small elementwise pieces (kept here so a fused kernel can replace them too)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm: in fp32, x * (mean(x^2) + eps)^-0.5 * w (w as is, not 1 + w)."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, D] for NeoX half-split RoPE from fp32 inverse frequencies [D / 2]."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.unsqueeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated: x * cos + rotate_half(x) * sin (cos / sin [T, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Ops:
    """The dispatch points one model computes with: the reference bodies above.
    engine.fast.ops_fast.FastOps overrides the kernel-backed ones."""

    linear4 = staticmethod(linear4)
    linear_plain = staticmethod(linear_plain)
    embed4_rows = staticmethod(embed4_rows)
    lm_head4 = staticmethod(lm_head4)
    attention_decode = staticmethod(attention_decode)
    attention_rows = staticmethod(attention_rows)
    rms_norm = staticmethod(rms_norm)
    rope_cos_sin = staticmethod(rope_cos_sin)
    apply_rope = staticmethod(apply_rope)
    gelu_tanh = staticmethod(gelu_tanh)
    attention_prefill = staticmethod(attention_prefill)

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        """Dispatch on how the weight is stored."""
        if isinstance(w, PackedLinear):
            return self.linear4(x, w)
        return self.linear_plain(x, w)

    def embed_rows(self, ids: torch.Tensor, table: Linear, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(table, PackedLinear):
            return self.embed4_rows(ids, table, dtype)
        return table.weight.index_select(0, ids).to(dtype)

    def lm_head(self, x: torch.Tensor, table: Linear) -> torch.Tensor:
        if isinstance(table, PackedLinear):
            return self.lm_head4(x, table)
        return self.linear_plain(x, table)
