"""GPURIG_CARVEOUT (EngineOptions.carveout, engine/kernels/launch.py): the setting parses and
refuses what is not a percentage; without a GPU nothing is asked of the driver; on a GPU (marker
`gpu`) a Triton kernel launched through `run_kernel` and the CUDA GEMV both carry the setting
afterwards, read back from the driver."""

from __future__ import annotations

import pytest
import torch

from engine.errors import EngineError
from engine.kernels import launch
from engine.options import EngineOptions


@pytest.fixture(autouse=True)
def _driver_default():
    yield
    launch.set_carveout(None)


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("", None), ("driver", None),
                                           ("0", 0), ("50", 50), (" 100 ", 100)])  # fmt: skip
def test_the_setting_parses(raw, want) -> None:
    env = {} if raw is None else {"GPURIG_CARVEOUT": raw}
    assert EngineOptions.from_env(env).carveout == want


@pytest.mark.parametrize("raw", ["101", "-1", "half", "12.5"])
def test_what_is_not_a_percentage_is_refused_with_what_to_set(raw) -> None:
    with pytest.raises(EngineError, match="GPURIG_CARVEOUT") as err:
        EngineOptions.from_env({"GPURIG_CARVEOUT": raw})
    assert "0 to 100" in err.value.remedy
    with pytest.raises(ValueError, match="percentage"):
        EngineOptions(carveout=101)


def test_unset_asks_nothing_of_the_driver() -> None:
    """With no setting a handle is never touched: no CUDA bindings call, none remembered (the
    handle here is not a kernel, so a call would fail)."""
    launch.set_carveout(None)
    launch.apply_carveout(12345)
    assert launch.carveout() is None
    assert not launch._CARVED


def test_the_cpu_engine_leaves_it_to_the_driver() -> None:
    from engine.runner import make_kernels

    launch.set_carveout(77)
    make_kernels(EngineOptions(fast="force", carveout=40), torch.device("cpu"))
    assert launch.carveout() is None


def _carveout_of(function: int) -> int:
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    err, value = driver.cuFuncGetAttribute(attr, driver.CUfunction(int(function)))
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("percent", [0, 100])
def test_a_triton_kernel_carries_the_setting_after_its_launch(percent) -> None:
    from engine.kernels.fused import rmsnorm_rows

    launch.set_carveout(percent)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    rmsnorm_rows(x, w, 1e-6)
    torch.cuda.synchronize()
    assert launch._CARVED, "no Triton kernel handle came back from the launch"
    assert {_carveout_of(h) for h in launch._CARVED} == {percent}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_gemv_carries_the_setting() -> None:
    from engine.kernels import w4gemv_cuda

    x = torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    if not w4gemv_cuda.usable(x, 1):
        pytest.skip("no NVRTC / cuda-bindings here")
    from engine.kernels.w4gemm_tune import random_layer

    packed, scales = random_layer(256, 1536, torch.bfloat16, x.device,
                                  torch.Generator(device="cuda").manual_seed(0))  # fmt: skip
    launch.set_carveout(100)
    t = w4gemv_cuda.default_tiling(256, 1536)
    w4gemv_cuda.launch(x, packed, scales, torch.empty(256, device="cuda", dtype=x.dtype), t)
    torch.cuda.synchronize()
    kern = w4gemv_cuda.kernel_for(x.device, 1536, t, 0, None)
    assert _carveout_of(int(kern.function)) == 100


def test_a_setting_without_the_driver_bindings_says_what_to_install(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # an import of it now fails
    with pytest.raises(EngineError, match="cuda.bindings") as err:
        launch.set_carveout(100)
    assert "cuda-bindings" in err.value.remedy
    assert launch.carveout() is None  # nothing half-set
