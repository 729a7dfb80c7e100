"""The int4 GEMV in CUDA C++ (engine/kernels/w4gemv_cuda.cu) for 1-8 bf16 rows, beside Triton's.

Same operands and results as engine/kernels/w4gemv.py's entry points: the plain product, the GLU
and gelu*aux epilogues, and for one row the residual+norm prologue. Several rows (a batched
decode step's products) read each weight word once and unpack its codes once for all of them.
Compiled by NVRTC per (K, tiling, rows, variant) and cached on disk (engine/kernels/cuda_build.py);
the tiling per shape is timed on the card at first use and stored with the Triton tables
(engine/kernels/tuning.py).

Why: a decode step is ~210 dependent products whose cost is mostly each kernel's fixed part
(bench/NOTES.md v26-v32). Tiles fixed at compile time let every thread request all of its
weights before it waits for the kernel before it, or (bulk tilings, sm_90) one thread copy the
block's weights into shared memory. Where this module cannot run (no `cuda.bindings`, not bf16,
more than 8 rows, the CPU) `usable` says no and the Triton kernels run.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels import tuning
from engine.kernels.cuda_build import (
    CudaKernel,
    Headers,
    arch_of,
    cached_cubin,
    cuda_build_available,
)
from engine.kernels.launch import apply_carveout, compiling_only, default_threads, pdl_enabled
from engine.kernels.w4gemm_tune import random_layer, random_sets

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cu")
HEADER = Path(__file__).with_name("w4_codes.cuh")  # shared with lab/engine/cuda_chain.cu
KERNEL_NAME = "w4gemv_cuda"
KERNEL_VERSION = 4  # bump when the kernel changes: stored tilings of older versions are ignored
MAX_AHEAD = 16  # 16-byte weight loads a thread may hold before the wait (registers)
MAX_PRO_K = 8192  # the prologue keeps the row in shared memory (bf16)
MAX_STAGED_K = 16384  # a staged row's 32 KB of shared memory (static: at most 48 KB)
MAX_BULK_BYTES = 160 * 1024  # a bulk tiling's weights and scales (sm_90: 227 KB a block)
MAX_ROWS = 8  # activation rows one launch takes (their sums live in registers: RPT x rows)
MAX_SUMS = 16  # RPT x rows a thread may hold


@dataclass(frozen=True)
class Tiling:
    """Threads across K (a power of two <= 32), rows per thread, warps per block, whether
    the row is staged in shared memory (1) or read through L1 by every thread (0), and whether
    the block's weights come by bulk copy into shared memory (1, sm_90 on) or into registers."""

    kt: int
    rpt: int
    warps: int = 4
    xs: int = 0
    bulk: int = 0

    def rows_per_block(self) -> int:
        return self.warps * 32 // self.kt * self.rpt

    def bulk_bytes(self, k: int) -> int:
        """Dynamic shared memory of a bulk tiling: the block's rows of words and scales."""
        return self.rows_per_block() * (k // 32) * 18 if self.bulk else 0

    def ahead(self, k: int) -> int:
        """Chunks a thread requests before the wait: all of its own where registers allow."""
        per_thread = -(-(k // 32) // self.kt)
        return max(1, min(per_thread, MAX_AHEAD // self.rpt))


@dataclass(frozen=True)
class Prologue:
    """The residual+norm the GEMV makes its input from (w4_gemv_after_residual's operands)."""

    y: torch.Tensor
    h: torch.Tensor
    w_post: torch.Tensor
    scalar: torch.Tensor | None
    w_next: torch.Tensor | None
    h_out: torch.Tensor
    eps: float


def usable(x: torch.Tensor, rows: int, out_dtype: torch.dtype | None = None,
           packed: torch.Tensor | None = None) -> bool:  # fmt: skip
    """Whether this kernel can run the product: up to MAX_ROWS bf16 rows (and a bf16 output) on
    an NVIDIA GPU, with NVRTC and the driver bindings present. The rows and the packed words
    must start on 16 bytes (the kernel reads 16 bytes at a time); a view that does not runs on
    Triton's."""
    return (
        1 <= rows <= MAX_ROWS
        and x.dtype == torch.bfloat16
        and (rows == 1 or x.is_contiguous())
        and x.data_ptr() % 16 == 0
        and (packed is None or packed.data_ptr() % 16 == 0)
        and (out_dtype is None or out_dtype == torch.bfloat16)
        and x.device.type == "cuda"
        and torch.version.hip is None
        and cuda_build_available()
    )


def candidate_tilings(n: int, k: int, epi: int = 0, rows: int = 1) -> list[Tiling]:
    """The tilings worth timing for a shape (the GLU needs whole gate|up pairs per thread),
    all reading the row through L1: staging it in shared memory won some shapes timed alone
    but lost in the chain of a step (bench/NOTES.md v32), which a shape's timing cannot see.
    The prologue stages its row whatever the tiling says. Several activation rows take the
    tilings whose sums fit the registers (rows per thread x rows <= MAX_SUMS)."""
    kc = k // 32
    out = []
    for kt in (8, 16, 32):
        if kt > kc and kt != 8:
            continue
        for rpt in (1, 2, 4):
            if (epi == 1 and rpt % 2) or rpt * rows > MAX_SUMS:
                continue
            t = Tiling(kt, rpt)
            if t.rows_per_block() <= 2 * n:
                out.append(t)
    return out


def bulk_tilings(n: int, k: int, epi: int = 0, rows: int = 1) -> list[Tiling]:
    """Bulk-copy tilings worth timing (sm_90 on): those of `candidate_tilings` whose block's
    weights fit the shared memory, with 4 and 8 warps (more rows a copy)."""
    if k % 256:
        return []
    out = []
    for t in candidate_tilings(n, k, epi, rows):
        for warps in (4, 8):
            b = Tiling(t.kt, t.rpt, warps, bulk=1)
            if b.bulk_bytes(k) <= MAX_BULK_BYTES and b.rows_per_block() <= 2 * n:
                out.append(b)
    return out


def default_tiling(n: int, k: int, epi: int = 0, rows: int = 1) -> Tiling:
    """Untuned: the most rows per thread that still gives about two blocks per SM on a large
    card (132 SMs) with every weight requested before the wait."""
    kt = 32 if k // 32 >= 256 else 16 if k // 32 >= 64 else 8
    for rpt in (r for r in ((4, 2, 1) if epi != 1 else (4, 2)) if r * rows <= MAX_SUMS):
        t = Tiling(kt, rpt)
        if t.ahead(k) * kt * 32 >= k and math.ceil(n / t.rows_per_block()) >= 264:
            return t
    return Tiling(kt, 2 if epi == 1 else 1)


def defines(k: int, t: Tiling, epi: int, pro: Prologue | None, arch: str,
            rows: int = 1) -> dict[str, int]:  # fmt: skip
    """The kernel's compile-time constants for one variant (`rows`: activation rows)."""
    if not 1 <= rows <= MAX_ROWS or (rows > 1 and (t.xs or pro is not None)):
        raise ValueError(f"w4_gemv_cuda: {rows} rows (1..{MAX_ROWS}; one with the prologue or a "
                         "staged row)")  # fmt: skip
    if (t.xs or pro is not None) and k > (MAX_PRO_K if pro is not None else MAX_STAGED_K):
        raise ValueError(f"w4_gemv_cuda: a row of {k} values does not fit in shared memory")
    if t.bulk and (sm_major(arch) < 9 or k % 256 or t.bulk_bytes(k) > MAX_BULK_BYTES):
        raise ValueError(
            f"w4_gemv_cuda: no bulk copy for K={k} with {t} on {arch} (sm_90 on, "
            f"K a multiple of 256, at most {MAX_BULK_BYTES} bytes a block)"
        )
    return {"KC": k // 32, "KT": t.kt, "RPT": t.rpt, "WARPS": t.warps, "PF": t.ahead(k),
            "EPI": epi, "PRO": int(pro is not None), "XS": t.xs, "BULK": t.bulk, "MR": rows,
            "PRO_SCALAR": int(pro is not None and pro.scalar is not None),
            "PRO_NEXT": int(pro is not None and pro.w_next is not None),
            "PDL": int(sm_major(arch) >= 9)}  # fmt: skip


def sm_major(arch: str) -> int:
    """9 for "sm_90", 10 for "sm_100"."""
    return int(arch.removeprefix("sm_")[:-1])


@functools.cache
def sources() -> tuple[str, Headers]:
    """The kernel's text and the headers it includes (read once per process)."""
    return SOURCE.read_text(encoding="utf-8"), {HEADER.name: HEADER.read_text(encoding="utf-8")}


_KERNELS: dict[tuple, CudaKernel] = {}
_BUILDS: dict[tuple, Future[bytes]] = {}
_POOL: list[ThreadPoolExecutor] = []  # made at the first build


def _variant(device: torch.device, k: int, t: Tiling, epi: int, pro: Prologue | None,
             rows: int = 1) -> tuple[str, dict[str, int]]:  # fmt: skip
    arch = arch_of(device)
    return arch, defines(k, t, epi, pro, arch, rows)


def build_ahead(device: torch.device, k: int, t: Tiling, epi: int, pro: Prologue | None,
                rows: int = 1) -> Future[bytes]:  # fmt: skip
    """Start building a variant on a worker thread (NVRTC releases the GIL: a 16-core host
    builds a shape's candidates in about the time of one); `kernel_for` takes the result."""
    arch, consts = _variant(device, k, t, epi, pro, rows)
    key = (arch, tuple(sorted(consts.items())))
    if key not in _BUILDS:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(default_threads(), thread_name_prefix="gpurig-nvrtc"))
        source, headers = sources()
        _BUILDS[key] = _POOL[0].submit(cached_cubin, source, consts, arch,
                                       tuning.cache_dir() / "cuda", headers)  # fmt: skip
    return _BUILDS[key]


def kernel_for(device: torch.device, k: int, t: Tiling, epi: int, pro: Prologue | None,
               rows: int = 1) -> CudaKernel:  # fmt: skip
    """The built kernel of one variant (built once per process, or read from the disk cache),
    loaded on this thread (the one PyTorch's context is current on)."""
    arch, consts = _variant(device, k, t, epi, pro, rows)
    key = (arch, tuple(sorted(consts.items())))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel.load(build_ahead(device, k, t, epi, pro, rows).result(),
                                        "w4_gemv")  # fmt: skip
    return _KERNELS[key]


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, y: torch.Tensor,
           t: Tiling, epi: int = 0, aux: torch.Tensor | None = None,
           pro: Prologue | None = None) -> None:  # fmt: skip
    """One launch on prepared operands (x [K] or [M, K] contiguous, or the prologue's; y [M, N]
    or [M, N/2] for the GLU; aux [M, N]). Inside `compile_ahead` only the build, on a worker
    thread, beside Triton's compiles."""
    n, k = packed.shape[0], packed.shape[1] * 8
    rows = 1 if pro is not None else x.numel() // k
    if compiling_only():
        build_ahead(x.device, k, t, epi, pro, rows)
        return
    kern = kernel_for(x.device, k, t, epi, pro, rows)
    p = pro
    args = [_ptr(x), _ptr(packed), _ptr(scales), _ptr(y), ctypes.c_int(n), _ptr(aux),
            _ptr(p and p.y), _ptr(p and p.h), _ptr(p and p.w_post), _ptr(p and p.scalar),
            _ptr(p and p.w_next), _ptr(p and p.h_out), ctypes.c_float(p.eps if p else 0.0)]  # fmt: skip
    if t.bulk and scales.data_ptr() % 16:
        raise ValueError("w4_gemv_cuda: a bulk copy needs the scales on 16 bytes")
    apply_carveout(kern.function)
    kern.launch(-(-n // t.rows_per_block()), t.warps * 32, args, pdl=pdl_enabled(),
                shared=t.bulk_bytes(k))  # fmt: skip


def tiling_for(n: int, k: int, device: torch.device, epi: int = 0, rows: int = 1) -> Tiling:
    """The stored tiling of this shape on this GPU; tuned now if allowed, else the default. The
    epilogues and the prologue share the plain product's entry (a GLU takes the best even
    one)."""
    gpu = tuning.gpu_key(device)
    key = (
        f"v{KERNEL_VERSION}_N{n}_K{k}"
        + ("_glu" if epi == 1 else "")
        + (f"_M{rows}" if rows > 1 else "")
    )
    stored = tuning.lookup(KERNEL_NAME, key, gpu)
    if stored is not None:
        return Tiling(stored["kt"], stored["rpt"], stored["warps"], stored.get("xs", 0),
                      stored.get("bulk", 0))  # fmt: skip
    if not tuning.autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return default_tiling(n, k, epi, rows)
    best, us = tune(n, k, device, epi, rows)
    _log.info("w4gemv_cuda: tuned N=%d K=%d on %s: %s (%.2f us)", n, k, gpu, best, us)
    tuning.store(KERNEL_NAME, key, gpu, dict(asdict(best), us=round(us, 3)))
    return best


LEAD_K = 256  # the product before each timed launch: [K, 256], as E2B's per-layer projection


def tune(n: int, k: int, device: torch.device, epi: int = 0, rows: int = 1
         ) -> tuple[Tiling, float]:  # fmt: skip
    """Time every candidate on random weights of this shape, enough copies to pass the L2 (as
    a decode step reads them from memory), each launch with PDL as in the step's graph and
    after a small product of another kernel that writes its input: a candidate is timed across
    a dependent boundary, as in the step, where timing it back to back against itself favoured
    tilings that lost there (bench/NOTES.md v32); the time returned is the pair's. Bulk-copy
    tilings join the candidates from sm_90."""
    from engine.kernels.launch import pdl_launches

    sets = random_sets(n, k, torch.bfloat16, rows, device, epi)
    gen = torch.Generator(device=device).manual_seed(n + k)
    aux = None
    if epi == 2:
        aux = (torch.rand(rows, n, device=device, generator=gen) + 0.5).bfloat16()
    lead_x = torch.randn(LEAD_K, device=device, generator=gen).bfloat16()
    lead_w, lead_s = random_layer(k, LEAD_K, torch.bfloat16, device, gen)
    lead_t = default_tiling(k, LEAD_K)

    arch = arch_of(device)
    tilings = candidate_tilings(n, k, epi, rows)
    if sm_major(arch) >= 9:
        tilings += bulk_tilings(n, k, epi, rows)
    build_ahead(device, LEAD_K, lead_t, 0, None)
    for t in tilings:  # every candidate's build at once, then the timings
        build_ahead(device, k, t, epi, None, rows)

    def make_calls(cfg: dict[str, Any]) -> list:
        t = cfg["tiling"]

        def call(a) -> None:
            launch(lead_x, lead_w, lead_s, a[0].view(-1)[:k], lead_t)  # the candidate's x row 0
            launch(a[0], a[1], a[2], a[3], t, epi=epi, aux=aux)

        return [lambda a=a: call(a) for a in sets]

    with pdl_launches(sm_major(arch) >= 9):
        best, us, _ = tuning.pick_fastest([{"tiling": t} for t in tilings], make_calls)
    return best["tiling"], us


def w4_gemv_cuda(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 out: torch.Tensor | None = None, epi: int = 0, aux: torch.Tensor | None = None,
                 pro: Prologue | None = None) -> torch.Tensor:  # fmt: skip
    """y = epi(x @ dequant(packed, scales).T) for up to MAX_ROWS bf16 rows (x [K] or [M, K];
    with `pro` one row, made from the prologue's operands, x's shape only read). epi 1: the GLU
    over interleaved gate|up rows ([..., N/2]); 2: gelu(.) * aux ([M, N]). Call only where
    `usable` says so."""
    n, k = packed.shape[0], packed.shape[1] * 8
    if k % 32 or scales.shape != (n, k // 32) or (epi == 1 and n % 2):
        raise ValueError(
            f"w4_gemv_cuda: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}: expected "
            "packed [N, K/8], scales [N, K/32], K a multiple of 32 (and N even for the GLU)"
        )
    if pro is not None and k > MAX_PRO_K:
        raise ValueError(f"w4_gemv_cuda: the prologue holds at most {MAX_PRO_K} values, not {k}")
    width = n // 2 if epi == 1 else n
    rows = 1 if pro is not None else x.numel() // k
    shape = (width,) if x.dim() == 1 or pro is not None else (rows, width)
    y = out if out is not None else torch.empty(shape, device=x.device, dtype=x.dtype)
    t = tiling_for(n, k, x.device, epi, rows)
    if t.bulk and scales.data_ptr() % 16:  # a view the copy cannot start on: the same threads
        t = Tiling(t.kt, t.rpt, t.warps)
    launch(x.contiguous(), packed.contiguous(), scales.contiguous(), y, t, epi=epi,
           aux=None if aux is None else aux.contiguous(), pro=pro)  # fmt: skip
    return y
