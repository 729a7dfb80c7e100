"""What the CUDA GEMV's test modules share: whether NVRTC builds here, the GPU mark, the kernel's
source, a prologue's constants, and random int4 layers on the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cuda_build, w4gemv_cuda
from engine.kernels.w4gemv_cuda import Prologue


def _nvrtc_works() -> bool:
    if not cuda_build.cuda_build_available():
        return False
    try:
        cuda_build.compile_cubin('extern "C" __global__ void k() {}', {}, "sm_90")
    except Exception:  # noqa: BLE001 - any failure to load libnvrtc means: skip
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_works(), reason="NVRTC (a CUDA build of torch)")
no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
SOURCE, HEADERS = w4gemv_cuda.sources()
PRO = Prologue(*(torch.empty(1),) * 6, eps=1e-6)  # a prologue with a scalar and a next norm


def layer(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed words and scales of an [n, k] int4 layer on the GPU."""
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen,
                           device="cuda")  # fmt: skip
    scales = (torch.rand(n, k // 32, generator=gen, device="cuda") * 0.02 + 0.001).bfloat16()
    return packed, scales
