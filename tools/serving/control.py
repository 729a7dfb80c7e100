"""status, stop, logs, query and spot_check on recorded servers (by name, or the only one running).

Every action re-reads the record from disk, so it works from a CLI or an MCP server other than
the one that started the server.
"""

from __future__ import annotations

import time

from tools.errors import InvalidInputError, NotFoundError
from tools.serving import process, state
from tools.serving.failures import describe_exit
from tools.serving.models import (
    GpuMemory,
    LogsResult,
    QueryResult,
    ServerRecord,
    ServerStatus,
    SpotCheckResult,
    StatusReport,
    StopResult,
)
from tools.serving.observe import TAIL_BYTES, elapsed, health, mark_dead, read_log_lines
from tools.serving.query import BUILTIN_CHECKS, chat, normalize_base_url, run_checks

# ---------------------------------------------------------------------------------------------
# status, stop, logs


def _live(record: ServerRecord) -> bool:
    return process.is_ours(record.pid, record.pid_create_time)


def refresh(record: ServerRecord, check_health: bool = True) -> ServerStatus:
    """The record as it is now: a live process is starting or ready; a gone one is dead (with a
    diagnosis, written back) unless it was stopped."""
    status = ServerStatus(**record.model_dump())
    if _live(record):
        status.uptime_s = round(elapsed(record), 1)
        status.server_pid = record.server_pid or process.server_child(record.pid)
        if check_health:
            status.health, status.health_detail, ids = health(record)
            ready = status.health == "ok" and record.served_model_name in ids
            new_state = "ready" if ready else "starting" if record.state != "ready" else "ready"
            if record.state == "ready" and status.health != "ok":
                status.health_detail = (status.health_detail or "") + " (was ready)"
            status.state = new_state
        return status
    if record.state in ("starting", "ready"):
        record = mark_dead(record)
        status = ServerStatus(**record.model_dump())
    exit_info = state.read_exit(record)
    status.ended = describe_exit(exit_info) or (
        "stopped by gpurig" if record.state == "stopped" else "ended (no exit status recorded)"
    )
    return status


def _names(records: list[ServerRecord]) -> str:
    return ", ".join(f"{r.name} ({r.state}, port {r.port})" for r in records) or "none"


def _pick(name: str | None, action: str) -> ServerRecord:
    if name is not None:
        record = state.read_record(state.check_name(name))
        if record is None:
            raise NotFoundError(
                f"no server named {name!r}", remedy=f"known servers: {_names(state.list_records())}"
            )
        return record
    records = state.list_records()
    live = [r for r in records if _live(r)]
    if len(live) == 1:
        return live[0]
    if len(live) > 1:
        raise InvalidInputError(
            f"{len(live)} servers are running: {_names(live)}",
            remedy=f"name the one to {action}, e.g. gpurig serve {action} {live[0].name}",
        )
    if action == "logs" and records:
        return records[-1]  # the most recent, for logs of a dead one
    raise NotFoundError(
        "no server is running",
        remedy="start one: gpurig serve start MODEL (MCP: start_vllm_server)",
    )


def server_status(name: str | None = None) -> StatusReport:
    """Every recorded server (or `name`) with state, uptime, health and start-up facts."""
    records = [_pick(name, "status")] if name else state.list_records()
    return StatusReport(
        servers=[refresh(r) for r in records], state_dir=str(state.servers_dir(create=False))
    )


def _gpu_memory() -> list[GpuMemory]:
    from tools.gpu_nvml import nvml_gpu_count, read_nvml

    if not nvml_gpu_count(timeout_s=0.5):
        return []
    return [
        GpuMemory(index=g.index, used_bytes=g.memory_used_bytes, total_bytes=g.memory_total_bytes)
        for g in read_nvml().gpus
    ]


def stop_vllm_server(name: str | None = None, timeout_s: float = 30) -> StopResult:
    """SIGTERM the server's process group, SIGKILL after `timeout_s`; only the process gpurig
    started (pid and start time checked). Stopping a stopped or dead server is fine."""
    if timeout_s < 0:
        raise InvalidInputError(f"timeout_s {timeout_s} must be >= 0", remedy="pass e.g. 30")
    record = _pick(name, "stop")
    was = refresh(record, check_health=False).state
    record = state.read_record(record.name) or record
    if was in ("stopped", "dead"):
        return StopResult(
            name=record.name,
            was=was,
            state=record.state,
            signalled=False,
            seconds=0.0,
            port_free=process.port_free(record.host, record.port),
            detail=f"{record.name} was already {was}; nothing to do",
        )
    gpu_before = _gpu_memory()
    sent, killed, seconds = process.stop_group(record.pid, record.pid_create_time, timeout_s)
    record.state = "stopped"
    record.stopped_at = state.now_iso()
    state.write_record(record)
    free = False
    end = time.monotonic() + 5
    while time.monotonic() < end and not (free := process.port_free(record.host, record.port)):
        time.sleep(0.1)
    detail = (
        f"SIGTERM, then SIGKILL after {timeout_s:g} s (it ignored SIGTERM)"
        if killed
        else f"ended {seconds:g} s after SIGTERM"
        if sent
        else "the process was gone"
    )
    return StopResult(
        name=record.name,
        was=was,
        state="stopped",
        signalled=sent is not None,
        signal=sent,
        killed_after_timeout=killed,
        seconds=seconds,
        detail=detail,
        port_free=free,
        gpu_memory_before=gpu_before,
        gpu_memory_after=_gpu_memory() if gpu_before else [],
    )


def get_server_logs(
    name: str | None = None, tail: int = 200, grep: str | None = None
) -> LogsResult:
    """The last `tail` lines of a server's log (only those containing `grep`, case-insensitive)."""
    if tail < 1:
        raise InvalidInputError(f"tail must be at least 1, got {tail}", remedy="pass e.g. 200")
    record = _pick(name, "logs")
    lines = read_log_lines(record.log_path, max_bytes=max(TAIL_BYTES, tail * 400))
    if grep:
        lines = [ln for ln in lines if grep.lower() in ln.lower()]
    return LogsResult(
        name=record.name,
        log_path=record.log_path,
        lines=lines[-tail:],
        total_lines=len(lines),
        grep=grep,
    )


# ---------------------------------------------------------------------------------------------
# query, spot_check


def _target(name: str | None, base_url: str | None) -> tuple[str, str | None]:
    if base_url:
        return normalize_base_url(base_url), None
    record = _pick(name, "query")
    return record.base_url, record.served_model_name


def query_model(
    prompt: str,
    name: str | None = None,
    base_url: str | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    system: str | None = None,
) -> QueryResult:
    """One streamed chat completion: text, finish reason, usage, time to first token, tok/s."""
    url, model = _target(name, base_url)
    return chat(url, model, prompt, max_tokens=max_tokens, temperature=temperature, system=system)


def spot_check(
    name: str | None = None,
    base_url: str | None = None,
    checks: list[dict[str, str]] | None = None,
    builtin_checks: bool = True,
) -> SpotCheckResult:
    """The seeds' checks (17*23 -> 391, capital of Australia -> Canberra, gold -> Au) and the
    caller's {prompt, expect} pairs, at temperature 0; each pass/fail with the answer."""
    url, model = _target(name, base_url)
    todo = (list(BUILTIN_CHECKS) if builtin_checks else []) + list(checks or [])
    if not todo:
        raise InvalidInputError("no checks to run", remedy="keep builtin_checks on or pass checks")
    return run_checks(url, model, todo)
