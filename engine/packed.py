"""Packed 4-bit and plain weight types, and their reference unpacking.

Layout (compressed-tensors "pack-quantized"): `packed` int32 [N, K // 8]: element k of row n
sits in word k // 8 at bits 4 * (k % 8)..+3 (element 0 lowest), stored unsigned as q + 8 with
q in [-8, 7]; `scales` bf16/fp16 [N, K // group_size]; `w[n, k] = q[n, k] * scales[n, k //
group_size]`. Row-wise packing means fusing projections that read the same input (q/k/v,
gate/up) is a concatenation along N (`PackedLinear.concat`).

Kept apart from engine/ops.py so the checkpoint reader depends on the weight types only, never
on the kernel dispatch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass
class PackedLinear:
    """A W4A16 weight kept packed on the device: 8 codes per int32 word, one scale per group."""

    packed: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # bf16 / fp16 [N, K // group_size]
    out_features: int  # N
    in_features: int  # K
    group_size: int = 32

    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scales)

    @staticmethod
    def concat(parts: list[PackedLinear]) -> PackedLinear:
        """Stack linears that read the same input into one (output rows concatenated)."""
        first = parts[0]
        if any(
            p.in_features != first.in_features or p.group_size != first.group_size for p in parts
        ):
            raise ValueError("only linears with the same input width and group size fuse")
        return PackedLinear(
            packed=torch.cat([p.packed for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            out_features=sum(p.out_features for p in parts),
            in_features=first.in_features,
            group_size=first.group_size,
        )


@dataclass
class PlainLinear:
    """A weight stored plain in the checkpoint (listed in `ignore`, or a width not divisible by
    the group size): used as is."""

    weight: torch.Tensor  # [N, K]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def nbytes(self) -> int:
        return _nbytes(self.weight)


Linear = PackedLinear | PlainLinear


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def unpack_codes(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, K // 8] -> signed 4-bit codes as int8 [N, K] (q in [-8, 7]).

    On little-endian machines (every CUDA device, x86, arm64) byte j of a word holds elements 2j
    (low nibble) and 2j + 1 (high nibble), so splitting bytes avoids 32-bit temporaries.
    """
    n = packed.shape[0]
    if sys.byteorder == "little":
        b = packed.contiguous().view(torch.uint8)  # [N, K // 2]
        nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(n, -1)
    else:
        shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
        nibbles = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(n, -1)
    return (nibbles[:, :in_features].to(torch.int8) - 8).contiguous()


def dequantize(w: PackedLinear, dtype: torch.dtype) -> torch.Tensor:
    """The 16/32-bit matrix [N, K] a PackedLinear stands for (exact in fp32; in 16-bit the
    product q * scale is rounded once, as a 16-bit multiply would)."""
    n, k, g = w.packed.shape[0], w.in_features, w.group_size
    codes = unpack_codes(w.packed, k).to(torch.float32).view(n, k // g, g)
    return (codes * w.scales.to(torch.float32).unsqueeze(-1)).view(n, k).to(dtype)
