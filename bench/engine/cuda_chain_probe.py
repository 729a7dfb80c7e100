"""What does CUDA itself change on the one-row chain? The persistent probe's 210 E2B layer products
with a hand-written CUDA GEMV, beside the engine's Triton GEMV, and the floor of a PDL boundary.

    python3 -m bench.engine.cuda_chain_probe --preset e2b --out $OUT/cuda_chain.json

bench/NOTES.md (v26-v29) ends every route to the one-row goal at "a hand-scheduled CUDA
megakernel". Before writing one, this measures on the same chain, one CUDA graph per variant,
every launch with programmatic dependent launch (PDL):

* ``product``: the engine's Triton GEMV (`w4_gemv`, tuned tiles): today's step's products;
* ``cuda_gemv``: the engine's CUDA GEMV (engine/kernels/w4gemv_cuda.py, GPURIG_CUDA_GEMV=1),
  built by NVRTC per K with its tiles chosen per shape here (threads across K, rows per thread), every weight of a thread requested
  before it waits for the product before;
* ``null_links``: 210 kernels that only wait and release, with the GEMV's grids: what a
  boundary costs when the kernel does nothing;
* ``copy_links``: 210 kernels, each adding 1 to the vector the one before wrote (1,536 values):
  a boundary plus one dependent round trip through L2;
* ``bulk32`` and ``bulk_flow`` (sm_90): the engine's GEMV with a bulk-copy tiling, one launch per
  product, against the whole chain in one persistent launch whose blocks stream their next
  tiles' weights into a ring of shared-memory stages by bulk copy while they wait on the
  product before (the megakernel's mechanism on a tile as fast as the engine's); the two agree
  bit for bit;
* ``launch``: a generic tile (K known at run time, 8 rows a block), one launch per product,
  PDL; and ``flow_Nx``: the same tiles in ONE persistent launch of N blocks per SM, each
  tile requesting its weights and then waiting on a count of the product before's finished
  tiles (no grid barrier: a block with no tile in a product goes on to the next). The two
  agree bit for bit; flow against launch is the megakernel's mechanism against the boundary,
  with the weight stream running ahead of every wait.

If ``cuda_gemv`` is far below ``product``, Triton's kernel has fixed cost a CUDA kernel avoids,
and porting the step's kernels pays before any megakernel; if the links' floor is most of
``product``'s time per product, only fewer boundaries (the megakernel) can. Each shape's CUDA
output is compared with the float32 product first (`cuda_shape_errors`), and each chain's final
output with the float32 chain. What it measured: bench/NOTES.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.engine.persistent_probe import (
    Chain,
    chain_result,
    graph_of,
    graph_time_us,
    layer_products,
    record_variant,
)
from engine.kernels import w4gemv_cuda
from engine.kernels.cuda_build import CudaKernel, arch_of, compile_cubin
from engine.kernels.launch import pdl_launches
from engine.kernels.w4gemv_cuda import Tiling, bulk_tilings, candidate_tilings

SOURCE = Path(__file__).with_name("cuda_chain.cu")
WARPS = 4


class CudaGemv:
    """The engine's CUDA GEMV (engine/kernels/w4gemv_cuda.py, plain variant) at a given tiling:
    the probe times exactly what GPURIG_CUDA_GEMV=1 runs."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.arch = device, arch_of(device)
        self.source = SOURCE.read_text(encoding="utf-8")  # the links and the generic tile

    def __call__(self, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor,
                 t: Tiling) -> None:  # fmt: skip
        with pdl_launches():  # as in the step's graph
            w4gemv_cuda.launch(x, w, s, y, t)


def gemv_chain(chain: Chain, pick, pdl: bool = True):
    """The chain through the engine's CUDA GEMV, the tiling of each product `pick(product)`,
    PDL as in the step's graph (or not): a function to capture."""

    def run() -> None:
        with pdl_launches(pdl):
            for i, (p, (w, s)) in enumerate(zip(chain.products, chain.weights, strict=True)):
                w4gemv_cuda.launch(chain.input_of(i)[: p.k], w, s, chain.outs[i], pick(p))

    return run


