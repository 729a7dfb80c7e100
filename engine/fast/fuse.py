"""Load-time transform: q|k|v and gate|up of each layer concatenated into one packed matrix.

Projections that read the same input become one GEMV launch instead of two or three (65 fewer
launches per E2B token). The packed layout is row-wise, so the fused matrix is a plain
concatenation along N, and the model's own q/k/v/gate/up are then replaced by row-slice views of
it: no weight is held twice, and the reference path still sees its separate linears.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.ops import PackedLinear


@dataclass
class FusedLayer:
    """The fused matrices of one layer (None where a part is stored plain and cannot fuse)."""

    qkv: PackedLinear | None
    gate_up: PackedLinear | None
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


def fuse_projections(model) -> list[FusedLayer]:
    """Fuse every layer once (idempotent: the result is kept on the model)."""
    done = getattr(model, "_gpurig_fused", None)
    if done is not None:
        return done
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
        gate_up, gu_views = _fuse([w.gate, w.up])
        if gate_up is not None:
            w.gate, w.up = gu_views
        layers.append(
            FusedLayer(
                qkv=qkv, gate_up=gate_up, q_rows=w.q.out_features, mlp_width=w.gate.out_features
            )  # fmt: skip
        )
    model._gpurig_fused = layers
    return layers
