"""Kernel tests run the real Triton kernels: compiled on a GPU, interpreted on the CPU.

Without CUDA, TRITON_INTERPRET=1 makes `@triton.jit` build interpreter functions; Triton reads
the variable when a kernel is decorated, so it is set here, before the kernel modules are
imported, and any kernel module that something else imported earlier is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for name in ("engine.kernels.w4gemv", "engine.kernels.w4dequant",
                 "engine.kernels.attention_decode", "engine.kernels.attention_paged",
                 "engine.kernels.w4gemm_kernel", "engine.kernels.w4mma_kernel",
                 "engine.kernels.w4gemm", "engine.kernels.attention_prefill",
                 "engine.kernels.step_inputs", "engine.kernels.greedy_tail"):  # fmt: skip
        if name in sys.modules:
            importlib.reload(sys.modules[name])


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