def check_shapes(gemv: CudaGemv, chain: Chain, choice: dict[tuple[int, int], Tiling]
                 ) -> dict[str, float]:  # fmt: skip
    """Each shape's CUDA output against the float32 product of its dequantised weights: the
    largest error relative to the output's largest magnitude."""
    from engine.kernels.w4gemv import dequantize_reference

    errors: dict[str, float] = {}
    seen: set[tuple[int, int]] = set()
    gen = torch.Generator(device=chain.device).manual_seed(1)
    for p, (w, s) in zip(chain.products, chain.weights, strict=True):
        if (p.n, p.k) in seen:
            continue
        seen.add((p.n, p.k))
        x = torch.randn(p.k, generator=gen, device=chain.device).to(torch.bfloat16)
        y = torch.empty(p.n, dtype=torch.bfloat16, device=chain.device)
        gemv(x, w, s, y, choice[(p.n, p.k)])
        ref = dequantize_reference(w, s) @ x.float()
        errors[f"{p.n}x{p.k}"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    return errors


def tune(gemv: CudaGemv, chain: Chain, launches: int = 20) -> dict[str, Any]:
    """Per shape, the tiling whose graph of `launches` back-to-back launches is fastest, and the
    engine's Triton GEMV timed the same way beside it (`triton_us`): the per-product cost of
    each kernel in a chain of its own, its weights hot in L2 after the first launch."""
    from engine.kernels.launch import pdl_launches
    from engine.kernels.w4gemv import w4_gemv

    choice: dict[tuple[int, int], Tiling] = {}
    every: dict[tuple[int, int], dict[Tiling, float]] = {}
    table: dict[str, Any] = {}
    for p, (w, s) in zip(chain.products, chain.weights, strict=True):
        if (p.n, p.k) in choice:
            continue
        x = torch.randn(p.k, device=chain.device).to(torch.bfloat16)
        y = torch.empty(p.n, dtype=torch.bfloat16, device=chain.device)
        times = {}
        tilings = candidate_tilings(p.n, p.k)  # the engine's (row through L1), and staged
        if p.k <= w4gemv_cuda.MAX_STAGED_K:
            tilings += [replace(t, xs=1) for t in tilings]
        if torch.cuda.get_device_capability(chain.device)[0] >= 9:
            tilings += bulk_tilings(p.n, p.k)
        for t in tilings:  # the builds at once, then the timings
            w4gemv_cuda.build_ahead(chain.device, p.k, t, 0, None)
        for t in tilings:

            def run(t=t, w=w, s=s, x=x, y=y) -> None:
                for _ in range(launches):
                    gemv(x, w, s, y, t)

            times[t] = graph_time_us(graph_of(run), reps=10, rounds=3) / launches
        best = min(times, key=times.get)
        choice[(p.n, p.k)] = best
        every[(p.n, p.k)] = times

        def triton_run(w=w, s=s, x=x, y=y) -> None:
            for _ in range(launches):
                w4_gemv(x, w, s, out=y)

        with pdl_launches():
            triton_us = graph_time_us(graph_of(triton_run), reps=10, rounds=3) / launches
        mb = (w.numel() * 4 + s.numel() * 2) / 1e6
        table[f"{p.n}x{p.k}"] = {"kt": best.kt, "rpt": best.rpt, "xs": best.xs,
                                 "pf": best.ahead(p.k),
                                 "us": round(times[best], 2), "triton_us": round(triton_us, 2),
                                 "mb": round(mb, 3),
                                 "gb_per_s": round(mb * 1e3 / times[best], 1),
                                 "tried": {f"{t.kt}x{t.rpt}{'b' if t.bulk else 's' if t.xs else 'l'}{t.warps}": round(v, 2)
                                           for t, v in times.items()}}  # fmt: skip
        print("tuned", p.n, p.k, table[f"{p.n}x{p.k}"], flush=True)
    return {"choice": choice, "table": table, "times": every}


def link_variants(chain: Chain, ref: torch.Tensor, tuned: dict[str, Any],
                  finals: dict[str, torch.Tensor], into: dict[str, Any]) -> None:  # fmt: skip
    """Why a chain of CUDA GEMVs costs more than the sum of its shapes' own timings: the chain
    with every shape's best tiling of one kind (``_l1``: the row read through L1, ``_smem``:
    staged in shared memory, ``_bulk``: the weights bulk-copied into shared memory), with the shared-memory carveout fixed for every kernel
    (``_carve0``: most L1, ``_carve100``: most shared; a kernel whose carveout differs from the
    one before cannot share its SMs), and both chains without PDL."""
    from cuda.bindings import driver

    every = tuned["times"]

    def chain_of(choice: dict[tuple[int, int], Tiling], pdl: bool = True):
        return gemv_chain(chain, lambda p: choice[(p.n, p.k)], pdl)

    def best_of(kind) -> dict[tuple[int, int], Tiling]:
        """Each shape's fastest tiling of one kind (of any kind where it has none)."""
        return {shape: min([t for t in times if kind(t)] or list(times), key=times.get)
                for shape, times in every.items()}  # fmt: skip

    kinds = {"l1": lambda t: not t.xs and not t.bulk, "smem": lambda t: t.xs and not t.bulk,
             "bulk": lambda t: t.bulk}  # fmt: skip
    for name, kind in kinds.items():
        record_variant(chain, ref, finals, into, f"cuda_gemv_{name}", chain_of(best_of(kind)))
    record_variant(chain, ref, finals, into, "cuda_gemv_nopdl", chain_of(tuned["choice"], False))
    with pdl_launches(False):
        record_variant(chain, ref, finals, into, "product_nopdl", chain.run_product)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for carve in (0, 100):
        for (_, k), t in tuned["choice"].items():
            fn = w4gemv_cuda.kernel_for(chain.device, k, t, 0, None).function
            driver.cuFuncSetAttribute(fn, attr, carve)
        record_variant(chain, ref, finals, into, f"cuda_gemv_carve{carve}",
                       chain_of(tuned["choice"]))  # fmt: skip


def _time_links(chain: Chain, into: dict[str, Any], name: str, fn) -> None:
    """Time a chain of links (one CUDA graph) into `into[name]`: no output to check."""
    us = graph_time_us(graph_of(fn))
    into[name] = {"us": round(us, 1), "us_per_link": round(us / len(chain.products), 2)}
    print(name, into[name], flush=True)


def measure(preset: str, out: dict[str, Any]) -> None:
    """Every variant into `out`, which keeps what was measured if a later stage fails."""
    device = torch.device("cuda")
    chain = Chain(layer_products(preset), device)
    ref = chain.reference()
    out.update(chain_result(chain, ref, preset))  # `product`: the engine's GEMV chain
    gemv = CudaGemv(device)
    tuned = tune(gemv, chain)
    choice = tuned["choice"]
    out["cuda_tiles"] = tuned["table"]
    out["cuda_shape_errors"] = check_shapes(gemv, chain, choice)
    variants = out["variants"]
    finals: dict[str, torch.Tensor] = {}

    cuda_chain = gemv_chain(chain, lambda p: choice[(p.n, p.k)])
    record_variant(chain, ref, finals, variants, "cuda_gemv", cuda_chain)
    link_variants(chain, ref, tuned, finals, variants)
    # the links and the generic tiles, with the engine's unpack header, PDL on
    generic = compile_cubin(gemv.source, {"PDL": 1}, gemv.arch, w4gemv_cuda.sources()[1])
    if torch.cuda.get_device_capability(device)[0] >= 9:
        bulk_flow_variants(chain, ref, finals, variants)
    null = CudaKernel.load(generic, "null_link")
    grids = [-(-p.n // choice[(p.n, p.k)].rows_per_block()) for p in chain.products]

    def null_chain() -> None:
        for g in grids:
            null.launch(g, WARPS * 32, [])

    _time_links(chain, variants, "null_links", null_chain)
    copy = CudaKernel.load(generic, "copy_link")
    width = chain.products[0].k
    bufs = [torch.zeros(width, dtype=torch.bfloat16, device=device) for _ in range(2)]

    def copy_chain() -> None:
        for i in range(len(chain.products)):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            copy.launch(-(-width // 128), 128, [ctypes.c_void_p(src.data_ptr()),
                                                 ctypes.c_void_p(dst.data_ptr()),
                                                 ctypes.c_int(width)])  # fmt: skip

    _time_links(chain, variants, "copy_links", copy_chain)
    flow_variants(chain, ref, generic, finals, variants)


RT_ROWS = 8  # rows of a generic tile: GW warps x GR rows (cuda_chain.cu)
FLOW_WARPS, FLOW_RPT, FLOW_X = 8, 2, 12288 * 2  # the flow's FW, FRPT, FLOW_X (cuda_chain.cu)
FLOW_STAGE, FLOW_STAGES = 56 * 1024, 3  # its default ring
FLOW_RINGS = ((3, 56, 1), (4, 40, 1), (2, 40, 2))  # (stages, KB a stage, blocks an SM) timed


def flow_table(chain: Chain, stage: int = FLOW_STAGE) -> tuple[torch.Tensor, list[int]]:
    """The chain as cuda_chain.cu's `FlowProduct` array (x, w, s, y, then (n, K/32), (tiles, 0),
    (rows a tile, first tile), 0 as int32 pairs in int64 words), and each product's tiles."""
    rows, tiles, first = [], [], 0
    for i, (p, (w, s)) in enumerate(zip(chain.products, chain.weights, strict=True)):
        kc = p.k // 32
        per_tile = min(FLOW_WARPS * FLOW_RPT, stage // (kc * 18))
        count = -(-p.n // per_tile)
        rows.append([chain.input_of(i).data_ptr(), w.data_ptr(), s.data_ptr(),
                     chain.outs[i].data_ptr(), p.n | kc << 32, count, per_tile | first << 32, 0])  # fmt: skip
        tiles.append(count)
        first += count
    return torch.tensor(rows, dtype=torch.int64, device=chain.device), tiles


def bulk_flow_variants(chain: Chain, ref: torch.Tensor, finals: dict[str, torch.Tensor],
                       into: dict[str, Any]) -> None:  # fmt: skip
    """The megakernel's mechanism on bulk-copied tiles (sm_90): ``bulk32``, one launch per product
    of the engine's GEMV with the bulk tiling whose threads the flow's tiles use (32 lanes
    across K, 2 rows a warp, 8 warps), against ``bulk_flow_<stages>x<KB>k_<blocks>pb``, the
    whole chain in one persistent launch whose blocks stream their next tiles' weights into a
    ring of shared-memory stages while they wait on the product before, for each ring of
    FLOW_RINGS. Same sums: each must agree with ``bulk32`` bit for bit (``equal_to_bulk32``)."""
    t32 = Tiling(32, FLOW_RPT, FLOW_WARPS, bulk=1)
    record_variant(chain, ref, finals, into, "bulk32", gemv_chain(chain, lambda p: t32))
    if max(p.k for p in chain.products) * 2 > FLOW_X:
        into["bulk_flow"] = {"error": f"a row wider than {FLOW_X // 2} values"}
        return
    from cuda.bindings import driver

    sms = torch.cuda.get_device_properties(chain.device).multi_processor_count
    done = torch.zeros(len(chain.products), dtype=torch.int32, device=chain.device)
    source, headers = SOURCE.read_text(encoding="utf-8"), w4gemv_cuda.sources()[1]
    for stages, kb, per_sm in FLOW_RINGS:
        name = f"bulk_flow_{stages}x{kb}k_{per_sm}pb"
        cubin = compile_cubin(source, {"PDL": 1, "FS": stages, "FLOW_STAGE": kb * 1024},
                              arch_of(chain.device), headers)  # fmt: skip
        flow_k = CudaKernel.load(cubin, "w4_bulk_flow")
        shared = stages * kb * 1024 + FLOW_X
        flow_k.allow_shared(shared)
        status, most = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            flow_k.function, FLOW_WARPS * 32, shared
        )
        if int(status) != 0 or int(most) < per_sm:
            into[name] = {"error": f"{per_sm} blocks of {shared} bytes do not fit an SM"}
            continue
        table, _ = flow_table(chain, kb * 1024)

        def flow(k=flow_k, table=table, grid=sms * per_sm, shared=shared) -> None:
            done.zero_()
            k.launch(grid, FLOW_WARPS * 32, [ctypes.c_void_p(table.data_ptr()),
                                            ctypes.c_int(len(chain.products)),
                                            ctypes.c_void_p(done.data_ptr()),
                                            ctypes.c_void_p(chain.err.data_ptr())],
                     pdl=False, shared=shared)  # fmt: skip

        try:
            record_variant(chain, ref, finals, into, name, flow)
        except Exception as exc:  # noqa: BLE001 - a first run on a card: the later stages still run
            torch.cuda.synchronize()
            into[name] = {"error": repr(exc)[:500]}
        if name in finals and "bulk32" in finals:
            into[name]["equal_to_bulk32"] = bool(torch.equal(finals[name], finals["bulk32"]))


def product_table(chain: Chain) -> torch.Tensor:
    """The chain as cuda_chain.cu's `Product` array: x, w, s, y, then (n, K/32) and (tiles, 0)
    as int32 pairs in int64 words (little-endian)."""
    rows = []
    for i, (p, (w, s)) in enumerate(zip(chain.products, chain.weights, strict=True)):
        tiles = -(-p.n // RT_ROWS)
        rows.append([chain.input_of(i).data_ptr(), w.data_ptr(), s.data_ptr(),
                     chain.outs[i].data_ptr(), p.n | (p.k // 32) << 32, tiles])  # fmt: skip
    return torch.tensor(rows, dtype=torch.int64, device=chain.device)


def flow_variants(chain: Chain, ref: torch.Tensor, cubin: bytes,
                  finals: dict[str, torch.Tensor], into: dict[str, Any]) -> None:  # fmt: skip
    """``launch`` and ``flow_Nx`` (see the module's docstring), recorded as the persistent
    probe records its variants: each flow's output against ``launch``'s, and a flow whose waits
    timed out (the chain's error flag) reported as not resident."""
    from cuda.bindings import driver

    launch_k = CudaKernel.load(cubin, "w4_rt_launch")
    flow_k = CudaKernel.load(cubin, "w4_rt_flow")
    table = product_table(chain)
    count = len(chain.products)
    done = torch.zeros(count, dtype=torch.int32, device=chain.device)
    ptr = ctypes.c_void_p(table.data_ptr())

    def launches() -> None:
        for i, p in enumerate(chain.products):
            launch_k.launch(-(-p.n // RT_ROWS), WARPS * 32, [ptr, ctypes.c_int(i)])

    record_variant(chain, ref, finals, into, "launch", launches)
    sms = torch.cuda.get_device_properties(chain.device).multi_processor_count
    most = _occupancy(driver, flow_k, WARPS * 32)
    into["flow_blocks_per_sm_max"] = most
    for per_sm in sorted({1, 2, most} - {0}):
        if per_sm > most:
            continue

        def flow(grid=sms * per_sm) -> None:
            done.zero_()
            flow_k.launch(grid, WARPS * 32, [ptr, ctypes.c_int(count),
                                             ctypes.c_void_p(done.data_ptr()),
                                             ctypes.c_void_p(chain.err.data_ptr())], pdl=False)  # fmt: skip

        record_variant(chain, ref, finals, into, f"flow_{per_sm}x", flow)


def _occupancy(driver, kernel: CudaKernel, block: int) -> int:
    """Blocks of `block` threads that fit on one SM at once (1 where the driver will not say)."""
    status, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, block, 0)
    return int(blocks) if int(status) == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="e2b")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{ap.prog}: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tools.fileio import write_atomic

    result: dict[str, Any] = {}
    rc = 0
    try:
        measure(args.preset, result)
    except Exception:  # a first run on a new card: keep the stages that did run, and why not
        result["failed"] = traceback.format_exc()
        print(result["failed"], file=sys.stderr)
        rc = 1
    write_atomic(args.out, json.dumps(result, indent=2, default=str) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
