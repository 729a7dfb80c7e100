"""Load-time transform: q|k|v and gate|up of each layer concatenated into one packed matrix.

Projections that read the same input become one GEMV launch instead of two or three (65 fewer
launches per E2B token). The packed layout is row-wise, so q|k|v is a plain concatenation along
N; gate|up is interleaved row by row (gate_i, up_i), so that each GEMV program holds both halves
of its outputs and can apply gelu(gate) * up itself. The model's own q/k/v/gate/up are then
replaced by row views of the fused matrix (strided for gate/up): no weight is held twice, and
the reference path still sees its separate linears.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops import PackedLinear


@dataclass
class FusedLayer:
    """The fused matrices of one layer (None where a part is stored plain and cannot fuse)."""

    qkv: PackedLinear | None
    gate_up: PackedLinear | None  # rows interleaved: 2i = gate_i, 2i + 1 = up_i
    q_rows: int
    mlp_width: int


def _views(fused: PackedLinear, parts: list[PackedLinear]) -> list[PackedLinear]:
    out, start = [], 0
    for p in parts:
        end = start + p.out_features
        out.append(
            PackedLinear(
                packed=fused.packed[start:end],
                scales=fused.scales[start:end],
                out_features=p.out_features,
                in_features=p.in_features,
                group_size=p.group_size,
            )
        )
        start = end
    return out


def _fuse(parts: list) -> tuple[PackedLinear | None, list]:
    if not all(isinstance(p, PackedLinear) for p in parts):
        return None, parts
    if len({(p.in_features, p.group_size, p.scales.dtype) for p in parts}) != 1:
        return None, parts
    fused = PackedLinear.concat(parts)
    return fused, _views(fused, parts)


def _interleave(gate, up) -> PackedLinear | None:
    parts = [gate, up]
    if not all(isinstance(p, PackedLinear) for p in parts) or gate.out_features != up.out_features:
        return None
    if len({(p.in_features, p.group_size, p.scales.dtype) for p in parts}) != 1:
        return None
    packed = torch.stack([gate.packed, up.packed], dim=1).reshape(-1, gate.packed.shape[1])
    scales = torch.stack([gate.scales, up.scales], dim=1).reshape(-1, gate.scales.shape[1])
    return PackedLinear(packed, scales, 2 * gate.out_features, gate.in_features, gate.group_size)


def fuse_projections(model) -> list[FusedLayer]:
    """Fuse every layer's q|k|v and gate|up. The layer's own q/k/v/gate/up become views into
    the fused matrices (no second copy); the caller (engine.runner.ModelRunner) keeps the result
    and hands it to the fused decoder and prefill, so it is made once per engine."""
    layers: list[FusedLayer] = []
    for w in model.layers:
        qkv_parts = [p for p in (w.q, w.k, w.v) if p is not None]
        qkv, views = _fuse(qkv_parts) if len(qkv_parts) > 1 else (None, qkv_parts)
        if qkv is not None:
            it = iter(views)
            w.q = next(it)
            if w.k is not None:
                w.k = next(it)
            if w.v is not None:
                w.v = next(it)
        gate_up = _interleave(w.gate, w.up)
        if gate_up is not None:
            w.gate, w.up = (
                PackedLinear(
                    gate_up.packed[i::2],
                    gate_up.scales[i::2],
                    p.out_features,
                    p.in_features,
                    p.group_size,
                )  # fmt: skip
                for i, p in enumerate((w.gate, w.up))
            )
        layers.append(
            FusedLayer(
                qkv=qkv, gate_up=gate_up, q_rows=w.q.out_features, mlp_width=w.gate.out_features
            )  # fmt: skip
        )
    return layers
