"""The serving tools: start_vllm_server, stop_vllm_server, server_status, get_server_logs,
query_model and spot_check. The MCP tools, the CLI (`gpurig serve ...`) and the sweeps call
these same functions.

A start refuses in seconds what would fail after minutes (preflight.py), then runs the server
detached under a supervisor (process.py) with a record on disk (state.py), and by default waits
for GET /health = 200 with the model listed in /v1/models. A server that dies or never gets
ready comes back with a named cause, its remedy and the log tail (failures.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from engine import serve_options
from tools.errors import InvalidInputError
from tools.host import MemoryReport
from tools.llamacpp import find_binary
from tools.serving import command as cmd
from tools.serving import flags as flagmod
from tools.serving import llamacpp_backend, observe, preflight, process, state
from tools.serving.control import (
    get_server_logs,
    query_model,
    server_status,
    spot_check,
    stop_vllm_server,
)
from tools.serving.models import ServerRecord
from tools.serving.observe import health, mark_dead, read_log_lines
from tools.serving.startup_facts import parse_startup_facts
from tools.settings import resolve_python

log = logging.getLogger("gpurig.serving")
Progress = Callable[[float, float | None, str], None]
POLL_S = 0.25


# ---------------------------------------------------------------------------------------------
# start


def _served_name(model: str, backend: str, local: str | None) -> str:
    if backend == "llamacpp" and local:
        return Path(local).stem  # its --alias: what /v1/models lists
    if backend == "engine" and local:
        p = Path(local)
        hub = p.parent.parent.name
        if p.parent.name == "snapshots" and hub.startswith("models--"):
            return hub.removeprefix("models--").replace("--", "/")
        return p.name
    return model


def _check_inputs(
    port: int,
    tp: int,
    pp: int,
    util: float,
    timeout_s: float,
    extra_args: list[str],
    env: dict[str, str],
) -> None:
    if tp < 1 or pp < 1:
        raise InvalidInputError(
            f"tensor_parallel_size {tp} and pipeline_parallel_size {pp} must be at least 1",
            remedy="pass 1 for one GPU",
        )
    if not 0 < util <= 1:
        raise InvalidInputError(
            f"gpu_memory_utilization {util} must be in (0, 1]", remedy="pass e.g. 0.9"
        )
    if timeout_s <= 0:
        raise InvalidInputError(
            f"timeout_s {timeout_s} must be positive",
            remedy="pass e.g. 900 (first starts compile kernels)",
        )
    if not all(isinstance(a, str) for a in extra_args):
        raise InvalidInputError("extra_args must be strings", remedy='e.g. ["--seed", "0"]')
    bad = [k for k in env if not k or "=" in k or "\x00" in k]
    if bad:
        raise InvalidInputError(
            f"bad environment variable names {bad}",
            remedy="pass names like HF_HOME or CUDA_VISIBLE_DEVICES",
        )


def _refuse_unknown(unknown: list[str], known: list[str], what: str, version: str) -> None:
    if not unknown:
        return
    fs = flagmod.FlagSet(version=version, source="help", flags=known)
    hints = [
        f"{u} (did you mean {flagmod.closest(u, fs)}?)" if flagmod.closest(u, fs) else u
        for u in unknown
    ]
    raise InvalidInputError(
        f"{what} does not accept {', '.join(hints)}",
        remedy="fix or remove them in extra_args; the accepted flags: "
        + (
            "`vllm serve --help=all`"
            if what.startswith("vLLM")
            else "`llama-server --help`"
            if what.startswith("llama-server")
            else "gpurig engine serve --help"
        ),
    )


def start_vllm_server(
    model: str,
    backend: Literal["vllm", "engine", "llamacpp"] = "vllm",
    name: str | None = None,
    python_bin: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    attention_backend: str | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 900,
    wait: bool = True,
    progress: Progress | None = None,
    device: str | None = None,
    cpu_kv_cache_gib: int | None = None,
    gpus: preflight.GpuFacts | None = None,
    memory: MemoryReport | None = None,
    server_bin: str | None = None,
    gpu_layers: int | None = None,
) -> ServerRecord:
    """Start a server detached and (by default) wait until it serves; see the module docstring.

    `device` is the engine's (cuda, cuda:1, cpu). `cpu_kv_cache_gib` is the KV cache of vLLM's
    CPU build (VLLM_CPU_KVCACHE_SPACE, whole GiB; default a quarter of free RAM, at most 8),
    checked against the RAM available. `gpus` and `memory` replace the measured GPU facts and
    host memory (tests replay recorded hosts with them). backend="llamacpp" serves a GGUF file
    with `server_bin` (llama-server: given, GPURIG_LLAMA_SERVER, gpurig's build or PATH);
    `gpu_layers` is its -ngl, max_num_seqs its slots (-np)."""
    extra_args = list(extra_args or [])
    env = {str(k): str(v) for k, v in (env or {}).items()}
    if backend not in ("vllm", "engine", "llamacpp"):
        raise InvalidInputError(
            f"backend {backend!r} is unknown", remedy="use vllm, engine or llamacpp"
        )
    if backend != "llamacpp" and (server_bin is not None or gpu_layers is not None):
        raise InvalidInputError(
            "server_bin and gpu_layers are llama.cpp's (backend='llamacpp')",
            remedy="leave them out for vllm and engine",
        )
    _check_inputs(
        port,
        tensor_parallel_size,
        pipeline_parallel_size,
        gpu_memory_utilization,
        timeout_s,
        extra_args,
        env,
    )
    name = state.check_name(name or f"{backend}-{port}")
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    local = preflight.check_model(model, backend)
    if backend == "llamacpp":
        local = llamacpp_backend.check_gguf(local, model)
    weights = preflight.weights_gib(local, model)
    vllm_version: str | None = None
    install: cmd.VllmInstall | None = None
    kv_gib: int | None = None
    with state.start_lock():
        preflight.check_running(state.read_record(name))
        preflight.check_port(host, port)
        if backend == "vllm":
            python = resolve_python(python_bin)
            install = cmd.find_vllm(python, full_env)
            vllm_version = install.version
            if install.is_cpu:  # vLLM built for the CPU: no GPU to check, RAM for its KV cache
                preflight.check_cpu_kernels(local, install.label, dtype=dtype)
                kv_gib = preflight.check_cpu_kv_cache(cpu_kv_cache_gib, env, weights, memory)
                env[preflight.CPU_KV_ENV] = full_env[preflight.CPU_KV_ENV] = str(kv_gib)
            else:
                if cpu_kv_cache_gib is not None:
                    raise InvalidInputError(
                        f"cpu_kv_cache_gib is for vLLM's CPU build; {install.label} sizes its "
                        "KV cache from GPU memory",
                        remedy="leave it out and use gpu_memory_utilization (or max_model_len)",
                    )
                gpus = gpus or preflight.measure_gpus()
                preflight.check_gpus(gpus, full_env, tensor_parallel_size, pipeline_parallel_size)
                cap = gpus.min_capability
                if cap is not None and cap[0] < 8:
                    from tools.turing import require_turing_patch

                    require_turing_patch(python, cap)
                    if dtype == "auto":
                        dtype = "float16"  # sm_75 has no bf16; vLLM would refuse the dtype
            preflight.check_memory(weights, memory)
            command, ours = cmd.vllm_command(
                install,
                local or model,
                host,
                port,
                dtype,
                kv_cache_dtype,
                tensor_parallel_size,
                pipeline_parallel_size,
                gpu_memory_utilization,
                max_model_len,
                max_num_seqs,
                attention_backend,
                extra_args,
            )
            accepted = flagmod.accepted_flags(
                install.version, cmd.vllm_launcher(install), Path(install.package_dir), full_env
            )
            tool_flags = flagmod.tool_call_flags(
                model, local, extra_args, accepted, Path(install.package_dir)
            )  # tools in, tool_calls out (bench/eval's BFCL)
            command, ours = command + tool_flags, ours + tool_flags
            _refuse_unknown(
                flagmod.unknown_flags(ours + extra_args, accepted),
                accepted.flags,
                f"vLLM {install.version}",
                install.version,
            )
        elif backend == "llamacpp":
            binary = str(find_binary("llama-server", server_bin))
            python = binary
            preflight.check_memory(weights, memory)
            command, ours = llamacpp_backend.llama_server_command(
                binary,
                str(local),
                _served_name(model, backend, local),
                host,
                port,
                max_model_len,
                max_num_seqs,
                gpu_layers,
                extra_args,
            )
            known = llamacpp_backend.accepted_flags(binary)
            _refuse_unknown(
                llamacpp_backend.unknown_flags(ours + extra_args, known),
                known,
                "llama-server",
                "llama.cpp",
            )
        else:
            python = resolve_python(python_bin) if python_bin else cmd.engine_python()
            known = serve_options.flags()
            unknown = [
                a for a in extra_args if flagmod.normalize(a) and a.split("=")[0] not in known
            ]
            _refuse_unknown(unknown, sorted(known), "gpurig engine serve", "engine")
            command = cmd.engine_command(
                python, local or model, host, port, max_model_len, device, extra_args
            )
        log = state.log_path(name)
        if log.exists():  # keep the previous run's log next to it, start a fresh one
            log.replace(log.with_suffix(".log.1"))
        exit_file = state.exit_path(name)
        pid, created = process.spawn(command, full_env, log, exit_file, cwd=os.getcwd())
        where = process.connect_host(host)
        record = ServerRecord(
            name=name,
            backend=backend,
            pid=pid,
            pid_create_time=created,
            port=port,
            host=host,
            base_url=f"http://{'[' + where + ']' if ':' in where else where}:{port}/v1",
            model=model,
            served_model_name=_served_name(model, backend, local),
            state="starting",
            log_path=str(log),
            exit_path=str(exit_file),
            command=_masked_command(command),
            env=_masked_env(env),
            python=python,
            vllm_version=vllm_version,
            vllm_distribution=install.distribution if install else None,
            vllm_build=install.build if install else None,
            vllm_label=install.label if install else None,
            cpu_kv_cache_gib=kv_gib,
            started_at=state.now_iso(),
        )
        state.write_record(record)
    if not wait:
        return record
    return wait_ready(
        record,
        timeout_s,
        progress,
        weights=weights,
        context={
            "gpu_memory_utilization": gpu_memory_utilization,
            "python": python,
            "cpu_kv_cache_gib": kv_gib,
        },
    )


_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_SECRET_FLAGS = {"--api-key", "--hf-token", "--ssl-keyfile-password"}


def _masked_env(env: dict[str, str]) -> dict[str, str]:
    """The record is a file others may read: HF_TOKEN and the like are kept out of it."""
    return {k: "***" if any(w in k.upper() for w in _SECRET_WORDS) else v for k, v in env.items()}


def _masked_command(command: list[str]) -> list[str]:
    out: list[str] = []
    for i, arg in enumerate(command):
        name, eq, _value = arg.partition("=")
        if eq and name in _SECRET_FLAGS:
            out.append(f"{name}=***")
        elif i > 0 and command[i - 1] in _SECRET_FLAGS:
            out.append("***")
        else:
            out.append(arg)
    return out


def _report(progress: Progress | None, done: float, total: float, message: str) -> None:
    """Progress is a courtesy: a client that went away must not abort a start half-way (the
    server would run on with a record that says starting)."""
    if progress is None:
        return
    try:
        progress(done, total, message)
    except Exception:  # noqa: BLE001 - any failure of the callback is the caller's, not ours
        log.debug("progress callback failed", exc_info=True)


def wait_ready(
    record: ServerRecord,
    timeout_s: float,
    progress: Progress | None = None,
    weights: float | None = None,
    context: dict | None = None,
) -> ServerRecord:
    """Poll until /health is 200 and the model is listed; a dead process or the deadline ends
    the wait with a diagnosis (a server that never got ready is stopped: it holds the GPU)."""
    t0 = time.monotonic()
    last_line = ""
    while True:
        elapsed = time.monotonic() - t0
        record.server_pid = record.server_pid or process.server_child(record.pid)
        if not process.is_ours(record.pid, record.pid_create_time):
            time.sleep(0.1)  # the supervisor writes the exit file just before it ends
            return mark_dead(record, weights=weights, context=context)
        answer, _detail, ids = health(record, timeout=1.0)
        # what answers must be ours: another process may have taken the port since it was
        # found free (then ours fails to bind and dies, and the wait reports that)
        if answer == "ok" and ids and process.listens_on(record.pid, record.port) is not False:
            if record.served_model_name not in ids and len(ids) == 1:
                record.served_model_name = ids[0]
            if record.served_model_name in ids:
                if record.backend == "vllm":
                    left = max(10.0, timeout_s - elapsed)
                    _report(progress, round(elapsed, 1), timeout_s, "first request (1 token)")
                    ok, detail, took = observe.first_request(record, min(120.0, left))
                    if not ok:
                        return _failed_first_request(record, detail, weights, context)
                    record.startup_facts.first_request_seconds = took
                record.state = "ready"
                record.ready_at = state.now_iso()
                record.ready_seconds = round(observe.elapsed(record), 2)
                first = record.startup_facts.first_request_seconds
                record.startup_facts = parse_startup_facts(read_log_lines(record.log_path))
                record.startup_facts.first_request_seconds = first
                if record.backend == "llamacpp":  # its log gives no load time: start to ready
                    record.startup_facts.load_seconds = record.ready_seconds
                state.write_record(record)
                _report(progress, round(time.monotonic() - t0, 1), timeout_s, "ready")
                return record
        if elapsed >= timeout_s:
            process.stop_group(record.pid, record.pid_create_time, 10)
            record = mark_dead(record, timed_out=True, weights=weights, context=context)
            if record.failure is not None and record.failure.cause != "not_ready_in_time":
                record.failure.title += f" (and it was not ready after {timeout_s:g} s)"
            return record
        lines = read_log_lines(record.log_path, 8192)
        last_line = lines[-1][-200:] if lines else last_line
        _report(progress, round(elapsed, 1), timeout_s, last_line or "starting")
        time.sleep(POLL_S)


def _failed_first_request(
    record: ServerRecord, detail: str, weights: float | None, context: dict | None
) -> ServerRecord:
    """/health said 200 but the first request failed: the engine is dead (or never worked), so
    the server is stopped (it holds RAM or a GPU) and written off with the cause from its log."""
    time.sleep(1.0)  # the engine core's traceback reaches the log just after the 500
    process.stop_group(record.pid, record.pid_create_time, 15)
    record = mark_dead(record, weights=weights, context={**(context or {}), "first": detail})
    failure = record.failure
    if failure is not None:
        if failure.cause in ("unknown", "killed"):
            failure.cause = "first_request_failed"
            failure.title = "the server said it was healthy but could not answer a request"
            failure.remedy = "read the log tail (gpurig serve logs NAME --grep Error)"
        failure.title += f" (after /health 200: {detail})"
        state.write_record(record)
    return record


__all__ = [
    "get_server_logs",
    "query_model",
    "server_status",
    "spot_check",
    "start_vllm_server",
    "stop_vllm_server",
]
