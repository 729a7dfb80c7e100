"""How many bytes the engine holds on its device, per part (the seed's memory table).

Parts: the embedding table (which is also the lm_head when tied), a separate lm_head if the
checkpoint has one, the decoder layers (packed 4-bit linears, plain linears and norms), the
per-layer embedding table, the KV cache, and the small rest (per_layer_model_projection, final
norm). On CUDA the allocator's own figures (allocated, peak) come along, so the table can be
checked against what the device really holds.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel

MIB = 1 << 20


class MemoryReport(BaseModel):
    """Bytes on the device per part of the loaded model and its cache."""

    device: str
    dtype: str
    max_context: int
    embed_lm_head_bytes: int
    lm_head_bytes: int
    layers_bytes: int
    per_layer_table_bytes: int
    cache_bytes: int
    other_bytes: int
    total_bytes: int
    cache_bytes_per_token: float
    memory_cap_mib: int | None = None
    cuda_allocated_bytes: int | None = None
    cuda_peak_bytes: int | None = None

    def rows(self) -> list[tuple[str, float]]:
        """(part, MiB) rows for a table."""
        rows = [
            ("embed_tokens / lm_head", self.embed_lm_head_bytes),
            ("lm_head (untied)", self.lm_head_bytes),
            ("decoder layers", self.layers_bytes),
            ("per-layer table", self.per_layer_table_bytes),
            (f"KV cache ({self.max_context} tokens)", self.cache_bytes),
            ("other", self.other_bytes),
            ("total", self.total_bytes),
        ]
        if self.cuda_allocated_bytes is not None:
            rows.append(("cuda allocated", self.cuda_allocated_bytes))
            rows.append(("cuda peak", self.cuda_peak_bytes or 0))
        return [(name, round(b / MIB, 2)) for name, b in rows if b or name == "total"]


def build_report(
    parts: dict[str, int],
    cache_bytes: int,
    max_context: int,
    device: torch.device,
    dtype: torch.dtype,
    memory_cap_mib: int | None,
) -> MemoryReport:
    total = sum(parts.values()) + cache_bytes
    allocated = peak = None
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
    return MemoryReport(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        max_context=max_context,
        embed_lm_head_bytes=parts.get("embed", 0),
        lm_head_bytes=parts.get("lm_head", 0),
        layers_bytes=parts.get("layers", 0),
        per_layer_table_bytes=parts.get("per_layer_table", 0),
        cache_bytes=cache_bytes,
        other_bytes=parts.get("other", 0),
        total_bytes=total,
        cache_bytes_per_token=cache_bytes / max(1, max_context),
        memory_cap_mib=memory_cap_mib,
        cuda_allocated_bytes=allocated,
        cuda_peak_bytes=peak,
    )


def apply_memory_cap(device: torch.device, cap_mib: int | None) -> None:
    """Cap this process's share of a CUDA device (torch.cuda.set_per_process_memory_fraction), so
    a large card behaves like a small one for memory. No effect on the CPU."""
    if cap_mib is None or device.type != "cuda":
        return
    # set_per_process_memory_fraction wants an index: "cuda" alone means the current device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MIB / total), index)
