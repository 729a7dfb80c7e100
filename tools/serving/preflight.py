"""The refusals a start makes in seconds, before vLLM spends minutes loading and then dies.

Each raises a GpurigError whose remedy is the command that fixes it. The GPU facts and the host
memory are parameters (measured by default), so tests replay recorded probe results: a T4, an
H200, a host with no GPU, the seeds' 7.8 GB host.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pydantic import BaseModel, Field

from tools.errors import InvalidInputError, NotFoundError, RefusedError
from tools.host import (
    GIB,
    Facts,
    MemoryReport,
    group_filesystems,
    measure_memory,
    measure_path,
    rule_memory_staging,
)
from tools.serving import process
from tools.serving.models import ServerRecord

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class GpuDevice(BaseModel):
    index: int
    name: str | None = None
    capability: tuple[int, int] | None = None
    memory_total_bytes: int | None = None


class GpuFacts(BaseModel):
    """The GPUs a server would see: from NVML (no torch import), or injected by a caller."""

    source: str = Field(description="nvml, or where injected facts came from")
    devices: list[GpuDevice] = Field(default_factory=list)
    error: str | None = Field(None, description="why no GPU was found")

    @property
    def min_capability(self) -> tuple[int, int] | None:
        caps = [d.capability for d in self.devices if d.capability]
        return min(caps) if caps else None


def measure_gpus() -> GpuFacts:
    from tools.gpu_nvml import read_nvml

    nvml = read_nvml()
    if not nvml.available:
        return GpuFacts(source="nvml", error=nvml.error or "NVML is not available")
    return GpuFacts(
        source="nvml",
        devices=[
            GpuDevice(
                index=g.index,
                name=g.name,
                capability=g.capability,
                memory_total_bytes=g.memory_total_bytes,
            )
            for g in nvml.gpus
        ],
    )


def visible_gpus(gpus: GpuFacts, env: dict[str, str]) -> list[GpuDevice]:
    """The devices CUDA_VISIBLE_DEVICES (of the server's environment) leaves visible."""
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return list(gpus.devices)
    picked: list[GpuDevice] = []
    for part in [p.strip() for p in mask.split(",") if p.strip()]:
        if not part.isdigit():  # a UUID or MIG id: trust it names one device
            picked.append(GpuDevice(index=-1, name=part))
            continue
        match = [d for d in gpus.devices if d.index == int(part)]
        if not match:
            break  # CUDA stops at the first invalid index
        picked.append(match[0])
    return picked


def is_local_path(model: str) -> bool:
    """A hub id (`org/name`) is passed on; anything path-like must exist here."""
    if os.path.exists(os.path.expanduser(model)):
        return True
    if model.startswith(("/", "./", "../", "~", ".")):
        return True
    return not HUB_ID.match(model)


def check_model(model: str, backend: str) -> str | None:
    """The model's absolute path when local (None for a hub id); refuses a missing path."""
    if not model or not model.strip():
        raise InvalidInputError(
            "no model given",
            remedy="pass a checkpoint directory or a Hugging Face id such as google/gemma-4-E2B-it",
        )
    if backend == "engine" or is_local_path(model):
        path = Path(os.path.expanduser(model)).absolute()
        if not path.exists():
            raise NotFoundError(
                f"the model path {path} does not exist",
                remedy="pass an existing GGUF file (make one: gpurig engine export-gguf DIR "
                "--out model.gguf)"
                if backend == "llamacpp"
                else "pass an existing checkpoint directory"
                + (
                    ", e.g. make one: gpurig engine make-checkpoint --preset tiny --out DIR"
                    if backend == "engine"
                    else ", or a Hugging Face id (org/name, e.g. google/gemma-4-E2B-it)"
                ),
            )
        if backend == "engine" and not path.is_dir():
            raise InvalidInputError(
                f"{path} is not a directory", remedy="the engine serves a checkpoint directory"
            )
        return str(path)
    return None


def hub_snapshot(model: str) -> Path | None:
    """The newest cached snapshot of hub id `model` (HF_HUB_CACHE / HF_HOME aware), if any."""
    from tools.settings import hf_cache_dir

    if not HUB_ID.match(model):
        return None
    snapshots = hf_cache_dir() / ("models--" + model.replace("/", "--")) / "snapshots"
    try:
        found = [p for p in snapshots.iterdir() if any(p.glob("*.safetensors"))]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def weights_gib(model_path: str | None, model: str | None = None) -> float | None:
    """The weights' size from the safetensors files' sizes: of a local path, else of a hub id's
    cached snapshot (None when it is not downloaded yet: nothing to measure)."""
    if model_path is None:
        snapshot = hub_snapshot(model) if model else None
        if snapshot is None:
            return None
        model_path = str(snapshot)
    path = Path(model_path)
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files if f.suffix in (".safetensors", ".gguf"))
    return round(total / GIB, 2) if total else None


