"""Attention of a prompt chunk over a long cache in bounded memory: key slices, online softmax.

Why: `ops.attention_prefill`'s one-block body concatenates the whole cached prefix with the
chunk's keys and materialises scores [heads, rows, keys]. At 131,000 cached positions that is a
copy of the full layer's keys and values (2 x 128 MiB) and gigabytes of scores per chunk: memory
that grows with the prompt, which a 4 GB card does not have (issue 13: a capped H200 ran out at
8,192 tokens). Here each row block of queries walks its keys in slices of at most
`score_budget` score elements, carrying the running max, the running sum and an fp32
accumulator (the online softmax of flash attention), so every temporary is bounded by the
budget and the chunk, never by the cache. Nothing is concatenated: the cache and the chunk's
own keys are read as views.

Only the slices a row block can see are visited: a full layer's prefix (all of it) and the
chunk's keys up to the block's last row; a sliding layer's ring only while the window still
reaches it, and the chunk's keys inside the window. With `prefix_visible` (a full layer whose
slots 0..start-1 hold positions 0..start-1, as `read_prompt` leaves them) the prefix needs no
mask at all, and on CUDA it is one call of torch's memory-efficient attention kernel (no
scores in memory; its log-sum-exp merged as one more online-softmax step): on the H200 that
halved the time of a capped 131,000-token read (lab/journal.md, v8).

Same function as `ops._attend` on the concatenated keys: scores in the activation dtype,
softmax in fp32, probabilities cast to the activation dtype for the value product. What
differs is the order of the sums and where the normalisation happens (after the value product,
not before), so results agree to rounding (fp32: ~1e-7), not bit for bit; the memory-efficient
kernel keeps its scores in fp32, so it rounds less than the reference.
"""

from __future__ import annotations

import torch

SCORE_BYTES = 6  # peak bytes per score element of one slice: bf16 scores + their fp32 copy
# The most query rows in one block, whatever the budget allows. A block of R rows visits every
# key any of its rows sees and masks the rest: a sliding layer's block spans window + R keys for
# window useful ones per row, a full layer's diagonal block R x R keys for half of them useful
# (the keys before the block are seen by every row and go through the unmasked path). With the
# 4,096-row blocks of an uncapped chunk that was 4.6x and 2x the useful scores, and the uncapped
# 131k read was slower than the capped one (lab/journal.md, v8); these caps bound the waste.
FULL_BLOCK_ROWS = 1024
SLIDING_BLOCK_MIN_ROWS = 256  # a tiny window still gets blocks of this many rows


