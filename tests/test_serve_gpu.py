"""On a real GPU: the GPU facts from NVML, the engine served on CUDA by start_vllm_server, its GPU
memory given back on stop (NVML before/after), and the vLLM path's preflight passing on the
measured GPU (capability >= 8: no Turing patch needed, dtype left to vLLM) with the stand-in vLLM.

    python3 -m pytest -q -m gpu tests/test_serve_gpu.py
"""

from __future__ import annotations

import pytest
from serve_support import free_port, install_fake_vllm, scenario_env

from tools.gpu import nvml_gpu_count
from tools.serving import start_vllm_server, stop_vllm_server
from tools.serving.preflight import measure_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvml_gpu_count(timeout_s=2), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # not this machine's downloads


def test_engine_on_cuda_and_memory_back_on_stop(tmp_path):
    gpus = measure_gpus()
    assert gpus.devices, gpus.error
    assert gpus.devices[0].capability and gpus.devices[0].memory_total_bytes
    from server_support import make_scripted_checkpoint  # torch: only where a GPU is

    model = tmp_path / "scripted"
    make_scripted_checkpoint(model, [[101, "391", 106]])
    record = start_vllm_server(
        str(model), backend="engine", port=free_port(), device="cuda", timeout_s=300,
        env={"GPURIG_KERNEL_AUTOTUNE": "0"},
    )  # fmt: skip
    assert record.state == "ready", record.failure
    assert record.startup_facts.device.startswith("cuda")
    from tools.serving import query_model

    assert query_model("17*23?", max_tokens=4).text == "391"
    result = stop_vllm_server(timeout_s=30)
    assert result.port_free and not result.killed_after_timeout
    before, after = result.gpu_memory_before[0], result.gpu_memory_after[0]
    print(f"GPU memory used: {before.used_bytes / 2**20:.0f} -> {after.used_bytes / 2**20:.0f} MiB")
    assert after.used_bytes < before.used_bytes


def test_vllm_path_on_the_measured_gpu(tmp_path):
    python = install_fake_vllm(tmp_path / "venv")
    record = start_vllm_server(
        "google/gemma-4-E2B-it", python_bin=str(python), port=free_port(),
        env=scenario_env("serve"), timeout_s=60,
    )  # fmt: skip
    assert record.state == "ready", record.failure
    cap = measure_gpus().min_capability
    dtype = record.command[record.command.index("--dtype") + 1]
    assert dtype == ("float16" if cap < (8, 0) else "auto")
    assert stop_vllm_server().port_free