def check_running(existing: ServerRecord | None) -> None:
    if existing and process.is_ours(existing.pid, existing.pid_create_time):
        raise RefusedError(
            f"a server named {existing.name!r} is still running (pid {existing.pid}, port "
            f"{existing.port}, model {existing.model})",
            remedy=f"stop it first: gpurig serve stop {existing.name} (MCP: stop_vllm_server), "
            "or pass another name",
        )


def check_port(host: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise InvalidInputError(f"port {port} is out of range", remedy="use a port 1-65535")
    if not process.port_free(host, port):
        other = process.free_port_near(host, port)
        raise RefusedError(
            f"port {port} on {host} is taken",
            remedy=(f"use a free port, e.g. port={other} (--port {other}), " if other else "")
            + f"or stop what listens there (gpurig serve status; ss -ltnp 'sport = :{port}')",
        )


def check_gpus(gpus: GpuFacts, env: dict[str, str], tp: int, pp: int) -> list[GpuDevice]:
    """vLLM needs a GPU; tp x pp GPUs must be visible (that is how a model grows past one)."""
    visible = visible_gpus(gpus, env)
    if not visible:
        why = gpus.error or (
            "CUDA_VISIBLE_DEVICES hides every GPU"
            if "CUDA_VISIBLE_DEVICES" in env
            else "no GPU found"
        )
        raise RefusedError(
            f"no GPU: vLLM cannot serve here ({why})",
            remedy="run gpurig doctor (MCP: doctor) to see why; on a host without a GPU serve "
            "with backend='engine' (--backend engine)",
        )
    need = tp * pp
    if need > len(visible):
        raise RefusedError(
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {need} GPUs, but "
            f"{len(visible)} {'is' if len(visible) == 1 else 'are'} visible",
            remedy=f"use at most {len(visible)} GPUs in total (e.g. tensor_parallel_size="
            f"{len(visible)}, pipeline_parallel_size=1), or make more visible "
            "(CUDA_VISIBLE_DEVICES)",
        )
    return visible


def check_memory(weights: float | None, memory: MemoryReport | None = None) -> None:
    """RAM + swap must stage the weights (check_host_capacity's rule, with its swapfile)."""
    if weights is None:
        return
    memory = memory or measure_memory()
    reports = [measure_path("/"), measure_path("/tmp")]
    facts = Facts(
        paths=reports, filesystems=group_filesystems(reports), memory=memory, need_gib=weights
    )
    advice = rule_memory_staging(facts)
    if advice.status == "fail":
        raise RefusedError(
            advice.reason,
            remedy=("; ".join(advice.commands) if advice.commands else "add RAM or swap")
            + " (then check: gpurig host --need-gib "
            + f"{weights:g})",
        )


CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"


def default_cpu_kv_cache_gib(memory: MemoryReport) -> int:
    """A quarter of the RAM available now, 1 to 8 GiB: room for the weights and the rest."""
    return max(1, min(8, int(memory.ram_available_bytes / GIB / 4)))


def check_cpu_kv_cache(
    requested: int | None,
    env: dict[str, str],
    weights: float | None,
    memory: MemoryReport | None = None,
) -> int:
    """The KV cache of vLLM's CPU build, in whole GiB (it reads VLLM_CPU_KVCACHE_SPACE with
    int()): `requested`, else the caller's VLLM_CPU_KVCACHE_SPACE, else a quarter of free RAM.
    Refused when it and the weights do not fit in the RAM available now: vLLM would warm up for
    a minute and then fail allocating it."""
    source = "cpu_kv_cache_gib"
    value: object = requested
    if value is None and env.get(CPU_KV_ENV, "").strip():
        source, value = f"env {CPU_KV_ENV}", env[CPU_KV_ENV].strip()
    memory = memory or measure_memory()
    if value is None:
        return _fits(default_cpu_kv_cache_gib(memory), weights, memory, "the default")
    try:
        gib = int(str(value))
    except ValueError:
        gib = 0
    if gib < 1 or isinstance(value, bool):
        raise InvalidInputError(
            f"{source} {value!r} must be a whole number of GiB, at least 1 (vLLM's CPU build "
            f"reads {CPU_KV_ENV} with int())",
            remedy=f"pass e.g. cpu_kv_cache_gib={default_cpu_kv_cache_gib(memory)} "
            f"(--cpu-kv-cache-gib {default_cpu_kv_cache_gib(memory)})",
        )
    return _fits(gib, weights, memory, source)


def _fits(gib: int, weights: float | None, memory: MemoryReport, source: str) -> int:
    available = memory.ram_available_bytes / GIB
    need = gib + (weights or 0.0)
    if need > available:
        fit = min(int(available - (weights or 0.0) - 0.5), default_cpu_kv_cache_gib(memory))
        raise RefusedError(
            f"the CPU build's KV cache of {gib} GiB ({source})"
            + (f" and the {weights:g} GiB of weights do" if weights else " does")
            + f" not fit in the {available:.1f} GiB of RAM available now",
            remedy=(
                f"pass a smaller cpu_kv_cache_gib, e.g. {fit} (--cpu-kv-cache-gib {fit}), "
                if fit >= 1
                else ""
            )
            + "or free RAM (gpurig host shows it)",
        )
    return gib


def _cpu_flags(cpuinfo: str | None) -> list[str] | None:
    """The first `flags` line of /proc/cpuinfo (or of `cpuinfo`); None where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    return next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                 if ln.startswith("flags")), None)  # fmt: skip


def cpu_has_avx512(cpuinfo: str | None = None) -> bool | None:
    """Whether this x86 CPU has AVX-512 (F, BW, VL: what vLLM's CPU build asks torch before it
    loads its AVX-512 kernels rather than the AVX2 ones). None: unknown (not Linux, not x86)."""
    flags = _cpu_flags(cpuinfo)
    if flags is None or "avx2" not in flags and "avx" not in flags:
        return None
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl"))


def is_w4a16(model_path: str | None) -> bool:
    """A compressed-tensors checkpoint with 4-bit integer weights (W4A16, pack-quantized)."""
    if model_path is None:
        return False
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "compressed-tensors":
        return False
    groups = (quant.get("config_groups") or {}).values()
    return any(
        (g.get("weights") or {}).get("num_bits") == 4 and not g.get("input_activations")
        for g in groups
        if isinstance(g, dict)
    )


def cpu_has_avx512_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU also has AVX-512 BF16 (then vLLM's CPU build loads `vllm/_C`, else
    `_C_AVX512`). None: unknown."""
    flags = _cpu_flags(cpuinfo)
    return None if flags is None else "avx512_bf16" in flags


def _checkpoint_dtype(model_path: str) -> str | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def check_cpu_kernels(
    model_path: str | None,
    label: str,
    avx512: bool | None = None,
    dtype: str = "auto",
    avx512_bf16: bool | None = None,
) -> None:
    """What vLLM's CPU build cannot run on this CPU, refused in a second instead of dying in
    the engine core (both seen on AMD EPYCs):
    - without AVX-512 it loads its AVX2 kernels (vllm/_C_AVX2), which have no cpu_gemm_wna16:
      a W4A16 checkpoint loads, then dies in its warm-up with `'_C' object has no attribute
      'cpu_gemm_wna16'`;
    - with AVX-512 BF16 it loads vllm/_C, whose cpu_gemm_wna16 has no float32 path: a W4A16
      checkpoint served in float32 starts, then the first request kills the engine core with
      `"cpu_gemm_wna16" not implemented for 'Float'`.
    dtype: the --dtype asked for ("auto": the checkpoint's own)."""
    if not is_w4a16(model_path):
        return
    avx512 = cpu_has_avx512() if avx512 is None else avx512
    if avx512 is False:
        raise RefusedError(
            f"{label} cannot run this W4A16 checkpoint on this CPU: without AVX-512 it loads its "
            "AVX2 kernels, which have no cpu_gemm_wna16 (the start would die in its warm-up with "
            "`'_C' object has no attribute 'cpu_gemm_wna16'`)",
            remedy="serve a 16-bit checkpoint (e.g. gpurig engine make-checkpoint --unquantized), "
            "or this one with gpurig's engine (backend='engine', --backend engine), or on a host "
            "whose CPU has AVX-512 (grep avx512f /proc/cpuinfo)",
        )
    effective = _checkpoint_dtype(model_path) if dtype == "auto" else dtype
    if avx512 and effective in ("float32", "float"):
        bf16 = cpu_has_avx512_bf16() if avx512_bf16 is None else avx512_bf16
        if bf16:
            raise RefusedError(
                f"{label} cannot run this W4A16 checkpoint in float32 on this CPU: with "
                "AVX-512 BF16 it loads its vllm/_C kernels, whose cpu_gemm_wna16 has no float32 "
                'path (the first request would kill the engine core with `"cpu_gemm_wna16" '
                "not implemented for 'Float'`)",
                remedy="serve a 16-bit checkpoint in float32 (gpurig engine make-checkpoint "
                "--unquantized), or this one with gpurig's engine (--backend engine); in "
                "bfloat16 (--dtype bfloat16) the tiny W4A16 checkpoint also died at its first "
                "request on an AMD EPYC with AVX-512 BF16 (the start's first-request check "
                "reports it)",
            )
