"""Every GPURIG_* environment variable gpurig reads, read here and nowhere else.

Why one module: the variables used to be read by a dozen modules across engine/, tools/, bench/
and mcp_server/, so nobody could list what changes gpurig's behaviour without grepping, and a
switch could outlive the code it steered. Here each variable is declared once with its meaning,
and `read` refuses a name that is not declared (tests/test_settings_env.py checks that no other
product module reads os.environ for a GPURIG_* name). It lives in engine/ because the engine
imports none of the other packages, while they may all import the engine's light modules.

The engine's own switches are read by `engine.options.EngineOptions.from_env`, through `read`.
Variables that name an interpreter or a directory are turned into checked values by the module
that owns them (tools/settings.py, tools/llamacpp.py, bench/eval/suites/bfcl.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# name -> what it sets (default). The engine's switches: engine/options.py's table.
VARIABLES: dict[str, str] = {
    "GPURIG_PYTHON": "the serving interpreter (the Python that runs vLLM); empty counts as unset "
    "(default: the current interpreter)",
    "GPURIG_HOME": "state directory: backups, logs, server records, sweeps, evals "
    "(default: $XDG_STATE_HOME/gpurig, else ~/.local/state/gpurig)",
    "GPURIG_LLAMA_CPP_DIR": "gpurig's llama.cpp build, from .ci/llama-cpp-build "
    "(default: ~/.cache/gpurig/llama-cpp-0.3.36)",
    "GPURIG_LLAMA_SERVER": "the llama-server binary to run (default: the build's, else PATH)",
    "GPURIG_BFCL_CACHE": "where the BFCL eval data is unpacked (default: ~/.cache/gpurig/bfcl)",
    "GPURIG_ENGINE_API_KEY": "the key `gpurig engine serve` asks of /v1 clients; --api-key wins "
    "(default: none)",
    "GPURIG_ENGINE_PROCESS": "`gpurig engine serve`: run the engine in a process of its own "
    "(on, off, auto; default auto: on for a CUDA device)",
    "GPURIG_FIRST_REQUESTS": "0: the engine server skips serving its first requests at start-up "
    "(default on)",
    "GPURIG_GC_FREEZE": "0: the engine server leaves the garbage collector as it is after load "
    "(default: freeze what load made, engine/server/gc_watch.py)",
    "GPURIG_TEST_WHEELS": "tests only: cache of the vLLM wheels the Turing-patch network tests "
    "download (default: ~/.cache/gpurig-tests/vllm-wheels)",
    # the engine's switches (engine/options.py)
    "GPURIG_FAST": "0: reference ops, no graphs; force: the Triton path on any device (CPU "
    "interpreter) (default on)",
    "GPURIG_CUDA_GRAPH": "0: fused kernels, decoded without a CUDA graph (default on)",
    "GPURIG_PASS_GRAPHS": "0: prompt passes launched op by op, not replayed as CUDA graphs "
    "(default on)",
    "GPURIG_ASYNC_PROMPTS": "0: prompt passes on the decode steps' stream (default on)",
    "GPURIG_PDL": "0: kernels launch after the one before ends, not during its tail (default on)",
    "GPURIG_KERNEL_AUTOTUNE": "0: GEMV tile configs from the shipped tables, no timing (default on)",
    "GPURIG_KERNEL_CACHE": "directory of the per-GPU tile-config files "
    "(default: ~/.cache/gpurig/kernels)",
    "GPURIG_COMPILE_THREADS": "threads compiling kernels at warm-up; 1 serial "
    "(default: the cores, at most 32)",
}


def read(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, None where unset. `env` stands in for os.environ (tests, and a
    child's environment being prepared). An undeclared name is a bug, not a user error."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared gpurig variable (engine/env.py VARIABLES)")
    return (os.environ if env is None else env).get(name)


def omp_threads(env: Mapping[str, str] | None = None) -> int | None:
    """OMP_NUM_THREADS when it holds a positive count: not gpurig's variable but OpenMP's, the
    usual way to pin torch's CPU threads, which the engine commands respect (engine/threads.py);
    read here with the others so the engine reads its environment in one module."""
    text = ((os.environ if env is None else env).get("OMP_NUM_THREADS") or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def flag(name: str, default: bool = True, env: Mapping[str, str] | None = None) -> bool:
    """An on/off variable: "0" is off, any other value on, unset the default."""
    value = read(name, env)
    if value is None:
        return default
    return value.strip() != "0"
