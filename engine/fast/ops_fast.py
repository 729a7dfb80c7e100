"""FastOps: engine/ops.py's dispatch points with the Triton kernels first (the fast path).

Each method takes the same arguments as its reference in engine/ops.py and returns the same
result; a case outside what the kernels cover runs the reference body. The kernels work on any
device Triton can run on, so the CPU interpreter (TRITON_INTERPRET=1) checks the whole model on
them in CI (EngineOptions(fast="force")).

* decode-sized products (up to DECODE_ROWS rows) run the int4 GEMV on the packed words;
* larger products (prompt reading) dequantise the weight once per call into a full matrix and
  hand it to cuBLAS, in 16-bit where tensor cores exist and in fp32 where they do not (decided
  once per device by timing both; see `prefill_dtype`);
* embedding rows are unpacked from the same 4-bit table the lm_head GEMV reads;
* decode attention over a single KV head runs the split-cache kernel.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from engine import ops
from engine.kernels.attention_decode import DecodeAttention
from engine.kernels.launch import compiling_only
from engine.kernels.w4dequant import w4_dequantize, w4_gather_rows
from engine.kernels.w4gemv import w4_gemv
from engine.packed import PackedLinear

DECODE_ROWS = 4


def packed_ok(w) -> bool:
    """The kernels cover group-32 packed tables whose rows are whole words (every E2B linear)."""
    if not isinstance(w, PackedLinear):
        return False
    k = w.in_features
    return (
        w.group_size == 32
        and k % 32 == 0
        and w.packed.shape[1] * 8 == k
        and w.scales.shape[1] * 32 == k
        and w.packed.dtype == torch.int32
    )


def prefill_dtype(device_index: int, compute_dtype: torch.dtype) -> torch.dtype:
    """16-bit or fp32 for prompt-reading matmuls on this GPU, whichever a start-up timing of one
    chunk-sized product (dequantise + matmul, 256 x 1536 x 6144) finds faster. The seed's TU117
    read prompts twice as fast in fp32 (no tensor cores); tensor-core cards win in 16-bit.
    Not timed inside the warm-up's compile pass (its dequantisation does not run there): the
    compute dtype then, and the timing at the first real read."""
    if compiling_only():
        return compute_dtype
    return _timed_prefill_dtype(device_index, compute_dtype)


@functools.cache
def _timed_prefill_dtype(device_index: int, compute_dtype: torch.dtype) -> torch.dtype:
    dev = torch.device("cuda", device_index)
    m, k, n = 256, 1536, 6144
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
    scales = (torch.rand(n, k // 32, device=dev) * 0.02).to(compute_dtype)
    x = torch.randn(m, k, device=dev).to(compute_dtype)
    best, best_t = compute_dtype, float("inf")
    for dt in (compute_dtype, torch.float32):
        for _ in range(2):  # warm up cuBLAS and the dequant kernel
            F.linear(x.to(dt), w4_dequantize(packed, scales, dtype=dt))
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(10):
            F.linear(x.to(dt), w4_dequantize(packed, scales, dtype=dt))
        torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t0
        if elapsed < best_t:
            best, best_t = dt, elapsed
    return best


def linear_in(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed in the weight's dtype (`prefill_dtype`'s choice), returned in x's."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(weight.dtype), weight).to(x.dtype)


class FastOps(ops.Ops):
    """The fast path's dispatch points, bound to one engine (its attention kernels' scratch
    buffers)."""

    def __init__(self) -> None:
        self._attention: dict[tuple, DecodeAttention] = {}

    def linear4(self, x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
        """The int4 GEMV for decode-sized x, else a Triton dequantise + cuBLAS."""
        if not packed_ok(w):
            return ops.linear4(x, w)
        rows = x.numel() // w.in_features
        if rows <= DECODE_ROWS:
            return w4_gemv(x, w.packed, w.scales)
        dt = x.dtype
        if x.is_cuda:
            dt = prefill_dtype(x.device.index or 0, x.dtype)
        return linear_in(x, w4_dequantize(w.packed, w.scales, dtype=dt))

    def lm_head4(self, x: torch.Tensor, table: PackedLinear) -> torch.Tensor:
        """The int4 GEMV over the tied embedding table."""
        if not packed_ok(table):
            return ops.lm_head4(x, table)
        return self.linear4(x, table)

    def embed4_rows(self, ids: torch.Tensor, table: PackedLinear, dtype: torch.dtype):
        """Rows `ids` of the 4-bit table in `dtype`, unpacked from the shared 4-bit copy."""
        if not packed_ok(table):
            return ops.embed4_rows(ids, table, dtype)
        return w4_gather_rows(ids, table.packed, table.scales, dtype=dtype)

    def attention_for(self, device, slots, d, hq, window) -> DecodeAttention:
        """The split-cache attention (and its partial-result buffers) for one cache shape."""
        ring = window is not None
        key = (device, slots, d, hq, ring, int(window or 0))
        att = self._attention.get(key)
        if att is None:
            att = DecodeAttention(hq, d, slots, device, ring=ring, window=int(window or 0))
            self._attention[key] = att
        return att

    def attention_decode(
        self,
        q: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        cache_pos: torch.Tensor,
        q_pos: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """One query token over a one-KV-head cache by the split kernel; other shapes by the
        reference."""
        t, hq, d = q.shape
        slots, hkv = cache_k.shape[0], cache_k.shape[1]
        if (t != 1 or hkv != 1 or d & (d - 1) or d < 16 or cache_k.dtype != cache_v.dtype
                or cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1):  # fmt: skip
            return ops.attention_decode(q, cache_k, cache_v, cache_pos, q_pos, window)
        att = self.attention_for(q.device, slots, d, hq, window)
        out = torch.empty(1, hq, d, device=q.device, dtype=q.dtype)
        q_in = q if q.dtype == cache_k.dtype else q.to(cache_k.dtype)
        att(q_in.view(hq, d), cache_k[:, 0], cache_v[:, 0], q_pos, out=out.view(hq, d),
            slot_pos=cache_pos)  # fmt: skip
        return out
