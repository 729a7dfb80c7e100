"""Does a persistent kernel with grid-wide barriers beat one launch per product at one row?

    python3 -m bench.engine.persistent_probe --preset e2b --out $OUT/persistent.json

The one-row decode step is a chain of some 360 dependent kernels (bench/NOTES.md, v22-v24): each
int4 product costs a launch, a ramp and its dependent loads and reductions whatever its bytes, and
per-kernel tuning has stopped paying. The way out the NOTES name since v7 is fewer, longer
kernels: one persistent kernel whose programs stay resident and meet at a grid-wide barrier
where a kernel boundary was. Before building the decode step that way, this probe measures the
mechanism alone, on the products of every E2B layer in order (q|k|v, o, gate|up, down, the
per-layer gate and projection: the step's 210 layer products and their bytes), each product's
output the next one's input:

* ``product``: the engine's own GEMV (`w4_gemv`, tuned tiles), one launch per product, PDL, one
  CUDA graph: what the decode step does today;
* ``launch``: this probe's tile code, one launch per product, PDL, one CUDA graph;
* ``persistent``: the same tile code in ONE launch of as many programs as fit on the card at
  once, a barrier (an atomic count, then a spin) between products;
* ``persistent_l2``: that, and each program pulls its share of the next product's weights into
  L2 (`prefetch.global.L2`) before it waits at the barrier;
* ``layered``: per layer, q|k|v as one launch and the five products after it as one persistent
  launch (PDL between them): the design that leaves the attention's kernels where they are and
  makes the block after them one kernel.

``launch`` against ``persistent`` is the barrier against the boundary with the same arithmetic;
``product`` against ``launch`` is what the engine's tuned tiles are worth. The tokens of the
chain are checked too: ``persistent`` must equal ``launch`` bit for bit (same tiles, same
order), and both must agree with a float32 reference.

A spin that outlives ``SPIN_LIMIT`` polls gives up and sets a flag, so a grid that could not be
co-resident reports an error instead of hanging the device. What it measured: bench/NOTES.md v26.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launches, run_kernel
from engine.kernels.pdl import wait_inputs
from engine.kernels.w4gemv_kernel import asm_on, h2_on, tile_step, ws_loads

# polls of one barrier before it gives up (milliseconds; a real wait is microseconds)
SPIN_LIMIT = tl.constexpr(1 << 16)
FIELDS = tl.constexpr(6)  # per product in the table: x, w, s, y addresses, N, K


@dataclass(frozen=True)
class Product:
    """One int4 product of the chain: y[N] = dequant(W[N, K]) @ x[K]."""

    name: str
    n: int
    k: int


def layer_products(preset: str) -> list[Product]:
    """Every layer's products of a checkpoint preset, in the decode step's order and shapes."""
    from engine.checkpoint_maker import PRESETS

    p = PRESETS[preset]
    hidden, layers = p["hidden_size"], p["num_hidden_layers"]
    shared_from = layers - p.get("num_kv_shared_layers", 0)
    kinds = p.get("layer_types") or ["sliding_attention"] * layers
    out: list[Product] = []
    for i in range(layers):
        full = kinds[i] == "full_attention"
        hd = p["global_head_dim"] if full else p["head_dim"]
        q = p["num_attention_heads"] * hd
        kv = 0 if i >= shared_from else 2 * p["num_key_value_heads"] * hd
        inter = p["intermediate_size"] * (2 if i >= shared_from else 1)  # E2B's wide layers
        ple = p["hidden_size_per_layer_input"]
        out += [Product(f"{i}.qkv", q + kv, hidden), Product(f"{i}.o", hidden, q),
                Product(f"{i}.gate_up", 2 * inter, hidden), Product(f"{i}.down", hidden, inter),
                Product(f"{i}.ple_gate", ple, hidden), Product(f"{i}.ple_proj", hidden, ple)]  # fmt: skip
    return out


@triton.jit
def x8_l2(x_ptr, rk, kw0, KW, EVEN_K: tl.constexpr):
    """One K step's activations as 8 vectors (nibble j of every word), fp32. `.cg` reads L2:
    L1 is not coherent, and the persistent programs rewrite these buffers between products.
    Past the row's end (not EVEN_K) the address is clamped; the weights there are masked to 0."""
    if EVEN_K:  # noqa: SIM108 - a constexpr branch
        off = (kw0 + rk) * 8
    else:
        off = tl.where((kw0 + rk) < KW, kw0 + rk, 0) * 8
    x0 = tl.load(x_ptr + off + 0, cache_modifier=".cg").to(tl.float32)
    x1 = tl.load(x_ptr + off + 1, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(x_ptr + off + 2, cache_modifier=".cg").to(tl.float32)
    x3 = tl.load(x_ptr + off + 3, cache_modifier=".cg").to(tl.float32)
    x4 = tl.load(x_ptr + off + 4, cache_modifier=".cg").to(tl.float32)
    x5 = tl.load(x_ptr + off + 5, cache_modifier=".cg").to(tl.float32)
    x6 = tl.load(x_ptr + off + 6, cache_modifier=".cg").to(tl.float32)
    x7 = tl.load(x_ptr + off + 7, cache_modifier=".cg").to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def wait_chunk(count_ptr, kn, N_PREV, err_ptr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Before the K step at word kn (the dataflow probe): its BLOCK_KW * 8 activations, chunk
    kn / BLOCK_KW of the producer's N_PREV outputs, are stored, i.e. that chunk's count has
    reached its tiles (acquire: their stores are visible after it)."""
    CHUNK: tl.constexpr = BLOCK_KW * 8
    c = kn // BLOCK_KW
    expected = tl.cdiv(tl.minimum(N_PREV - c * CHUNK, CHUNK), BLOCK_N)
    seen = tl.atomic_add(count_ptr + c, 0, sem="acquire", scope="gpu")
    polls = tl.full([], 0, tl.int32)
    while (seen < expected) & (polls < SPIN_LIMIT):
        seen = tl.atomic_add(count_ptr + c, 0, sem="acquire", scope="gpu")
        polls += 1
    if seen < expected:  # not co-resident, or a bug: report instead of hanging
        tl.atomic_max(err_ptr, 1)
    tl.debug_barrier()  # every thread reads the activations after the wait


@triton.jit
def tile(x_ptr, w_ptr, s_ptr, y_ptr, N, K, t, count_ptr, N_PREV, WAIT, err_ptr,
         BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr, H2: tl.constexpr,
         USE_ASM: tl.constexpr, FLOW: tl.constexpr):  # fmt: skip
    """Rows [t * BLOCK_N, +BLOCK_N) of one product, K walked one step ahead (the engine's PIPE).
    EVEN_K: BLOCK_KW divides K / 8 for every product, so no K masks. FLOW (the dataflow probe):
    where WAIT, each K step's activations are read after `wait_chunk`."""
    # the Chain's K are multiples of 32, so every row of words starts on 16 bytes; a pointer
    # read from the table carries no alignment, so say it, or Triton loads one word at a time
    KW = tl.multiple_of(K // 8, 4)
    rk = tl.arange(0, BLOCK_KW)
    rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rows = tl.where(n_mask, rn, 0).to(tl.int64)
    w_ptrs = tl.multiple_of(w_ptr + rows[:, None] * KW + rk[None, :], [16, 16])
    s_ptrs = s_ptr + rows[:, None] * (K // 32) + rk[None, :] // 4
    w, s = ws_loads(w_ptrs, s_ptrs, rk, 0, KW, EVEN_K)  # weights first: they wait for nothing
    if FLOW:  # noqa: SIM102 - a constexpr test beside a tensor one
        if WAIT:
            wait_chunk(count_ptr, 0, N_PREV, err_ptr, BLOCK_N, BLOCK_KW)
    x0, x1, x2, x3, x4, x5, x6, x7 = x8_l2(x_ptr, rk, 0, KW, EVEN_K)
    acc = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    for kn in range(BLOCK_KW, KW, BLOCK_KW):
        nw, ns = ws_loads(w_ptrs, s_ptrs, rk, kn, KW, EVEN_K)
        if FLOW:  # noqa: SIM102 - a constexpr test beside a tensor one
            if WAIT:
                wait_chunk(count_ptr, kn, N_PREV, err_ptr, BLOCK_N, BLOCK_KW)
        n0, n1, n2, n3, n4, n5, n6, n7 = x8_l2(x_ptr, rk, kn, KW, EVEN_K)
        acc = tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)
        w, s, x0, x1, x2, x3, x4, x5, x6, x7 = nw, ns, n0, n1, n2, n3, n4, n5, n6, n7
    acc = tile_step(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, H2, USE_ASM)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _prefetch_rows(w_ptr, N, K, t, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for the packed words of rows [t * BLOCK_N, +BLOCK_N): one request per 128 bytes
    (a row's K / 8 words are K * 4 bytes / 128 lines; LINES a power of two at least that)."""
    rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_bytes = K // 2
    j = tl.arange(0, LINES)
    ok = (rn[:, None] < N) & (j[None, :] * 128 < row_bytes)
    off = tl.where(ok, rn[:, None].to(tl.int64) * row_bytes + j[None, :] * 128, 0)
    ptrs = w_ptr.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _launch_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr,
                   BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr, H2: tl.constexpr,
                   USE_ASM: tl.constexpr,
                   PDL: tl.constexpr = False):  # fmt: skip
    """One product, one tile per program (``launch``)."""
    wait_inputs(PDL)
    tile(x_ptr, w_ptr, s_ptr, y_ptr, N, K, tl.program_id(0), y_ptr, 0, False, y_ptr, BLOCK_N,
         BLOCK_KW, EVEN_K, H2, USE_ASM, False)  # fmt: skip


@triton.jit
def _grid_barrier(bar_ptr, err_ptr, target):
    """Every program has arrived `target` counts in total: the writes before are visible after."""
    tl.debug_barrier()  # every thread of this program has issued its stores
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    polls = tl.full([], 0, tl.int32)
    while (seen < target) & (polls < SPIN_LIMIT):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if seen < target:  # not co-resident, or a bug: report instead of hanging
        tl.atomic_max(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def table_row(table_ptr, p):
    """Product p's operands from the table: x, w, s, y pointers, N and K."""
    row = table_ptr + p * FIELDS
    x_ptr = tl.load(row + 0).to(tl.pointer_type(tl.bfloat16))
    w_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int32))
    s_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    y_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
    return x_ptr, w_ptr, s_ptr, y_ptr, tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32)


@triton.jit
def _persistent_kernel(table_ptr, n_products, bar_ptr, err_ptr, BLOCK_N: tl.constexpr,
                       BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr, H2: tl.constexpr,
                   USE_ASM: tl.constexpr,
                       PREFETCH: tl.constexpr, LINES: tl.constexpr,
                       PDL: tl.constexpr = False):  # fmt: skip
    """Every product of the table in turn; each program takes tiles pid, pid + grid, ..."""
    wait_inputs(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for p in range(n_products):
        x_ptr, w_ptr, s_ptr, y_ptr, n, k = table_row(table_ptr, p)
        for t in range(pid, tl.cdiv(n, BLOCK_N), nprog):
            tile(x_ptr, w_ptr, s_ptr, y_ptr, n, k, t, y_ptr, 0, False, bar_ptr, BLOCK_N,
                 BLOCK_KW, EVEN_K, H2, USE_ASM, False)  # fmt: skip
        if PREFETCH:  # noqa: SIM102 - a constexpr test beside a tensor one
            if p + 1 < n_products:
                nxt = table_ptr + (p + 1) * FIELDS
                nw_ptr = tl.load(nxt + 1).to(tl.pointer_type(tl.int32))
                nn = tl.load(nxt + 4).to(tl.int32)
                nk = tl.load(nxt + 5).to(tl.int32)
                for t in range(pid, tl.cdiv(nn, BLOCK_N), nprog):
                    _prefetch_rows(nw_ptr, nn, nk, t, BLOCK_N, LINES)
        _grid_barrier(bar_ptr, err_ptr, (p + 1) * nprog)


class Chain:
    """The products' random packed weights, the activation buffers and the launches of each
    variant. Buffer i holds product i's output; product i reads buffer i - 1 (the first one
    reads `x0`), its first K values."""

    def __init__(self, products: list[Product], device: torch.device, seed: int = 0,
                 block_n: int = 16, num_warps: int = 4, block_kw: int | None = None):  # fmt: skip
        self.products, self.device = products, device
        if any(p.k % 32 for p in products):
            raise ValueError("every product's K must be a multiple of 32 (one scale group)")
        self.set_tiles(block_n, block_kw, num_warps)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.weights: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in products:  # codes uniform in 0..15 (variance 21.5 about 8): |y| stays ~ |x|
            packed = torch.randint(-(2**31), 2**31, (p.n, p.k // 8), generator=gen,
                                   dtype=torch.int64, device=device).to(torch.int32)  # fmt: skip
            # a random sign per group: the codes' mean (-0.5) would otherwise grow the chain's
            # common direction ~4x per product, to inf within a few layers
            sign = torch.randint(0, 2, (p.n, p.k // 32), generator=gen, device=device) * 2 - 1
            scale = sign * (torch.rand(p.n, p.k // 32, generator=gen, device=device) + 0.5)
            scale = scale / (21.5 * 1.0833 * p.k) ** 0.5  # E[(u + 0.5)^2] = 1.0833
            self.weights.append((packed, scale.to(torch.bfloat16)))
        self.x0 = torch.randn(products[0].k, generator=gen, device=device).to(torch.bfloat16)
        self.outs = [torch.zeros(p.n, dtype=torch.bfloat16, device=device) for p in products]
        for prev, p in zip(products, products[1:], strict=False):
            if p.k > prev.n:
                raise ValueError(f"{p.name} reads K={p.k} from {prev.name}'s {prev.n} outputs")
        self.table = torch.tensor(
            [[self.input_of(i).data_ptr(), w.data_ptr(), s.data_ptr(), self.outs[i].data_ptr(), p.n, p.k]
             for i, (p, (w, s)) in enumerate(zip(products, self.weights, strict=True))],
            dtype=torch.int64, device=device)  # fmt: skip
        self.bar = torch.zeros(max(1, len(products)), dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def set_tiles(self, block_n: int, block_kw: int | None, num_warps: int) -> None:
        """Rows, K words (default: the widest step up to 32 words that divides every product's
        K / 8) and warps of a program."""
        self.block_n, self.num_warps = block_n, num_warps
        self.block_kw = block_kw or min(32, *(p.k // 8 & -(p.k // 8) for p in self.products))
        self.even_k = all(p.k // 8 % self.block_kw == 0 for p in self.products)

    def input_of(self, i: int) -> torch.Tensor:
        return self.x0 if i == 0 else self.outs[i - 1]

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * 4 + s.numel() * 2 for w, s in self.weights)

    def _flags(self) -> dict[str, Any]:
        return {"H2": h2_on(torch.bfloat16, self.device), "USE_ASM": asm_on(self.device),
                "EVEN_K": self.even_k}  # fmt: skip

    def run_launch(self) -> None:
        for i, (p, (w, s)) in enumerate(zip(self.products, self.weights, strict=True)):
            run_kernel(_launch_kernel, (triton.cdiv(p.n, self.block_n),), self.input_of(i)[: p.k],
                       w, s, self.outs[i], p.n, p.k, BLOCK_N=self.block_n,
                       BLOCK_KW=self.block_kw, num_warps=self.num_warps, **self._flags())  # fmt: skip

    def run_product(self) -> None:
        from engine.kernels.w4gemv import w4_gemv

        for i, (p, (w, s)) in enumerate(zip(self.products, self.weights, strict=True)):
            w4_gemv(self.input_of(i)[: p.k], w, s, out=self.outs[i])

    def run_persistent(self, programs: int, prefetch: bool = False) -> None:
        self.bar.zero_()
        self._persistent(programs, 0, len(self.products), prefetch)

    def _persistent(self, programs: int, first: int, count: int, prefetch: bool) -> None:
        """Products [first, first + count) in one launch, on barrier counter `first`."""
        lines = triton.next_power_of_2(max(p.k // 2 // 128 for p in self.products) or 1)
        run_kernel(_persistent_kernel, (programs,), self.table[first:], count,
                   self.bar[first:], self.err, BLOCK_N=self.block_n, BLOCK_KW=self.block_kw,
                   PREFETCH=prefetch, LINES=lines, num_warps=self.num_warps, **self._flags())  # fmt: skip

    def run_layered(self, programs: int, per_layer: int = 6) -> None:
        """Each layer's first product as one launch, the rest as one persistent launch."""
        self.bar.zero_()
        for first in range(0, len(self.products), per_layer):
            p = self.products[first]
            w, s = self.weights[first]
            run_kernel(_launch_kernel, (triton.cdiv(p.n, self.block_n),),
                       self.input_of(first)[: p.k], w, s, self.outs[first], p.n, p.k,
                       BLOCK_N=self.block_n, BLOCK_KW=self.block_kw, num_warps=self.num_warps,
                       **self._flags())  # fmt: skip
            self._persistent(programs, first + 1, per_layer - 1, False)

    def reference(self) -> torch.Tensor:
        """The chain in float32 from the dequantised weights (the rounding of each output to
        bf16 as the kernels round it)."""
        from engine.kernels.w4gemv import dequantize_reference

        x = self.x0.float()
        for p, (w, s) in zip(self.products, self.weights, strict=True):
            x = (dequantize_reference(w, s) @ x[: p.k].float()).to(torch.bfloat16).float()
        return x


def resident_programs(chain: Chain, per_sm: int) -> int:
    """per_sm programs on every SM (whether they fit at once the first run's barriers say)."""
    return torch.cuda.get_device_properties(chain.device).multi_processor_count * per_sm


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time_us(graph: torch.cuda.CUDAGraph, reps: int = 50, rounds: int = 7) -> float:
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def record_variant(chain: Chain, ref: torch.Tensor, finals: dict[str, torch.Tensor],
                   into: dict[str, Any], name: str, fn) -> None:  # fmt: skip
    """Time variant `fn` (one CUDA graph) into `into[name]`, with its error against the float32
    chain and, past ``launch``, whether it equals ``launch``'s output bit for bit; or the
    error where a wait timed out (its programs were not all resident at once)."""
    chain.outs[-1].zero_()
    chain.err.zero_()
    fn()  # compile, and find out whether the programs were resident at once
    torch.cuda.synchronize()
    if chain.err.item():
        into[name] = {"error": "a wait timed out: the programs were not all resident at once "
                               "(too many per SM)"}  # fmt: skip
        print(name, into[name], flush=True)
        return
    graph = graph_of(fn)
    graph.replay()
    torch.cuda.synchronize()
    final = chain.outs[-1].float().clone()
    finals[name] = final
    us = graph_time_us(graph)
    rel = ((final - ref).norm() / ref.norm()).item()
    into[name] = {"us": round(us, 1), "us_per_product": round(us / len(chain.products), 2),
                  "gb_per_s": round(chain.weight_bytes / us / 1e3, 1),
                  "rel_err_vs_fp32": round(rel, 5)}  # fmt: skip
    if name != "product" and "launch" in finals:
        into[name]["equal_to_launch"] = bool(torch.equal(final, finals["launch"]))
    print(name, into[name], flush=True)


def chain_result(chain: Chain, ref: torch.Tensor, preset: str) -> dict[str, Any]:
    """A probe's result head, with the engine's own GEMV chain (`product`: one launch per
    product, PDL, today's step) timed into its variants: what every variant must beat."""
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(chain.device), "preset": preset,
                           "products": len(chain.products), "weight_mb": chain.weight_bytes / 1e6,
                           "variants": {}, "tiles": {}}  # fmt: skip
    with pdl_launches():
        record_variant(chain, ref, {}, out["variants"], "product", chain.run_product)
    return out


def each_tiling(chain: Chain, tiles: list[tuple[int, int, int]],
                out: dict[str, Any]) -> Iterator[dict[str, Any]]:  # fmt: skip
    """Each tiling (rows x K words x warps per program) set on the chain in turn: yields the
    dict its variants are recorded into, out["tiles"][label]."""
    for block_n, block_kw, warps in tiles:
        chain.set_tiles(block_n, block_kw, warps)
        label = f"{block_n}x{block_kw}x{warps}"
        print("tiles", label, "even K" if chain.even_k else "masked K", flush=True)
        out["tiles"][label] = {}
        yield out["tiles"][label]


def measure(preset: str, per_sm: list[int], tiles: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Every variant's time for the whole chain under each tiling (rows x K words x warps per
    program), and their outputs against each other."""
    chain = Chain(layer_products(preset), torch.device("cuda"))
    ref = chain.reference()
    out = chain_result(chain, ref, preset)
    for into in each_tiling(chain, tiles, out):
        finals: dict[str, torch.Tensor] = {}

        def record(name: str, fn, into=into, finals=finals) -> None:
            record_variant(chain, ref, finals, into, name, fn)

        with pdl_launches():
            record("launch", chain.run_launch)
        for n in per_sm:
            programs = resident_programs(chain, n)
            for prefetch in (False, True):
                name = f"persistent_{n}x" + ("_l2" if prefetch else "")
                record(name, lambda p=programs, f=prefetch: chain.run_persistent(p, f))
            with pdl_launches():
                record(f"layered_{n}x", lambda p=programs: chain.run_layered(p))
    return out


def probe_main(argv: list[str] | None, doc: str, measure_fn, per_sm: str, tiles: str) -> int:
    """The probes' command line: --preset, --per-sm, --tiles, --out; the JSON written
    atomically."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--preset", default="e2b")
    ap.add_argument("--per-sm", default=per_sm, help="programs per SM of the resident kernels")
    ap.add_argument("--tiles", default=tiles,
                    help="tilings to try: rows x K words x warps per program")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{ap.prog}: needs a CUDA GPU (the CPU interpreter runs the tests only)",
              file=sys.stderr)  # fmt: skip
        return 2
    per_sm_list = [int(v) for v in args.per_sm.split(",")]
    tile_list = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    result = measure_fn(args.preset, per_sm_list, tile_list)
    from tools.fileio import write_atomic

    write_atomic(args.out, json.dumps(result, indent=2) + "\n")
    return 0


def resident_for_tests(device: torch.device) -> int:
    """Programs of a resident kernel in the tests: one on the CPU interpreter (it runs programs
    one after another, so a wait across several would wait for one not yet started), two per
    SM on a GPU."""
    if device.type == "cpu":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, measure, "1,2,4", "16x32x4,4x128x4,2x256x4,4x256x8")


if __name__ == "__main__":
    raise SystemExit(main())
