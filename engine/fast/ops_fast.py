"""The Triton implementations behind engine/ops.py's dispatch points (CUDA fast path).

Each function takes the same arguments as its reference in engine/ops.py and returns the same
result, or None when the case is outside what the kernels cover (the caller then runs the
reference). The functions work on any device Triton can run on, so the CPU interpreter
(TRITON_INTERPRET=1) can check the whole model on them in CI; engine/ops.py only routes CUDA
tensors here.

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

from engine.kernels.attention_decode import DecodeAttention
from engine.kernels.w4dequant import w4_dequantize, w4_gather_rows
from engine.kernels.w4gemv import w4_gemv

DECODE_ROWS = 4
_ATTENTION: dict[tuple, DecodeAttention] = {}


def _packed_ok(w) -> bool:
    """The kernels cover group-32 tables whose rows are whole words (every E2B linear)."""
    k = w.in_features
    return (
        w.group_size == 32
        and k % 32 == 0
        and w.packed.shape[1] * 8 == k
        and w.scales.shape[1] * 32 == k
        and w.packed.dtype == torch.int32
    )


@functools.cache
def _has_tensor_cores(device_index: int) -> bool:
    major, minor = torch.cuda.get_device_capability(device_index)
    name = torch.cuda.get_device_name(device_index)
    if "GTX 16" in name:  # Turing TU11x: sm_75 without tensor cores
        return False
    return major >= 7


@functools.cache
def prefill_dtype(device_index: int, compute_dtype: torch.dtype) -> torch.dtype:
    """16-bit or fp32 for prompt-reading matmuls on this GPU, whichever a start-up timing of one
    chunk-sized product (dequantise + matmul, 256 x 1536 x 6144) finds faster. The seed's TU117
    read prompts twice as fast in fp32 (no tensor cores); tensor-core cards win in 16-bit."""
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


def linear4(x: torch.Tensor, w) -> torch.Tensor | None:
    """x [..., K] @ W^T for a PackedLinear; None if the layout is outside the kernels."""
    if not _packed_ok(w):
        return None
    k = w.in_features
    rows = x.numel() // k
    if rows <= DECODE_ROWS:
        return w4_gemv(x, w.packed, w.scales)
    dt = x.dtype
    if x.is_cuda:
        dt = prefill_dtype(x.device.index or 0, x.dtype)
    weight = w4_dequantize(w.packed, w.scales, dtype=dt)
    if dt == x.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(dt), weight).to(x.dtype)


def embed4_rows(ids: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows `ids` of the 4-bit table in `dtype`, unpacked from the shared 4-bit copy."""
    if not _packed_ok(table):
        return None
    return w4_gather_rows(ids, table.packed, table.scales, dtype=dtype)


def _attention_for(device, slots, d, hq, window) -> DecodeAttention:
    ring = window is not None
    key = (device, slots, d, hq, ring, int(window or 0))
    att = _ATTENTION.get(key)
    if att is None:
        att = DecodeAttention(hq, d, slots, device, ring=ring, window=int(window or 0))
        _ATTENTION[key] = att
    return att


def attention_from_qkv(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    head_dim: int,
    position: torch.Tensor,
    cache,
    own_kv: bool,
    v_from_k: bool,
    window: int | None,
) -> torch.Tensor | None:
    """One token's attention from its fused q|k|v projection, the q/k/v norms, RoPE and (for
    an own-KV layer) the cache write inside the split kernel; None when the layout is outside
    it (the caller then runs qkv_rope + attention_decode)."""
    d, hq = head_dim, num_heads
    k, v = cache.k, cache.v
    if k.dim() != 3 or k.shape[1] != 1 or d & (d - 1) or d < 16 or k.dtype != v.dtype:
        return None
    kv_width = (d if v_from_k else 2 * d) if own_kv else 0  # k_eq_v layers carry no v
    if not qkv.is_contiguous() or qkv.numel() < hq * d + kv_width:
        return None
    if k.stride(0) != d or v.stride(0) != d or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    if own_kv and k_norm is None:
        return None
    att = _attention_for(qkv.device, k.shape[0], d, hq, window)
    out = torch.empty(1, hq, d, device=qkv.device, dtype=qkv.dtype)
    att.from_qkv(qkv, q_norm, k_norm, cos, sin, eps, k[:, 0], v[:, 0], position, cache.pos,
                 own_kv=own_kv, v_from_k=v_from_k, write_ring=cache.window is not None,
                 out=out.view(hq, d))  # fmt: skip
    return out


def attention_decode(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    cache_pos: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor | None:
    """One query token over a one-KV-head cache; None for shapes the kernel does not cover."""
    t, hq, d = q.shape
    slots, hkv = cache_k.shape[0], cache_k.shape[1]
    if t != 1 or hkv != 1 or d & (d - 1) or d < 16 or cache_k.dtype != cache_v.dtype:
        return None
    if cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1:
        return None
    att = _attention_for(q.device, slots, d, hq, window)
    out = torch.empty(1, hq, d, device=q.device, dtype=q.dtype)
    q_in = q if q.dtype == cache_k.dtype else q.to(cache_k.dtype)
    att(q_in.view(hq, d), cache_k[:, 0], cache_v[:, 0], q_pos, out=out.view(hq, d),
        slot_pos=cache_pos)  # fmt: skip
    return out
