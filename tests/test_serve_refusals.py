"""The refusals a start makes in seconds, each with the command that fixes it, on recorded GPU
facts and host memory (a T4, an H200, no GPU, the seeds' 7.3 GiB host) and real venvs."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from serve_support import H200, NO_GPU, T4, free_port, install_fake_vllm, scenario_env

from tools.errors import GpurigError, InvalidInputError, NotFoundError, RefusedError
from tools.host import MemoryReport
from tools.serving import GpuDevice, GpuFacts, start_vllm_server, stop_vllm_server
from tools.serving import state as st
from tools.turing import apply_turing_patch, verify_turing_patch

HUB = "google/gemma-4-E2B-it"
GIB = 2**30
SEED_HOST = MemoryReport(  # the seeds' n1-standard-2: 7.26 GiB RAM, no swap
    ram_total_bytes=int(7.26 * GIB), ram_available_bytes=int(6.8 * GIB),
    swap_total_bytes=0, swap_used_bytes=0, swap_free_bytes=0,
)  # fmt: skip


@pytest.fixture
def fake_python(tmp_path) -> str:
    return str(install_fake_vllm(tmp_path / "venv"))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GPURIG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # not this machine's downloads
    yield
    for record in st.list_records():
        stop_vllm_server(record.name, timeout_s=2)


def refused(exc_type, **kw) -> GpurigError:
    kw.setdefault("port", free_port())
    t0 = time.monotonic()
    with pytest.raises(exc_type) as info:
        start_vllm_server(kw.pop("model", HUB), **kw)
    assert time.monotonic() - t0 < 10
    assert info.value.remedy, info.value
    assert not st.list_records()  # nothing started, nothing recorded
    return info.value


def test_no_gpu_refuses_vllm_and_points_at_the_engine(fake_python):
    err = refused(RefusedError, python_bin=fake_python, gpus=NO_GPU)
    assert "no GPU" in err.message and "libnvidia-ml.so" in err.message
    assert "backend='engine'" in err.remedy and "gpurig doctor" in err.remedy


def test_more_parallel_gpus_than_visible(fake_python):
    err = refused(RefusedError, python_bin=fake_python, gpus=H200, tensor_parallel_size=2)
    assert "2 GPUs, but 1 is visible" in err.message
    two = GpuFacts(source="two", devices=[GpuDevice(index=i, capability=(9, 0)) for i in (0, 1)])
    err = refused(
        RefusedError, python_bin=fake_python, gpus=two, tensor_parallel_size=2,
        pipeline_parallel_size=1, env={"CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip
    assert "1 is visible" in err.message and "CUDA_VISIBLE_DEVICES" in err.remedy


def test_turing_needs_the_patch_then_starts_in_float16(fake_python, tmp_path, monkeypatch):
    assert verify_turing_patch(fake_python).state_after == "stock"
    err = refused(RefusedError, python_bin=fake_python, gpus=T4)
    assert "capability 7.5" in err.message and "stock" in err.message
    assert "gpurig patch apply" in err.remedy
    assert apply_turing_patch(fake_python).state_after == "patched"
    record = start_vllm_server(
        HUB, python_bin=fake_python, port=free_port(), gpus=T4, env=scenario_env("serve"),
        timeout_s=30,
    )  # fmt: skip
    assert record.state == "ready", record.failure
    i = record.command.index("--dtype")
    assert record.command[i + 1] == "float16"  # sm_75 has no bf16
    assert record.command[record.command.index("--kv-cache-dtype") + 1] == "auto"


def test_python_without_vllm(bare_venv):
    err = refused(NotFoundError, python_bin=str(bare_venv), gpus=H200)
    assert "vLLM is not installed" in err.message
    assert f"{bare_venv} -m pip install vllm" in err.remedy


def test_the_port_taken(fake_python):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = refused(RefusedError, python_bin=fake_python, gpus=H200, port=port)
        assert f"port {port}" in err.message and "ss -ltnp" in err.remedy
        err = refused(NotFoundError, model="/nonexistent", backend="engine", port=port)
        assert "does not exist" in err.message  # the model is checked before the port


def test_missing_local_path_but_a_hub_id_passes(fake_python, tmp_path):
    err = refused(NotFoundError, model=str(tmp_path / "nope"), python_bin=fake_python, gpus=H200)
    assert "does not exist" in err.message
    err = refused(NotFoundError, model="./models/gemma", python_bin=fake_python, gpus=H200)
    assert "does not exist" in err.message


def test_ram_and_swap_too_small_for_the_weights(fake_python, tmp_path):
    model = tmp_path / "gemma-bf16"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as fh:  # sparse: 9.54 GiB, no disk used
        fh.truncate(10_246_621_918)
    err = refused(RefusedError, model=str(model), python_bin=fake_python, gpus=H200,
                  memory=SEED_HOST)  # fmt: skip
    assert "14.3 GiB needed" in err.message  # 9.54 GiB x 1.5
    assert "sudo mkswap" in err.remedy and "sudo swapon" in err.remedy
    assert "gpurig host --need-gib 9.54" in err.remedy


def test_a_cached_hub_model_is_measured_too(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--google--gemma-4-E2B-it" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    blob = tmp_path / "hub" / "blob"
    with open(blob, "wb") as fh:  # the hub cache links snapshot files to blobs
        fh.truncate(10_246_621_918)
    (snap / "model.safetensors").symlink_to(blob)
    err = refused(RefusedError, python_bin=fake_python, gpus=H200, memory=SEED_HOST)
    assert "9.54 GiB of weights" in err.message and "sudo swapon" in err.remedy


def test_unknown_extra_flag_refused_with_a_suggestion(fake_python):
    err = refused(InvalidInputError, python_bin=fake_python, gpus=H200,
                  extra_args=["--max-modle-len", "8192"], env=scenario_env("serve"))  # fmt: skip
    assert "--max-modle-len" in err.message and "did you mean --max-model-len" in err.message
    # the flags came from this vLLM's own --help, cached per version
    cache = Path(os.environ["GPURIG_HOME"]) / "vllm-flags" / "0.33.0.json"
    assert '"source": "help"' in cache.read_text()


def test_same_name_still_running(fake_python):
    first = start_vllm_server(HUB, name="one", python_bin=fake_python, port=free_port(),
                              gpus=H200, env=scenario_env("serve"), timeout_s=30)  # fmt: skip
    assert first.state == "ready"
    with pytest.raises(RefusedError) as info:
        start_vllm_server(HUB, name="one", python_bin=fake_python, port=free_port(), gpus=H200)
    assert "still running" in info.value.message
    assert "gpurig serve stop one" in info.value.remedy
    stop_vllm_server("one")
    # stopped: the name can be used again
    again = start_vllm_server(HUB, name="one", python_bin=fake_python, port=free_port(),
                              gpus=H200, env=scenario_env("serve"), timeout_s=30)  # fmt: skip
    assert again.state == "ready"
    assert Path(again.log_path).with_suffix(".log.1").exists()  # the first run's log is kept


def test_bad_inputs():
    for kw, word in [
        ({"name": "../etc"}, "name"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"backend": "tgi"}, "backend"),
        ({"timeout_s": 0}, "timeout_s"),
    ]:
        err = refused(InvalidInputError, **kw)
        assert word in err.message


def test_cpu_kv_cache_gib_is_for_the_cpu_build_only(fake_python):
    """The stand-in is a distribution named vllm: PyPI's CUDA build, sized by GPU memory."""
    err = refused(InvalidInputError, python_bin=fake_python, gpus=H200, cpu_kv_cache_gib=2)
    assert "vLLM 0.33.0, CUDA build (vllm)" in err.message
    assert "gpu_memory_utilization" in err.remedy
