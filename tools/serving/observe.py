"""Watching a server: its log's tail, its /health and /v1/models, and writing it off as dead
with a diagnosis. Shared by start (waiting) and status (re-checking)."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from tools.serving import state
from tools.serving.failures import diagnose
from tools.serving.models import ServerRecord
from tools.serving.startup_facts import parse_startup_facts

TAIL_BYTES = 256 * 1024


# ---------------------------------------------------------------------------------------------
# Logs and health


def read_log_lines(path: str | Path, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last `max_bytes` of a log as lines (carriage-return progress bars split too)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.split("\n") if ln.strip()]
    return lines[1:] if size > max_bytes and lines else lines


def health(record: ServerRecord, timeout: float = 2.0) -> tuple[str, str | None, list[str]]:
    """(ok|unhealthy|unreachable, detail, model ids listed)."""
    root = record.base_url.removesuffix("/v1")
    try:
        with httpx.Client(timeout=timeout) as client:
            resp = client.get(f"{root}/health")
            if resp.status_code != 200:
                return "unhealthy", f"/health answered {resp.status_code}", []
            models = client.get(f"{record.base_url}/models")
            ids = [m.get("id") for m in models.json().get("data", [])] if models.is_success else []
            return "ok", None, ids
    except (httpx.HTTPError, ValueError) as exc:
        return "unreachable", f"{type(exc).__name__}: {exc}"[:200], []


def first_request(record: ServerRecord, timeout: float) -> tuple[bool, str, float]:
    """One real 1-token completion: (it answered, what happened, seconds). /health says 200
    before the engine has run anything: vLLM's CPU build on an attention shape it cannot run
    reports healthy, then its engine core dies at the first request (every later one a 500).
    A 4xx answer still counts as serving (the request reached a live engine)."""
    started = time.monotonic()
    body = {"model": record.served_model_name, "prompt": "Hi", "max_tokens": 1}
    body["temperature"] = 0
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=10)) as client:
            resp = client.post(f"{record.base_url}/completions", json=body)
    except httpx.HTTPError as exc:
        took = round(time.monotonic() - started, 2)
        return False, f"the first request failed: {type(exc).__name__}: {exc}"[:300], took
    took = round(time.monotonic() - started, 2)
    if resp.status_code >= 500:
        try:
            detail = str(resp.json().get("error", {}).get("message", ""))[:200]
        except (ValueError, AttributeError):
            detail = resp.text[:200]
        return False, f"the first request answered HTTP {resp.status_code}: {detail}", took
    return True, f"the first request answered HTTP {resp.status_code}", took


def elapsed(record: ServerRecord) -> float:
    return (datetime.now(UTC) - state.parse_iso(record.started_at)).total_seconds()


def mark_dead(
    record: ServerRecord,
    timed_out: bool = False,
    weights: float | None = None,
    context: dict | None = None,
) -> ServerRecord:
    lines = read_log_lines(record.log_path)
    exit_info = state.read_exit(record)
    ctx = {"pid": record.server_pid, "weights_gib": weights, **(context or {})}
    record.failure = diagnose(lines, exit_info, ctx, timed_out=timed_out)
    record.state = "dead"
    record.stopped_at = record.stopped_at or (exit_info or {}).get("ended_at") or state.now_iso()
    record.startup_facts = parse_startup_facts(lines)
    state.write_record(record)
    return record
