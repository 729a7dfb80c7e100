"""Why a server died (or never got ready), read from its log tail, its exit and the kernel log.

Each cause seen on real installs (their log tails: tests/data/vllm_logs/) has a pattern, a title
and a remedy with the command that fixes it; the first cause whose pattern is in the tail wins
(ordered most specific first). An unknown failure still returns the tail and how the process
ended, so nothing is hidden.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from tools.serving.models import Failure

TAIL_LINES = 40


@dataclass(frozen=True)
class Cause:
    code: str
    title: str
    pattern: re.Pattern[str]
    remedy: Callable[[dict], str]


def _swap_remedy(ctx: dict) -> str:
    from tools.host import (
        Facts,
        group_filesystems,
        measure_memory,
        measure_path,
        rule_memory_staging,
    )

    weights = ctx.get("weights_gib")
    try:
        reports = [measure_path("/")]
        advice = rule_memory_staging(
            Facts(
                paths=reports,
                filesystems=group_filesystems(reports),
                memory=measure_memory(),
                need_gib=weights,
            )
        )
        commands = advice.commands
    except Exception:  # the remedy must not fail the diagnosis
        commands = []
    if not commands:
        commands = [
            "sudo fallocate -l 16G /swapfile",
            "sudo chmod 600 /swapfile",
            "sudo mkswap /swapfile",
            "sudo swapon /swapfile",
        ]
    return (
        "host RAM + swap is too small to stage the weights (a 7.8 GB host without swap was OOM-killed loading Gemma 4 E2B; a "
        "16 GB swapfile fixed it, and swap peaked at 6.6 GiB). Add swap, then start again: "
        + "; ".join(commands)
        + " (check first: gpurig host)"
    )


def _fixed(text: str) -> Callable[[dict], str]:
    return lambda _ctx: text


def _cuda_oom(ctx: dict) -> str:
    util = ctx.get("gpu_memory_utilization")
    lower = f"{max(0.5, round(util - 0.1, 2))}" if util else "0.8"
    return (
        f"lower gpu_memory_utilization (e.g. {lower}; --gpu-memory-utilization) or "
        "max_model_len (e.g. 8192; --max-model-len), or max_num_seqs; check that no other "
        "process holds GPU memory (nvidia-smi)"
    )


def _python(ctx: dict) -> str:
    return ctx.get("python") or "<python>"


def _torchvision(ctx: dict) -> str:
    py = _python(ctx)
    return (
        f"remove the CUDA torchvision that pip put beside the +cpu torch (vLLM's text path "
        f"needs none of the three): {py} -m pip uninstall -y torchvision torchaudio torchcodec"
    )


def _cpu_kv(ctx: dict) -> str:
    gib = ctx.get("cpu_kv_cache_gib")
    return (
        "give the CPU build a KV cache that fits in free RAM: a smaller cpu_kv_cache_gib "
        "(--cpu-kv-cache-gib N; it sets VLLM_CPU_KVCACHE_SPACE, GiB)"
        + (f", below the {gib} GiB asked" if gib else "")
        + "; check free RAM with gpurig host, or stop what holds it"
    )


CAUSES: list[Cause] = [
    # llama.cpp's llama-server (backend="llamacpp")
    Cause(
        "llamacpp_unknown_architecture",
        "this llama.cpp does not know the GGUF's model architecture",
        re.compile(r"unknown model architecture: '?[\w.-]+'?"),
        _fixed(
            "use a llama.cpp new enough for the model (gpurig's build, .ci/llama-cpp-build, has "
            "Gemma 4), or serve the checkpoint with backend='engine' or 'vllm'"
        ),
    ),
    Cause(
        "llamacpp_not_gguf",
        "llama-server could not read the model as a GGUF file",
        re.compile(
            r"(gguf_init_from_file\w*: (?:invalid magic|failed to open|failed to read)[^\n]*|"
            r"failed to load model, '[^']*'|error loading model: [^\n]*)"
        ),
        _fixed(
            "pass a complete GGUF file; export one from a checkpoint directory: gpurig engine "
            "export-gguf DIR --out model.gguf (MCP: export_gguf)"
        ),
    ),
    Cause(
        "llamacpp_bad_flag",
        "llama-server refused a command-line argument",
        re.compile(
            r"error: (?:invalid argument|unknown argument|error while handling argument)[^\n]*"
        ),
        _fixed("fix or remove it in extra_args; the accepted flags: `llama-server --help`"),
    ),
    Cause(
        "address_in_use",
        "the port was taken when llama-server tried to listen",
        re.compile(r"couldn't bind HTTP server socket[^\n]*"),
        _fixed(
            "use a free port (--port / port=), or stop what listens there (gpurig serve status; "
            "ss -ltnp)"
        ),
    ),
    Cause(
        "cpu_attention_unsupported",
        "vLLM's CPU attention cannot run this checkpoint's head size",
        re.compile(r"Unsupported CPU attention configuration: .*"),
        _fixed(
            "vLLM's CPU build serves only some head sizes (32 and 64 served, 16 did not): serve "
            "this checkpoint with gpurig's engine (backend='engine', --backend engine), or with "
            "a GPU build of vLLM"
        ),
    ),
    Cause(
        "cpu_wna16_needs_avx512",
        "vLLM's CPU build has no W4A16 kernel on this CPU: without AVX-512 it loads its AVX2 "
        "kernels, which lack cpu_gemm_wna16",
        re.compile(r"'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"),
        _fixed(
            "serve a 16-bit checkpoint (gpurig engine make-checkpoint --unquantized), or this "
            "one with gpurig's engine (backend='engine'), or on a host whose CPU has AVX-512 "
            "(grep avx512f /proc/cpuinfo); gpurig serve start refuses this pair before starting"
        ),
    ),
    Cause(
        "cpu_wna16_no_float32",
        "vLLM's CPU build has no float32 W4A16 kernel on this CPU: with AVX-512 BF16 it loads "
        "its vllm/_C kernels, whose cpu_gemm_wna16 takes 16-bit activations only",
        re.compile(r"\"cpu_gemm_wna16\" not implemented for 'Float'"),
        _fixed(
            "serve a 16-bit checkpoint in float32 (gpurig engine make-checkpoint --unquantized), "
            "or this one with gpurig's engine (backend='engine'); gpurig serve start refuses "
            "this pair before starting"
        ),
    ),
    Cause(
        "cpu_op_missing",
        "vLLM's CPU build lacks a kernel this configuration calls",
        re.compile(r"'_OpNamespace' '_C' object has no attribute '\w+'"),
        _fixed(
            "this vLLM build's kernels for this CPU (its AVX2 or AVX-512 library) do not cover "
            "the model's layers: serve a 16-bit checkpoint, or use backend='engine'"
        ),
    ),
    Cause(
        "cpu_kv_cache_too_big",
        "the CPU build's KV cache does not fit in the free RAM",
        re.compile(
            r"(on kv cache allocation is less than requested memory for kv|"
            r"is less than desired CPU memory utilization)"
        ),
        _cpu_kv,
    ),
    Cause(
        "torchvision_cuda",
        "PyPI's CUDA torchvision under a +cpu torch: transformers' import of it dies",
        re.compile(r"operator torchvision::nms does not exist"),
        _torchvision,
    ),
    Cause(
        "vllm_metadata_missing",
        "`vllm serve` reads the version of a distribution named vllm, and this vLLM is "
        "installed under another name (vllm-cpu)",
        re.compile(r"PackageNotFoundError: No package metadata was found for vllm"),
        lambda ctx: (
            f"run the API server module instead of the `vllm` script: {_python(ctx)} -m "
            "vllm.entrypoints.openai.api_server --model MODEL ... (what gpurig serve start "
            "runs for a CPU build)"
        ),
    ),
    Cause(
        "no_weights",
        "the model directory holds no weights vLLM can load",
        re.compile(r"Cannot find any model weights with .*|No model weights found.*"),
        _fixed(
            "point model at a checkpoint directory with its *.safetensors files (a download "
            "that stopped half-way leaves config.json only: download it again), or at a hub id"
        ),
    ),
    Cause(
        "turing_smem",
        "Triton attention asks for more shared memory than this GPU has "
        "(the Turing clamp is missing)",
        re.compile(r"OutOfResources: out of resource: shared memory"),
        _fixed(
            "apply the Turing patch, then start again: gpurig patch apply (MCP: "
            "apply_turing_patch); check with gpurig patch verify"
        ),
    ),
    Cause(
        "host_oom_killed",
        "the kernel's OOM killer killed the server while it loaded weights",
        re.compile(r"Out of memory: Killed process \d+"),
        _swap_remedy,
    ),
    Cause(
        "mmap_enomem",
        "the weights could not be memory-mapped: host memory is too small",
        re.compile(r"unable to mmap \d+ bytes from .*Cannot allocate memory"),
        _swap_remedy,
    ),
    Cause(
        "libcudnn_missing",
        "torch cannot load libcudnn.so.9 (CUDA torch installed with --no-deps)",
        re.compile(r"libcudnn\.so\.\d+: cannot open shared object file"),
        _fixed(
            "reinstall torch with its NVIDIA libraries: <python> -m pip install "
            "--force-reinstall torch==<the version vLLM pins> (without --no-deps); "
            "gpurig gpu shows the pin"
        ),
    ),
    Cause(
        "libcudart_missing",
        "vLLM's CUDA kernels cannot load libcudart: a CPU build of torch "
        "under a CUDA build of vLLM",
        re.compile(r"libcudart\.so[.\d]*"),
        _fixed(
            "install the CUDA torch that vLLM pins: <python> -m pip install "
            "--force-reinstall torch==<pin> --index-url https://download.pytorch.org/whl/"
            "cu128 (gpurig gpu shows the pin and the index for your driver)"
        ),
    ),
    Cause(
        "gemma4_unsupported",
        "this vLLM/transformers pair cannot read Gemma 4's per-layer head_dim",
        re.compile(r"AmbiguousGlobalPerLayerAttributeError"),
        _fixed(
            "use vLLM >= 0.27.2 with the transformers it pins: <python> -m pip install "
            "'vllm>=0.27.2'"
        ),
    ),
    Cause(
        "cuda_oom",
        "the GPU ran out of memory",
        re.compile(r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory"),
        _cuda_oom,
    ),
    Cause(
        "kv_cache_too_small",
        "the KV cache cannot hold one request of max_model_len",
        re.compile(
            r"(larger than the maximum number of tokens that can be stored in KV cache|"
            r"No available memory for the cache blocks|"
            r"is larger than the (?:KV cache|available KV cache))"
        ),
        _cuda_oom,
    ),
    Cause(
        "address_in_use",
        "the port is already taken",
        re.compile(r"[Aa]ddress already in use|Errno 98"),
        _fixed(
            "pick another port (port=..., --port) or stop what listens there: "
            "gpurig serve status; ss -ltnp"
        ),
    ),
    Cause(
        "unknown_flag",
        "the server does not accept a flag it was given",
        re.compile(r"error: unrecognized arguments?:.*|error: argument .*"),
        _fixed(
            "remove or fix that flag in extra_args; `vllm serve --help=all` lists them "
            "(gpurig checks extra_args against the installed version)"
        ),
    ),
    Cause(
        "worker_crashed",
        "vLLM's worker process died in native code, without a Python error (exit code -4 is "
        "SIGILL: a kernel it picked for this CPU and dtype uses an instruction this CPU, or the "
        "VM around it, does not execute; None: it died before its code was read)",
        # -9 (SIGKILL) is left to the OOM checks; the same death has been logged with -4 and None
        re.compile(r"Worker proc \S+ died unexpectedly \(exit code: (?:-(?!9\b)\d+|None)\)"),
        _fixed(
            "serve in float32 (dtype='float32', gpurig serve start --dtype float32), which "
            "takes other kernels, or use gpurig's engine (backend='engine'); seen with vLLM "
            "0.32.0's CPU build in bfloat16 on a Xeon with AMX"
        ),
    ),
    Cause(
        "engine_dead",
        "vLLM's engine core died",
        re.compile(
            r"RuntimeError: Worker failed with error .*|EngineCore encountered a fatal error|"
            r"EngineDeadError"
        ),
        _fixed(
            "read the engine core's traceback in the log tail (gpurig serve logs NAME --grep "
            "Error); the first ERROR lines name the root cause"
        ),
    ),
    Cause(
        "engine_refused",
        "the engine refused to start",
        re.compile(r"gpurig: error: .*"),
        _fixed("see the log line after 'what to do'"),
    ),
]


def kernel_oom_lines() -> list[str]:
    """OOM-killer lines from the kernel log, where this user may read it (dmesg_restrict)."""
    if not shutil.which("dmesg"):
        return []
    try:
        proc = subprocess.run(
            ["dmesg"],
            capture_output=True,
            text=True,
            timeout=3,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    return [ln for ln in proc.stdout.splitlines() if "Out of memory: Killed process" in ln]


def describe_exit(exit_info: dict | None) -> str | None:
    if not exit_info:
        return None
    if exit_info.get("signal"):
        return f"killed by {exit_info['signal']}"
    return f"exit code {exit_info.get('returncode')}"


def _own_oom(lines: list[str], pids: set[int]) -> str | None:
    for line in reversed(lines):
        m = re.search(r"Killed process (\d+) \(([^)]*)\)", line)
        if m and (int(m.group(1)) in pids or m.group(2).startswith("VLLM")):
            return line.strip()
    return None


def diagnose(
    tail: list[str],
    exit_info: dict | None,
    context: dict | None = None,
    kernel_log: list[str] | None = None,
    timed_out: bool = False,
) -> Failure:
    """Name the cause of a failed start. `kernel_log`: lines to search for the OOM killer
    (None: read dmesg when the process was SIGKILLed and nobody here sent that signal)."""
    ctx = context or {}
    last = tail[-TAIL_LINES:]
    exit_text = describe_exit(exit_info)
    if exit_info and exit_info.get("signal") == "SIGKILL":
        lines = kernel_oom_lines() if kernel_log is None else kernel_log
        pids = {p for p in (exit_info.get("server_pid"), ctx.get("pid")) if p}
        line = _own_oom(lines, pids)
        if line:
            cause = next(c for c in CAUSES if c.code == "host_oom_killed")
            return Failure(
                cause=cause.code,
                title=cause.title,
                remedy=cause.remedy(ctx),
                evidence=line,
                exit=exit_text,
                log_tail=last,
            )
    for cause in CAUSES:
        for line in reversed(tail):
            m = cause.pattern.search(line)
            if m:
                remedy = cause.remedy(ctx)
                if cause.code == "engine_refused":
                    idx = tail.index(line)
                    what = [ln for ln in tail[idx:] if "what to do:" in ln]
                    if what:
                        remedy = what[0].split("what to do:", 1)[1].strip()
                return Failure(
                    cause=cause.code,
                    title=cause.title,
                    remedy=remedy,
                    evidence=line.strip()[-500:],
                    exit=exit_text,
                    log_tail=last,
                )
    if exit_info and exit_info.get("signal") == "SIGKILL":
        return Failure(
            cause="killed",
            title="the server was killed (SIGKILL) by something other than gpurig",
            remedy="the kernel's OOM killer is the usual suspect while weights load: check "
            "`sudo dmesg | grep -i 'killed process'`; if it is, " + _swap_remedy(ctx),
            exit=exit_text,
            log_tail=last,
        )
    if timed_out:
        return Failure(
            cause="not_ready_in_time",
            title="the server did not become ready in time",
            remedy="raise timeout_s (a first start compiles kernels and may download weights), "
            "and read the log tail: gpurig serve logs NAME",
            exit=exit_text,
            log_tail=last,
        )
    return Failure(
        cause="unknown",
        title="the server exited for a reason gpurig does not know",
        remedy="read the log tail below (gpurig serve logs NAME)",
        exit=exit_text,
        log_tail=last,
    )