def attend_chunk(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    cache_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    score_budget: int,
    prefix_visible: bool = False,
    prefix_sdpa: bool = True,
) -> torch.Tensor:
    """`ops.attention_prefill`'s result [T, Hq, D] with at most `score_budget` score elements
    alive at a time. Arguments as there; the chunk's positions must be consecutive
    (q_pos = start .. start + T - 1)."""
    t, hq, d = q.shape
    hkv = k_new.shape[1]
    group = hq // hkv
    rows = max(1, min(t, score_budget // max(1, hq * 64)))  # at least 64 keys per slice
    rows = min(rows, FULL_BLOCK_ROWS if window is None else max(window, SLIDING_BLOCK_MIN_ROWS))
    keys_per_slice = max(1, score_budget // (hq * rows))
    out = torch.empty_like(q)
    for a0 in range(0, t, rows):
        a1 = min(t, a0 + rows)
        segments = _segments(cache_k, cache_v, cache_pos, k_new, v_new, q_pos, window, a0, a1,
                             prefix_visible)  # fmt: skip
        qb = q[a0:a1]
        qg = qb.reshape(a1 - a0, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)
        state = OnlineSoftmax(hkv, qg.shape[1], d, q.device)
        for keys, values, kpos, masked in segments:
            if (
                not masked
                and keys.shape[0]
                and _sdpa_ok(qg, prefix_sdpa)
                and state.add_whole(qg, keys, values)
            ):
                continue
            for s0 in range(0, keys.shape[0], keys_per_slice):
                s1 = min(keys.shape[0], s0 + keys_per_slice)
                kp = kpos[s0:s1] if masked else None
                state.add(qg, keys[s0:s1], values[s0:s1], kp, q_pos[a0:a1], window, group)
        res = state.result(q.dtype)  # [Hkv, G*rows, D]
        out[a0:a1] = res.view(hkv, group, a1 - a0, d).permute(2, 0, 1, 3).reshape(-1, hq, d)
    return out


def _segments(cache_k, cache_v, cache_pos, k_new, v_new, q_pos, window, a0, a1, prefix_visible):
    """(keys, values, key positions, needs a mask) that rows a0..a1-1 of the chunk can see."""
    segs = []
    if cache_k.shape[0]:
        if window is None:
            segs.append((cache_k, cache_v, cache_pos, not prefix_visible))
        elif a0 < window - 1:  # the ring holds positions < start; later rows see none of them
            segs.append((cache_k, cache_v, cache_pos, True))
    lo = 0 if window is None else max(0, a0 - window + 1)
    if window is None and a0 > 0:  # the chunk's keys before the block: visible to every row
        segs.append((k_new[:a0], v_new[:a0], q_pos[:a0], False))
        lo = a0
    segs.append((k_new[lo:a1], v_new[lo:a1], q_pos[lo:a1], True))
    return segs


def _sdpa_ok(qg: torch.Tensor, allowed: bool = True) -> bool:
    """Unmasked key ranges (a full layer's prefix) go through torch's memory-efficient
    attention kernel on CUDA: one launch, no scores in memory, its log-sum-exp merged into
    the online softmax. Only without a mask and without broadcast keys (the query heads
    sharing a KV head are folded into rows), not the arrangement that returned wrong rows for
    the seed. allowed False (the tests' reference): the sliced softmax everywhere."""
    return (
        allowed
        and qg.is_cuda
        and qg.shape[-1] % 8 == 0
        and qg.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


class OnlineSoftmax:
    """Running max m, sum l and accumulator acc (fp32) of one row block's online softmax."""

    def __init__(self, hkv: int, rows: int, d: int, device: torch.device) -> None:
        lowest = torch.finfo(torch.float32).min  # not -inf: a fully masked slice gives no NaN
        self.m = torch.full((hkv, rows, 1), lowest, dtype=torch.float32, device=device)
        self.l = torch.zeros((hkv, rows, 1), dtype=torch.float32, device=device)
        self.acc = torch.zeros((hkv, rows, d), dtype=torch.float32, device=device)

    def add(self, qg, keys, values, kpos, q_pos, window, group) -> None:
        hkv, rows, _ = qg.shape
        s16 = torch.bmm(qg, keys.to(qg.dtype).permute(1, 2, 0))  # scores in the activation dtype
        s = s16.float()
        del s16
        if kpos is not None:
            kp, qp = kpos.unsqueeze(0), q_pos.unsqueeze(1)
            hidden = (kp < 0) | (kp > qp)
            if window is not None:
                hidden |= kp <= qp - window
            s.view(hkv, group, -1, s.shape[-1]).masked_fill_(hidden, float("-inf"))
        m_new = torch.maximum(self.m, s.amax(-1, keepdim=True))
        s.sub_(m_new).exp_()
        corr = torch.exp(self.m - m_new)
        self.l.mul_(corr).add_(s.sum(-1, keepdim=True))
        p = s.to(qg.dtype)
        del s
        self.acc.mul_(corr).add_(torch.bmm(p, values.to(qg.dtype).transpose(0, 1)))
        self.m = m_new

    def add_whole(self, qg, keys, values) -> bool:
        """Every key visible to every row: one memory-efficient attention call returns the
        normalised output and each row's log-sum-exp, merged as one more online-softmax step.
        False (nothing merged) where torch has no such kernel for these shapes."""
        hkv, rows, d = qg.shape
        k4 = keys.to(qg.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        v4 = values.to(qg.dtype).transpose(0, 1).unsqueeze(0)
        try:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                qg.unsqueeze(0), k4, v4, None, True, 0.0, False, scale=1.0
            )[:2]
        except (RuntimeError, NotImplementedError):
            return False
        lse = lse[0, :, :rows].unsqueeze(-1).float()  # [Hkv, rows, 1]
        m_new = torch.maximum(self.m, lse)
        corr, w = torch.exp(self.m - m_new), torch.exp(lse - m_new)
        self.l.mul_(corr).add_(w)
        self.acc.mul_(corr).add_(out[0].float().mul_(w))
        self.m = m_new
        return True

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.acc / self.l).to(dtype)
