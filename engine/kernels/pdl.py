"""Programmatic dependent launch (PDL) and L2 weight prefetch for the decode kernels (sm_90+).

Why: a decode step is a chain of ~300 small dependent kernels. Inside a CUDA graph each one
still waits for its predecessor to finish and flush before it even starts, then spends its
first microseconds waiting for its first weight bytes to arrive from device memory: at a few
microseconds per kernel that latency, not the bandwidth, sets the token rate. On Hopper a kernel
launched with PDL may start while its predecessor still runs: it asks the copy engine to pull
its slice of the weights into L2 (weights never change, so reading them early is safe), then
waits (`griddepcontrol.wait`) for the predecessor's results, then lets its own successor start
(`griddepcontrol.launch_dependents`) and computes from L2. The same idea as CUTLASS's "GEMM
with L2 weight prefetch" for low-latency inference.

Rules every kernel launched with PDL here keeps, so that the graph stays correct:
* before `pdl_enter` it reads only what no kernel of the step writes (weights, scales, the
  position buffer the host fills before replay), and writes nothing;
* every program calls `pdl_enter` (a kernel that finished without waiting would let its
  successor overtake the kernel before it).

| variable         | meaning                                                        | default |
|------------------|----------------------------------------------------------------|---------|
| GPURIG_PDL       | "1" launches the decode kernels with PDL                       | off     |
| GPURIG_PREFETCH  | "1" prefetches each program's weight slice into L2 first       | off     |

Both work only on NVIDIA GPUs of compute capability 9.0 or newer (the instructions do not exist
before Hopper) and never in the CPU interpreter. They are off by default because on the lent
H200 they bought nothing (bench/NOTES.md, "PDL and L2 prefetch"): the e2b decode step ran at
519 tok/s plain, 511 with both, 505 with the prefetch alone and 476 with PDL alone, and a GEMV
whose weights already sat in L2 took as long as one reading them from memory (3.38 vs 3.41 us
at 2560 x 1536): the kernels are bound by their own instructions and the dependent chain, not
by memory latency or launch gaps. The results are bit-identical either way (tested).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "GPURIG_PDL"
PREFETCH_ENV = "GPURIG_PREFETCH"


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _native_sm90(t: torch.Tensor) -> bool:
    if not t.is_cuda or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _sm90(index)


def pdl_on(t: torch.Tensor) -> bool:
    """Launch kernels on t's device with programmatic dependent launch."""
    return os.environ.get(PDL_ENV, "0") == "1" and _native_sm90(t)


def prefetch_on(t: torch.Tensor) -> bool:
    """Prefetch each program's weight slice into L2 before waiting on the previous kernel."""
    return os.environ.get(PREFETCH_ENV, "0") == "1" and _native_sm90(t)


def launch_options(pdl: bool) -> dict[str, bool]:
    """Extra keyword arguments of a Triton launch (none when PDL is off: the interpreter and
    older Triton builds do not know the option)."""
    return {"launch_pdl": True} if pdl else {}


def pdl_kwargs(t: torch.Tensor) -> dict[str, bool]:
    """The `PDL` constexpr and the launch option of a kernel working on t, together."""
    on = pdl_on(t)
    return {"PDL": on, **launch_options(on)}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptr, nbytes, ON: tl.constexpr):
    """Ask the copy engine to pull nbytes starting at ptr into L2 (one thread of the program
    issues one `cp.async.bulk.prefetch`). A hint: it never faults and changes no result. The
    range is widened to 16-byte boundaries, as the instruction requires."""
    if ON:
        start = ptr.to(tl.int64, bitcast=True)
        lo = start & -16
        hi = (start + nbytes + 15) & -16
        size = (hi - lo).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [tl.full([1], 0, tl.int64) + lo, tl.full([1], 0, tl.int32) + size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
