"""Start-up facts from each vLLM log format, the failure diagnosis on recorded texts (kernel log
included), and the flag check's normalisation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.serving.failures import diagnose
from tools.serving.flags import FlagSet, flags_from_help, normalize, unknown_flags
from tools.serving.startup_facts import parse_startup_facts

LOGS = Path(__file__).parent / "data" / "vllm_logs"


def lines(name: str) -> list[str]:
    return (LOGS / name).read_text().splitlines()


def test_facts_0_26_two_lines():
    f = parse_startup_facts(lines("start_0.26.log"))
    assert f.vllm_version == "0.26.0"
    assert (f.weights_gib, f.load_seconds) == (9.8, 98.721582)
    assert f.load_gib_per_s == pytest.approx(9.8 / 98.721582, abs=1e-3)
    assert f.kv_cache_memory_gib == 3.03
    assert f.kv_cache_tokens == 315974
    assert (f.max_concurrency_tokens, f.max_concurrency) == (16384, 19.29)
    assert f.attention_backend == "TRITON_ATTN"
    assert f.dtype_cast == "Casting torch.bfloat16 to torch.float16"
    assert f.linear_kernel is None


def test_facts_0_29_one_line_qat_on_a_t4():
    f = parse_startup_facts(lines("start_0.29.log"))
    assert f.vllm_version == "0.29.0"
    assert f.linear_kernel == "MarlinLinearKernel"
    assert f.weights_gib == 8.02
    assert f.kv_cache_tokens == 519568
    assert (f.max_concurrency_tokens, f.max_concurrency) == (16384, 31.71)
    assert f.dtype_cast is None


def test_facts_0_31_device_prefix_and_enum_backend():
    f = parse_startup_facts(lines("start_0.31.log"))
    assert f.vllm_version == "0.31.0"
    assert f.attention_backend == "TRITON_ATTN"
    assert f.kv_cache_tokens == 315974 and f.max_concurrency == 19.29
    assert f.weights_gib == 9.8 and f.load_seconds == 97.5


def test_facts_engine_lines():
    f = parse_startup_facts([
        "gpurig engine: warmed up in 0.54 s",
        "gpurig engine: serving 'tiny' on http://127.0.0.1:8100/v1 (device cuda:0, context 4096)",
    ])  # fmt: skip
    assert (f.warmup_seconds, f.device, f.max_context) == (0.54, "cuda:0", 4096)
    assert f.serving_url == "http://127.0.0.1:8100/v1"


def test_oom_killer_line_from_the_kernel_log_names_it():
    kernel = [
        "[ 1012.1] Out of memory: Killed process 14015 (VLLM::EngineCor) total-vm:28911236kB, "
        "anon-rss:6512344kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:14232kB oom_score_adj:0"
    ]
    f = diagnose(lines("fail_oom_killed.log"), {"signal": "SIGKILL", "server_pid": 14010},
                 {"weights_gib": 9.54}, kernel_log=kernel)  # fmt: skip
    assert f.cause == "host_oom_killed"
    assert "Killed process 14015 (VLLM::EngineCor)" in f.evidence
    assert "sudo swapon" in f.remedy and f.exit == "killed by SIGKILL"
    # someone else's OOM kill is not ours
    other = ["Out of memory: Killed process 99 (chrome) total-vm:1kB"]
    f = diagnose(lines("fail_oom_killed.log"), {"signal": "SIGKILL", "server_pid": 14010},
                 kernel_log=other)  # fmt: skip
    assert f.cause == "killed"


def test_engine_refusal_carries_its_remedy():
    tail = [
        "gpurig: error: cannot listen on 127.0.0.1:8100: Address already in use",
        "gpurig: what to do: pick a free port with --port, or stop what is using this one",
    ]
    f = diagnose(tail, {"returncode": 2, "signal": None})
    assert f.cause == "address_in_use"
    tail = [
        "gpurig: error: config.json is missing",
        "gpurig: what to do: pass a checkpoint made by gpurig engine make-checkpoint",
    ]
    f = diagnose(tail, {"returncode": 2, "signal": None})
    assert f.cause == "engine_refused" and "make-checkpoint" in f.remedy


def test_flag_normalisation_and_check():
    help_text = "  --max-model-len MAX_MODEL_LEN\n  --port PORT\n  --compilation-config.mode X"
    fs = FlagSet(version="x", source="help", flags=flags_from_help(help_text))
    assert fs.flags == ["--compilation-config", "--max-model-len", "--port"]
    assert normalize("--max_model_len=8192") == "--max-model-len"
    assert normalize("-1") is None and normalize("8192") is None
    ok = ["--max_model_len=8192", "8192", "--port", "1", "--compilation-config.mode", "3"]
    assert unknown_flags(ok, fs) == []
    assert unknown_flags(["--max-modle-len", "1", "--no-port"], fs) == [
        "--max-modle-len",
        "--no-port",
    ]
    static = FlagSet(version="x", source="static", flags=["--enforce-eager"])
    assert unknown_flags(["--no-enforce-eager"], static) == []
    assert unknown_flags(["--anything"], FlagSet(version="x", source="none")) == []
