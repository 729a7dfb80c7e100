"""Do finer dependencies beat a grid barrier at one row? The persistent probe's chain with a count
per chunk of activations instead of a barrier per product.

    python3 -m bench.engine.dataflow_probe --preset e2b --out $OUT/dataflow.json

bench/engine/persistent_probe.py measured a persistent kernel with a grid-wide barrier between
E2B's 210 layer products: 8% slower than one launch per product with the same tile code
(bench/NOTES.md v26). A barrier makes every program wait for the last tile of the product before;
a consumer tile needs only the inputs it is about to read. Here each program, still resident
and still walking the products in order, counts each tile it has stored into its chunk of
outputs (the activations one K step of the next product reads), and a tile of the next product
waits, before each K step, only for that step's chunk to be complete (HazyResearch's megakernel
schedules by such counters). Its first K
steps then overlap the previous product's last tiles, and no program waits for a tile it does
not read.

Variants (one CUDA graph each): ``product`` (the engine's GEMV, one launch per product, PDL:
today's step), then with the probe's own tile code ``launch`` (one launch per product, PDL),
``persistent_Nx`` (the barrier, for the same run's comparison) and ``dataflow_Nx`` (the
counts), N programs per SM. Every variant's output must equal ``launch``'s bit for bit. A wait
that outlives SPIN_LIMIT polls raises the error flag instead of hanging (programs not all
resident). What it measured: bench/NOTES.md.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from bench.engine.persistent_probe import (
    FIELDS,
    Chain,
    chain_result,
    each_tiling,
    layer_products,
    probe_main,
    record_variant,
    resident_programs,
    table_row,
    tile,
)
from engine.kernels.launch import pdl_launches, run_kernel
from engine.kernels.pdl import wait_inputs


@triton.jit
def _dataflow_kernel(table_ptr, base_ptr, counts_ptr, n_products, err_ptr,
                     BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr,
                     H2: tl.constexpr, USE_ASM: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
    """Every product in turn, tiles pid, pid + grid, ...; a stored tile adds one (release) to
    the count of its chunk of BLOCK_KW * 8 outputs, counts_ptr[base[p] + chunk]."""
    wait_inputs(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    CHUNK: tl.constexpr = BLOCK_KW * 8
    for p in range(n_products):
        x_ptr, w_ptr, s_ptr, y_ptr, n, k = table_row(table_ptr, p)
        before = tl.maximum(p - 1, 0)
        n_prev = tl.load(table_ptr + before * FIELDS + 4).to(tl.int32)
        mine = counts_ptr + tl.load(base_ptr + p)
        theirs = counts_ptr + tl.load(base_ptr + before)
        for t in range(pid, tl.cdiv(n, BLOCK_N), nprog):
            tile(x_ptr, w_ptr, s_ptr, y_ptr, n, k, t, theirs, n_prev, p > 0, err_ptr, BLOCK_N,
                 BLOCK_KW, EVEN_K, H2, USE_ASM, True)  # fmt: skip
            tl.debug_barrier()  # every thread of this program has issued its stores
            tl.atomic_add(mine + (t * BLOCK_N) // CHUNK, 1, sem="release", scope="gpu")


class FlowChain(Chain):
    """The persistent probe's chain with a count per chunk of every product's outputs (a chunk:
    the BLOCK_KW * 8 activations one K step of the next product reads)."""

    def set_tiles(self, block_n: int, block_kw: int | None, num_warps: int) -> None:
        super().set_tiles(block_n, block_kw, num_warps)
        chunk = self.block_kw * 8
        if chunk % block_n:
            raise ValueError(f"a tile of {block_n} rows must lie inside one {chunk}-value chunk")
        chunks = [triton.cdiv(p.n, chunk) for p in self.products]
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        self.count_base = torch.tensor(starts, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(sum(chunks), dtype=torch.int32, device=self.device)

    def run_dataflow(self, programs: int) -> None:
        self.counts.zero_()
        run_kernel(_dataflow_kernel, (programs,), self.table, self.count_base, self.counts,
                   len(self.products), self.err, BLOCK_N=self.block_n, BLOCK_KW=self.block_kw,
                   num_warps=self.num_warps, **self._flags())  # fmt: skip


def measure(preset: str, per_sm: list[int], tiles: list[tuple[int, int, int]]) -> dict[str, Any]:
    """launch, persistent and dataflow for the whole chain under each tiling."""
    chain = FlowChain(layer_products(preset), torch.device("cuda"))
    ref = chain.reference()
    out = chain_result(chain, ref, preset)
    for into in each_tiling(chain, tiles, out):
        finals: dict[str, torch.Tensor] = {}
        with pdl_launches():
            record_variant(chain, ref, finals, into, "launch", chain.run_launch)
        for n in per_sm:
            programs = resident_programs(chain, n)
            record_variant(chain, ref, finals, into, f"persistent_{n}x",
                           lambda p=programs: chain.run_persistent(p))  # fmt: skip
            record_variant(chain, ref, finals, into, f"dataflow_{n}x",
                           lambda p=programs: chain.run_dataflow(p))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, measure, "2,4", "4x128x4,16x32x4")


if __name__ == "__main__":
    raise SystemExit(main())
