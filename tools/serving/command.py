"""Command lines for the two backends, built for what is installed.

vLLM: `<python> -m vllm.entrypoints.cli.main serve MODEL ...` (what the `vllm` console script
runs, but under exactly the serving interpreter, wherever pip put the script), or, for a vLLM
without the CLI module, the deprecated `-m vllm.entrypoints.openai.api_server --model MODEL`.
The engine: `<python> -m mcp_server.cli engine serve --model DIR ...` under the interpreter
gpurig runs under (the `gpurig` script is not always on PATH; the module always imports).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, Field

from tools.errors import InvalidInputError, NotFoundError

CLI_MAIN = "vllm/entrypoints/cli/main.py"
API_SERVER = "vllm/entrypoints/openai/api_server.py"

# Runs under the serving interpreter: stdlib only; finds vLLM without importing it.
_VLLM_PROBE = r"""
import json, sys
from importlib import metadata
out = {"executable": sys.executable, "found": False}
try:
    dist = metadata.distribution("vllm")
except metadata.PackageNotFoundError:
    print(json.dumps(out)); sys.exit(0)
files = {f.as_posix() for f in (dist.files or [])}
out.update(found=True, version=dist.version, root=str(dist.locate_file("")),
           cli_main="CLI_MAIN" in files, api_server="API_SERVER" in files)
print(json.dumps(out))
""".replace("CLI_MAIN", CLI_MAIN).replace("API_SERVER", API_SERVER)


class VllmInstall(BaseModel):
    python: str
    version: str
    package_dir: str = Field(description="the vllm package folder")
    cli_main: bool = Field(description="has vllm/entrypoints/cli/main.py (`vllm serve`)")
    api_server: bool


def find_vllm(python: str, env: dict[str, str]) -> VllmInstall:
    """Ask the serving interpreter (with the server's environment, e.g. PYTHONUSERBASE) for vLLM."""
    try:
        proc = subprocess.run(
            [python, "-c", _VLLM_PROBE],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd="/",
            check=False,
        )
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        raise InvalidInputError(
            f"cannot ask {python} about vLLM: {exc}",
            remedy="point python_bin / --python / GPURIG_PYTHON at a working Python",
        ) from exc
    if not answer.get("found"):
        raise NotFoundError(
            f"vLLM is not installed for {answer.get('executable', python)}",
            remedy=f"install it there: {python} -m pip install vllm (see `gpurig doctor`), or "
            "pass python_bin (--python) / set GPURIG_PYTHON to the interpreter that has it; "
            "or serve with backend='engine'",
        )
    return VllmInstall(
        python=python,
        version=answer["version"],
        package_dir=str(Path(answer["root"]) / "vllm"),
        cli_main=bool(answer.get("cli_main")),
        api_server=bool(answer.get("api_server")),
    )


def vllm_launcher(install: VllmInstall) -> list[str]:
    """The argv prefix that runs `vllm serve` (the model follows it)."""
    if install.cli_main:
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
    the api_server module needs `--model` (0.29+ warn without it)."""
    launcher = vllm_launcher(install)
    model_part = [model] if install.cli_main else ["--model", model]
    flags = ["--host", host, "--port", str(port), "--dtype", dtype]
    flags += ["--kv-cache-dtype", kv_cache_dtype]
    flags += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if pipeline_parallel_size != 1:
        flags += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
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
    cmd = [python, "-m", "mcp_server.cli", "engine", "serve", "--model", model]
    cmd += ["--host", host, "--port", str(port)]
    if max_model_len is not None:
        cmd += ["--max-ctx", str(max_model_len)]
    if device:
        cmd += ["--device", device]
    return [*cmd, *extra_args]
