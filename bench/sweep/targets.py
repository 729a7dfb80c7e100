"""Targets at run time: where to send requests, which model id, which checkpoint and process.

A `base_url` target is asked /v1/models (the served id, vLLM's `root`); its server process is
found by the port it listens on when it is on this host. A `server` target is started through
the lifecycle tools (tools.serving.start_vllm_server) just before its cells and stopped after
them, so only one server holds the GPU at a time.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.sweep.models import Target
from bench.sweep.prompts import Vocab, read_vocab
from tools.serving.preflight import hub_snapshot
from tools.settings import state_dir

log = logging.getLogger(__name__)
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


@dataclass
class Live:
    """A target that answers: its URL, model id, checkpoint, process and interpreter."""

    label: str
    base_url: str
    model: str | None
    model_dir: str | None
    pid: int | None
    python_bin: str | None
    record: Any = None  # the ServerRecord when the sweep started it

    @property
    def root_url(self) -> str:
        """The server's root (where /metrics and /health live): base_url without /v1."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


def list_models(base_url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """GET /v1/models; raises httpx.HTTPError (or ValueError) when the server does not answer."""
    resp = httpx.get(base_url.rstrip("/") + "/models", timeout=timeout_s)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("/v1/models lists no model")
    return data


def check_alive(base_url: str, timeout_s: float = 5.0) -> str | None:
    """None when the server answers /v1/models, else why not (a cell's failure reason)."""
    try:
        list_models(base_url, timeout_s)
    except httpx.ConnectError:
        return f"target down: nothing answers at {base_url} (connection refused)"
    except httpx.TimeoutException:
        return f"target not answering: {base_url}/models timed out after {timeout_s:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:
        return f"target not serving: {base_url}/models failed ({exc})"
    return None


def _local_dir(candidate: str | None) -> str | None:
    if candidate and Path(candidate).expanduser().is_dir():
        return str(Path(candidate).expanduser().resolve())
    return None


def _hf_cache_dir(model_id: str | None) -> str | None:
    """A Hugging Face id's snapshot in the local cache, without any download (the one the
    serving preflight measures the weights of)."""
    snapshot = hub_snapshot(model_id) if model_id else None
    return str(snapshot) if snapshot else None


def listening_pid(base_url: str) -> int | None:
    """The pid listening on the URL's port on this host (None when not local or not visible)."""
    parts = urlsplit(base_url)
    if parts.hostname not in LOOPBACK:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    except Exception:
        return None
    return None


def static_model_dir(target: Target) -> str | None:
    """The checkpoint directory known without asking the server."""
    if target.model_dir:
        return _local_dir(target.model_dir)
    if target.server:
        model = str(target.server.get("model"))
        return _local_dir(model) or _hf_cache_dir(model)
    return None


def resolve(target: Target, record: Any = None) -> Live:
    """Ask the running server what it serves; raises httpx.HTTPError/ValueError if it does not
    answer (the caller marks the target's cells failed with that)."""
    base_url = record.base_url if record is not None else target.base_url
    assert base_url is not None
    cards = list_models(base_url)
    model = target.model or (record.served_model_name if record is not None else None)
    model = model or str(cards[0].get("id"))
    root = next((c.get("root") for c in cards if c.get("id") == model), None)
    model_dir = static_model_dir(target) or _local_dir(root) or _hf_cache_dir(root or model)
    if record is not None:
        pid = getattr(record, "server_pid", None) or record.pid
        python_bin = target.python_bin or getattr(record, "python", None)
    else:
        pid, python_bin = listening_pid(base_url), target.python_bin
    return Live(target.label, base_url, model, model_dir, pid, python_bin, record)


def vocab_of(target: Target, ask_server: bool = True) -> Vocab | None:
    """The target's vocabulary, read from its checkpoint where one is known before serving:
    `model_dir`, the server spec's model, or (`ask_server`, a running server) /v1/models' root
    as a local directory or in the Hugging Face cache."""
    model_dir = static_model_dir(target)
    if model_dir is None and target.base_url and ask_server:
        try:
            cards = list_models(target.base_url)
        except (httpx.HTTPError, ValueError):
            return None
        card = next((c for c in cards if c.get("id") == target.model), cards[0])
        model_dir = _local_dir(card.get("root")) or _hf_cache_dir(card.get("root") or card["id"])
    return read_vocab(model_dir) if model_dir else None


# ---- servers the sweep starts ------------------------------------------------------------------


def resettable(spec: dict[str, Any], sweep_id: str) -> dict[str, Any]:
    """The server's start spec with what lets the sweep reset its prefix cache between cells
    (bench/sweep/cache_reset.py): vLLM serves /reset_prefix_cache only with
    VLLM_SERVER_DEV_MODE=1, llama-server erases slots only with --slot-save-path. Only for
    servers the sweep starts itself, and never over the user's own setting."""
    spec = dict(spec)
    backend = spec.get("backend", "vllm")
    if backend == "vllm":
        spec["env"] = {"VLLM_SERVER_DEV_MODE": "1", **(spec.get("env") or {})}
    elif backend == "llamacpp":
        extra = list(spec.get("extra_args") or [])
        if not any(a.split("=")[0] == "--slot-save-path" for a in extra):
            slots = state_dir() / "slots" / sweep_id
            slots.mkdir(parents=True, exist_ok=True)
            extra += ["--slot-save-path", str(slots)]
        spec["extra_args"] = extra
    return spec


def start_server(
    target: Target, sweep_id: str, cache_reset: bool = False
) -> tuple[Any, str | None]:
    """Start a `server` target through the lifecycle tools: (record, None) once it serves, or
    (record or None, why it does not). `cache_reset`: started so that its cache can be reset."""
    from tools.serving import start_vllm_server, stop_vllm_server
    from tools.serving.process import free_port

    spec = dict(target.server or {})
    if cache_reset:
        spec = resettable(spec, sweep_id)
    spec.setdefault("name", f"{sweep_id}-{target.label}"[:64])
    # a server of this sweep that a killed run left behind (it would hold the GPU and the name)
    with contextlib.suppress(Exception):
        stop_vllm_server(name=spec["name"])
    spec.setdefault("port", free_port())
    spec.setdefault("wait", True)
    try:
        record = start_vllm_server(**spec)
    except Exception as exc:  # a GpurigError with a remedy, or a bad spec
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        remedy = getattr(exc, "remedy", None)
        return None, f"server did not start: {message}" + (f" ({remedy})" if remedy else "")
    failure = getattr(record, "failure", None)
    if failure is not None:
        return record, f"server did not start: {failure.title} ({failure.remedy})"
    return record, None


def stop_server(record: Any) -> str | None:
    """Stop a server this sweep started; None, or why stopping failed (logged, not fatal)."""
    try:
        from tools.serving import stop_vllm_server

        stop_vllm_server(name=record.name)
    except Exception as exc:
        log.warning("stopping %s failed: %s", getattr(record, "name", "?"), exc)
        return str(exc)
    return None
