"""How many bytes the engine holds on its device, per part (the seed's memory table).

Parts: the embedding table (which is also the lm_head when tied), a separate lm_head if the
checkpoint has one, the decoder layers (packed 4-bit linears, plain linears and norms), the
per-layer embedding table, the KV cache, and the small rest (per_layer_model_projection, final
norm). On CUDA the allocator's own figures (allocated, peak) come along, so the table can be
checked against what the device really holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from engine.errors import EngineError
from engine.options import allocator_configured, allocator_settings_from_env

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
    a large card behaves like a small one for memory; with expandable segments. No effect on the
    CPU."""
    if cap_mib is None or device.type != "cuda":
        return
    _expandable_segments()
    # set_per_process_memory_fraction wants an index: "cuda" alone means the current device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MIB / total), index)


# ---------------------------------------------------------------------------------------------
# reading a prompt within what is left: the chunk and the attention's score budget


MIN_CHUNK = 16  # below this a chunk's launches cost more than its work: refuse instead
SCORE_BUDGET_MAX = 1 << 28  # score elements per attention slice on a roomy device (1.5 GiB)
SCORE_BYTES = 7  # bytes per score element at the slice's peak (6, and the mask; see attention)
SAFETY_BYTES = 96 * MIB  # cuBLAS workspaces, the decode graph's pool, allocator rounding
PER_TOKEN_MARGIN = 1.25  # on the per-token estimate below (it counts the peak stage only)


class PromptMemoryError(EngineError):
    """A prompt cannot be read within the memory left on the device (under the cap)."""

    def __init__(self, requested: int, largest: int, available: int, needed: int,
                 holes: tuple[int, ...] = ()) -> None:  # fmt: skip
        held = ""
        if holes:
            held = (f"; {sum(holes) / MIB:.0f} MiB more lies in holes of fixed allocator "
                    f"segments (the largest {max(holes) / MIB:.0f} MiB), which only smaller "
                    "blocks can use")  # fmt: skip
        super().__init__(
            f"a {requested}-token prompt cannot be read in the {available / MIB:.0f} MiB left "
            f"on the device (reading it needs at least {needed / MIB:.0f} MiB){held}; the "
            f"largest prompt that fits now is {largest} tokens",
            f"raise memory_cap_mib (about {max(1, -(-(needed - available) // MIB))} MiB more "
            "reads it in small chunks), load the engine with a smaller max_context (its KV cache "
            "is allocated at load), or shorten the prompt"
            + (" (or add expandable_segments:True to PYTORCH_CUDA_ALLOC_CONF)" if holes else ""),
        )
        self.requested, self.largest = requested, largest
        self.available, self.needed, self.holes = available, needed, holes


@dataclass(frozen=True)
class PromptPlan:
    """How a prompt is read: `chunk` tokens per pass, at most `score_budget` attention score
    elements alive at once, `need_bytes` of temporaries at that chunk, out of
    `available_bytes` (None where nothing is measured: the CPU)."""

    chunk: int
    score_budget: int | None
    need_bytes: int
    available_bytes: int | None


def _reader_widths(cfg) -> tuple[int, int, int, int, int]:
    """Per-token widths the reader's tensors take, over the layers that compute their own KV:
    the hidden state, the per-layer inputs, q|k|v, the attention output, the MLP."""
    n = cfg.first_shared_layer
    hq = cfg.num_attention_heads
    qkv = max((hq + 2 * cfg.layer_kv_heads[i]) * cfg.layer_head_dims[i] for i in range(n))
    attn = max(hq * cfg.layer_head_dims[i] for i in range(n))
    f = max(cfg.mlp_width(i) for i in range(n))
    return cfg.hidden_size, cfg.num_hidden_layers * cfg.hidden_size_per_layer_input, qkv, attn, f


