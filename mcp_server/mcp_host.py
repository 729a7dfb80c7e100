"""MCP tools for the host and its GPU: thin wrappers around tools/host.py, gpu.py, doctor.py.

A GpurigError raised by a tool reaches the caller as its message and remedy, in MCP's words:
mcp_base.GpurigMCP does that for every tool, so the wrappers here only call and return.
"""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

from mcp_server.annotations import READ_ONLY
from mcp_server.mcp_errors import tool_error as tool_error  # older modules import it from here
from tools import doctor as doctor_mod
from tools import gpu, host
from tools.doctor import DoctorReport
from tools.gpu import GpuArchReport
from tools.host import HostCapacity

NeedGib = Annotated[
    float | None,
    Field(
        gt=0,
        le=100_000,
        description="GiB of weights to download and stage; default: Gemma 4 E2B bf16 (10 GiB)",
    ),
]
PythonBin = Annotated[
    str | None,
    Field(
        min_length=1,
        description="the interpreter that runs vLLM; default: GPURIG_PYTHON, else the server's",
    ),
]


def register(mcp: MCPServer) -> None:
    @mcp.tool(title="Check host capacity", annotations=READ_ONLY)
    def check_host_capacity(
        paths: Annotated[
            list[str] | None,
            Field(
                description="paths to measure; default: /, /tmp, ~/.cache and the Hugging Face "
                "cache. A path that does not exist yet is measured at its nearest existing parent"
            ),
        ] = None,
        need_gib: NeedGib = None,
    ) -> HostCapacity:
        """Measure this host's disks, memory, CPUs and GPU count, and say what to fix first.

        Each path is measured on the filesystem that really holds it (symlinks followed, e.g.
        ~/.cache -> /opt1/cache); `filesystems` groups paths that share free space. `advice`
        lists every rule with status ok/warn/fail, the reason and the exact shell commands:
        a swapfile when RAM + swap cannot stage the weights (vLLM is OOM-killed while loading
        otherwise), a path with less free space than need_gib, /tmp on its own small
        filesystem. Read-only and fast (well under a second). Call it before downloading a
        checkpoint or starting vLLM.
        """
        return host.check_host_capacity(paths=paths, need_gib=need_gib)

    @mcp.tool(title="Verify the GPU can serve", annotations=READ_ONLY)
    def verify_gpu_arch(
        python_bin: PythonBin = None,
        timeout_s: Annotated[
            float, Field(gt=0, le=600, description="limit for the probe, including import vllm")
        ] = gpu.DEFAULT_TIMEOUT_S,
    ) -> GpuArchReport:
        """Check that the serving Python's torch (and vLLM) can run on this machine's GPU.

        Runs a probe under `python_bin` (torch version and CUDA build, arch list, device,
        capability, memory, shared memory per block, an fp16 matmul checked against the CPU,
        triton and vLLM versions, whether `import vllm` works) and reads the driver through
        NVML (driver and CUDA version, power limit, SM clocks, throttle reasons).
        `diagnoses` names each problem with its remedy: no GPU visible, a CPU torch under a
        CUDA vLLM, the GPU's capability missing from torch's arch list, libcudnn.so.9 missing
        (torch installed with --no-deps), vLLM failing on libcudart, and on Turing (7.x) the
        need for --dtype float16 and the Turing patch (apply_turing_patch). `verdict` is
        ok/warn/fail; `serve_flags` lists vLLM flags this GPU needs. Takes a few seconds.
        """
        return gpu.verify_gpu_arch(python_bin=python_bin, timeout_s=timeout_s)

    @mcp.tool(title="Doctor: readiness report", annotations=READ_ONLY)
    def doctor(python_bin: PythonBin = None, need_gib: NeedGib = None) -> DoctorReport:
        """The readiness report for serving an LLM on this host: start here.

        Runs every read-only check (host memory for staging the weights, disk space, /tmp,
        the NVIDIA driver, the GPU, torch, vLLM, ...) and returns one list: each check has a
        status (ok, warn, fail, skip), what was found and what to do. `status` is the worst
        of them. For details, call check_host_capacity or verify_gpu_arch. Takes a few seconds.
        """
        return doctor_mod.doctor(python_bin=python_bin, need_gib=need_gib)
