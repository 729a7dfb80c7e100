"""CUDA C++ kernels compiled at run time by NVRTC and launched on PyTorch's stream, with
programmatic dependent launch: how the engine runs hand-written CUDA without nvcc.

Why NVRTC and the driver API (`cuda.bindings`): a CUDA build of PyTorch already installs both
(the `nvidia-cuda-nvrtc` and `cuda-bindings` wheels), so a kernel written this way runs wherever
the engine's Triton kernels run, with no compiler on the user's machine. A launch goes through
`cuLaunchKernelEx` on the current PyTorch stream, so stream capture records it into a CUDA graph
like any other kernel, PDL edge included. Built machine code is kept on disk (beside the tuned
tile tables), so a warm start compiles nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels.tuning import write_atomic

CACHE_VERSION = 1  # bump when the build options change: older cached cubins are not read


class CudaBuildError(RuntimeError):
    """NVRTC rejected the source, or the driver would not load or launch what it built."""


def _check(result: tuple, what: str) -> tuple:
    """cuda.bindings calls return (status, *values): raise on a failed status."""
    status, *values = result
    if int(status) != 0:
        raise CudaBuildError(f"{what} failed: {status!r}")
    return tuple(values)


@functools.cache
def cuda_build_available() -> bool:
    """NVRTC and the driver bindings import (a CUDA build of torch brings both)."""
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def arch_of(device: torch.device | None) -> str:
    """NVRTC's target for a device ("sm_90"); sm_90 when there is none (a compile check)."""
    if device is None or device.type != "cuda":
        return "sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


Headers = dict[str, str]  # what `#include "name"` finds: name -> text


def compile_cubin(source: str, defines: dict[str, int], arch: str,
                  headers: Headers | None = None) -> bytes:  # fmt: skip
    """Machine code for `arch` from CUDA C++ `source` with -D `defines` (NVRTC, no GPU needed).
    The compiler's log is in the error when it fails."""
    return _compile(source, defines, arch, headers or {}, ptx=False)


def compile_ptx(source: str, defines: dict[str, int], arch: str,
                headers: Headers | None = None) -> str:  # fmt: skip
    """The PTX NVRTC makes of `source` for `arch` (what a test reads for the order of loads)."""
    return _compile(source, defines, arch, headers or {}, ptx=True).decode().rstrip("\0")


def _compile(source: str, defines: dict[str, int], arch: str, headers: Headers,
             ptx: bool) -> bytes:  # fmt: skip
    from cuda.bindings import nvrtc

    names = sorted(headers)
    (prog,) = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", len(names),
                                              [headers[h].encode() for h in names],
                                              [h.encode() for h in names]),
                     "nvrtcCreateProgram")  # fmt: skip
    target = arch.replace("sm_", "compute_") if ptx else arch
    opts = [f"-arch={target}".encode(), b"--std=c++17"]
    opts += [f"-D{k}={v}".encode() for k, v in sorted(defines.items())]
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(status) != 0:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise CudaBuildError(f"NVRTC ({arch}, {defines}): {log.decode(errors='replace')}")
        if ptx:
            (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            out = b" " * size
            _check(nvrtc.nvrtcGetPTX(prog, out), "nvrtcGetPTX")
            return out
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cubin_key(source: str, defines: dict[str, int], arch: str, headers: Headers) -> str:
    """The name a build is cached under: the source and its headers, its constants, the target
    and NVRTC's own version all change it."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    text = f"{CACHE_VERSION}|{arch}|{major}.{minor}|{sorted(defines.items())}|{source}"
    text += "".join(f"|{name}|{headers[name]}" for name in sorted(headers))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_cubin(source: str, defines: dict[str, int], arch: str, cache: Path | None,
                 headers: Headers | None = None) -> bytes:  # fmt: skip
    """`compile_cubin`, read from `cache` (a directory) when built before, else built and stored
    there atomically. A cache that cannot be written only costs the next process a compile."""
    headers = headers or {}
    if cache is None:
        return compile_cubin(source, defines, arch, headers)
    path = cache / f"{cubin_key(source, defines, arch, headers)}.cubin"
    with contextlib.suppress(OSError):
        return path.read_bytes()
    cubin = compile_cubin(source, defines, arch, headers)
    with contextlib.suppress(OSError):
        write_atomic(path, cubin)
    return cubin


@dataclass
class CudaKernel:
    """One loaded kernel; `launch` puts it on PyTorch's current stream."""

    function: object
    module: object  # kept: unloading the module would free the function
    name: str
    shared_allowed: int = 0  # dynamic shared memory this kernel was allowed (cuFuncSetAttribute)

    @classmethod
    def load(cls, cubin: bytes, name: str) -> CudaKernel:
        from cuda.bindings import driver

        torch.cuda.init()  # the primary context PyTorch uses is made current
        _check(driver.cuInit(0), "cuInit")
        (module,) = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        (function,) = _check(driver.cuModuleGetFunction(module, name.encode()),
                             f"cuModuleGetFunction({name})")  # fmt: skip
        return cls(function, module, name)

    def allow_shared(self, shared: int) -> None:
        """Let launches ask for `shared` bytes of dynamic shared memory (past 48 KB a kernel
        must opt in; an occupancy query counts only what is allowed)."""
        if shared > self.shared_allowed:
            from cuda.bindings import driver

            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self.function, attr, shared),
                   f"cuFuncSetAttribute({self.name}, {shared} bytes of shared memory)")  # fmt: skip
            self.shared_allowed = shared

    def launch(self, grid: int, block: int, args: list[ctypes._SimpleCData],
               pdl: bool = True, shared: int = 0) -> None:  # fmt: skip
        """grid x block threads on the current stream; `args` in the kernel's order (pointers
        as ctypes.c_void_p, ints as ctypes.c_int). PDL: the kernel may start while the one
        before it finishes (it must `griddepcontrol.wait` before reading that one's output).
        `shared`: bytes of dynamic shared memory, allowed to the kernel at its first launch that
        asks for more (past 48 KB a kernel must opt in)."""
        from cuda.bindings import driver

        self.allow_shared(shared)
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
        cfg.sharedMemBytes = shared
        cfg.hStream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = (
                driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            )
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
        else:
            cfg.numAttrs = 0
        slots = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
        _check(driver.cuLaunchKernelEx(cfg, self.function, ctypes.addressof(slots), 0),
               f"cuLaunchKernelEx({self.name})")  # fmt: skip