def reader_bytes_per_token(cfg, elem: int) -> int:
    """Bytes one chunk token holds at the reader's peak (engine.fast.prefill's stages): the
    hidden state and per-layer inputs kept through the chunk, plus the largest stage (the
    embedding's lookups, a layer's attention with its fp32 accumulator, or its MLP)."""
    h, lp, qkv, attn, f = _reader_widths(cfg)
    rope = 2 * sum({hd for hd in cfg.layer_head_dims})
    held = h + lp + rope
    stages = (
        2 * lp + h,  # embedding: the per-layer lookup and projection
        2 * h + 2 * qkv + attn * (2 + 4 // elem * 2),  # x, q|k|v, q/k/v, out, acc (fp32), result
        3 * h + 3 * f,  # x, gate|up, GELU product, down
    )
    return int((elem * (held + max(stages)) + 64) * PER_TOKEN_MARGIN)


def reader_widest_bytes_per_token(cfg, elem: int) -> int:
    """Bytes per chunk token of the reader's widest single tensor (the fused gate|up, the
    per-layer inputs, q|k|v, or the attention's fp32 accumulator): the largest block a chunk
    asks the allocator for, beside the dequantised matrix and the scores."""
    h, lp, qkv, attn, f = _reader_widths(cfg)
    return max(h, lp, 2 * f, qkv, attn * max(1, 4 // elem)) * elem


def hole_credit(holes: tuple[int, ...], matrix: int, piece: int, pieces: int) -> int:
    """Bytes of a plan that holes of fixed allocator segments can hold: the dequantised matrix
    in the smallest hole that fits it (the allocator's best fit, the rest of that hole staying
    free), then whole `piece`-sized blocks of the chunk's `pieces` bytes in what is left. The
    scores and the safety margin are counted fresh: a conservative model of the allocator,
    which serves a block from a free block at least its size and never joins two."""
    free = sorted(holes)
    credit = 0
    fit = next((h for h in free if h >= matrix), None) if matrix > 0 else None
    if fit is not None:
        free.remove(fit)
        free.append(fit - matrix)
        credit = matrix
    if piece > 0:
        credit += min(pieces, sum(h // piece * piece for h in free))
    return credit


def reader_fixed_bytes(model, weight_elem: int) -> int:
    """The largest matrix a chunk dequantises at once (the fused gate|up, or the per-layer
    projection) plus the safety margin."""
    cfg = model.cfg
    n, h = cfg.first_shared_layer, cfg.hidden_size
    rows = [2 * cfg.mlp_width(i) for i in range(n)]
    rows += [(cfg.num_attention_heads + 2 * cfg.layer_kv_heads[i]) * cfg.layer_head_dims[i]
             for i in range(n)]  # fmt: skip
    rows.append(cfg.num_hidden_layers * cfg.hidden_size_per_layer_input)
    return max(rows) * h * weight_elem + SAFETY_BYTES


def reader_peak_bytes(model, tokens: int, weight_elem: int) -> int:
    """What reading a pass of `tokens` prompt tokens holds at its peak: the largest dequantised
    matrix (`weight_elem` bytes an element) and the per-token temporaries in the model's dtype.
    The batching plan leaves it free beside the KV pool; captured prompt passes hold it."""
    act_elem = torch.empty((), dtype=model.dtype).element_size()
    return reader_fixed_bytes(model, weight_elem) + tokens * reader_bytes_per_token(
        model.cfg, act_elem
    )


def _expandable_segments() -> None:
    """Under a cap, let the allocator grow segments in place instead of carving fixed ones.

    Why: the cap counts what the allocator reserves, not what is allocated, and fixed
    segments leave holes that no large block fits: on the H200 at 3,732 MiB, a read failed
    asking for 44 MiB with 215 MiB reserved but unallocated (lab/journal.md). Set before the
    weights load, so they pack too. PYTORCH_CUDA_ALLOC_CONF, when set, is left as the user set
    it."""
    if allocator_configured():
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is not None:
        setter("expandable_segments:True")


def available_bytes(device: torch.device, cap_mib: int | None) -> int | None:
    """Bytes this process may still allocate on `device`: under the cap, the cap less what is
    allocated; uncapped, the driver's free memory plus what the allocator caches unused.
    None on the CPU (not measured)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cap_mib is not None:  # hand cached, wholly free segments back: the cap counts them
        torch.cuda.empty_cache()
    allocated = torch.cuda.memory_allocated(index)
    reserved = torch.cuda.memory_reserved(index)
    free, total = torch.cuda.mem_get_info(index)
    uncapped = free + reserved - allocated
    if cap_mib is None:
        return uncapped
    # what stays reserved but unallocated is holes in live segments: with expandable segments
    # count half of it; fixed segments cannot hand a hole to a larger block, so count none
    holes = (reserved - allocated) // 2 if segments_expand() else 0
    return min(uncapped, min(cap_mib * MIB, total) - reserved + holes)


def fixed_segment_holes(device: torch.device, cap_mib: int | None) -> tuple[int, ...]:
    """The free blocks inside the allocator's fixed segments of the default pool (a graph's
    private pool lends nothing), under a cap only: what `available_bytes` leaves out there, and
    what a plan may still place in them (`hole_credit`). Empty where segments expand, uncapped,
    or on the CPU. Read after `available_bytes` handed wholly free segments back."""
    if cap_mib is None or device.type != "cuda" or segments_expand():
        return ()
    index = device.index if device.index is not None else torch.cuda.current_device()
    sizes = []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") != index or seg.get("segment_type") != "large":
            continue
        if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
            continue
        sizes += [b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
    return tuple(sorted(sizes, reverse=True))


def segments_expand() -> bool:
    """Whether the CUDA allocator grows segments in place (expandable segments), as this process
    set it or the user's PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF did.

    Why: the prompt planner may count part of the reserved-but-unallocated memory as usable
    only when segments expand; fixed segments ran out of memory at 32k under the cap when it
    did (lab/journal.md v30)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    own = getter() if getter is not None else ""
    flat = f"{own},{allocator_settings_from_env()}".replace(" ", "").lower()
    return "expandable_segments:true" in flat


def plan_prompt(
    model,
    prompt_tokens: int,
    max_chunk: int,
    cap_mib: int | None = None,
    available: int | None = None,
    weight_elem: int | None = None,
    holes: tuple[int, ...] | None = None,
) -> PromptPlan:
    """The largest chunk (a power of two up to `max_chunk`, or the whole prompt body when
    shorter) whose temporaries fit in what is left, and the attention score budget for the rest.
    A chunk must leave room for slices of at least 512 keys over all its rows. Raises
    PromptMemoryError, before anything is read, when not even a MIN_CHUNK-token chunk fits.
    `available` defaults to the device's measurement (None on the CPU: the chunk asked for);
    `holes` to the free blocks of fixed segments under the cap, which hold what fits in them
    (`hole_credit`)."""
    if available is None:
        available = available_bytes(model.device, cap_mib)
        if holes is None:
            holes = fixed_segment_holes(model.device, cap_mib)
    holes = holes or ()
    body = max(0, prompt_tokens - 1)  # the last token goes through the decode step
    if available is None:  # the CPU: the chunk asked for, ops.SCORE_BUDGET's slices
        return PromptPlan(max(1, min(max_chunk, body or 1)), None, 0, None)
    cfg, elem = model.cfg, torch.empty((), dtype=model.dtype).element_size()
    per_token = reader_bytes_per_token(cfg, elem)
    fixed = reader_fixed_bytes(model, weight_elem or elem)
    widest = reader_widest_bytes_per_token(cfg, elem)
    hq = cfg.num_attention_heads

    def fits(c: int) -> PromptPlan | None:
        held = hole_credit(holes, fixed - SAFETY_BYTES, c * widest, c * per_token) if holes else 0
        rest = available + held - fixed - c * per_token
        budget = min(SCORE_BUDGET_MAX, rest // SCORE_BYTES)
        if budget < hq * c * min(512, body + 1):
            return None
        return PromptPlan(c, int(budget), fixed + c * per_token + budget * SCORE_BYTES, available)

    if body == 0:
        return PromptPlan(1, SCORE_BUDGET_MAX, 0, available)
    candidates = {1 << k for k in range(max(1, max_chunk).bit_length()) if 1 << k <= max_chunk}
    if body <= max_chunk:
        candidates = {c for c in candidates if c < body} | {body}
    for c in sorted(candidates, reverse=True):
        if c < min(MIN_CHUNK, body):
            break
        plan = fits(c)
        if plan is not None:
            return plan
    smaller = [c for c in range(1, min(MIN_CHUNK, body)) if fits(c) is not None]
    largest = 1 + (max(smaller) if smaller else 0)
    needed = fixed + MIN_CHUNK * per_token + hq * MIN_CHUNK * 512 * SCORE_BYTES
    raise PromptMemoryError(prompt_tokens, largest, max(0, available), needed, holes)


PLAN_REFRESH_S = 1.0  # how long one measurement of the memory left serves new requests' plans
UNBOUNDED_BYTES = 1 << 62  # memory that bounds no plan


class PromptPlanner:
    """Each new request's prompt plan (`plan_prompt`) from a measurement of the memory left
    that is at most PLAN_REFRESH_S old, measured afresh whenever that plan is not the roomy
    one (the whole chunk and the full score budget).

    Why: a measurement reads the allocator's counters (torch builds its whole statistics
    dictionary for each), asks the driver for its free memory, and under a cap first hands the
    allocator's free segments back (a cudaFree waits for the device, and the next prompt pass
    allocates them again). Once per request that sat on the stepping thread, where a late
    millisecond idles the decode stream (lab/journal.md v28 times each call). An old
    measurement only ever settles a roomy plan, which a fresh one on a roomy device gives too;
    any plan that reads in a smaller chunk, trims the score budget or refuses rests on a fresh
    measurement, as before."""

    def __init__(
        self,
        model,
        cap_mib: int | None,
        measure: Callable[[torch.device, int | None], int | None] = available_bytes,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = PLAN_REFRESH_S,
        holes: Callable[[torch.device, int | None], tuple[int, ...]] = fixed_segment_holes,
    ) -> None:
        self.model, self.cap_mib = model, cap_mib
        self._measure, self._clock, self.refresh_s = measure, clock, refresh_s
        self._holes_of, self._holes = holes, ()
        self._seen: int | None = None
        self._seen_at = 0.0
        self.measurements = 0  # how often the driver was asked (a test reads it)

    def plan(self, prompt_tokens: int, max_chunk: int) -> PromptPlan:
        if self._seen is not None and self._clock() - self._seen_at <= self.refresh_s:
            try:
                plan = plan_prompt(self.model, prompt_tokens, max_chunk, self.cap_mib,
                                   available=self._seen, holes=self._holes)  # fmt: skip
            except PromptMemoryError:
                plan = None
            if plan is not None and _roomy(plan, self.model, prompt_tokens, max_chunk):
                return plan
        available = self._measure(self.model.device, self.cap_mib)
        self.measurements += 1
        if available is None:  # the CPU: nothing measured, the chunk asked for
            return plan_prompt(self.model, prompt_tokens, max_chunk, self.cap_mib)
        self._holes = self._holes_of(self.model.device, self.cap_mib)
        self._seen, self._seen_at = available, self._clock()
        return plan_prompt(self.model, prompt_tokens, max_chunk, self.cap_mib,
                           available=available, holes=self._holes)  # fmt: skip


def _roomy(plan: PromptPlan, model, prompt_tokens: int, max_chunk: int) -> bool:
    """Whether memory bounded nothing in `plan`: its chunk and score budget are those
    `plan_prompt` picks where memory is no limit."""
    free = plan_prompt(model, prompt_tokens, max_chunk, available=UNBOUNDED_BYTES)
    return (plan.chunk, plan.score_budget) == (free.chunk, free.score_budget)
