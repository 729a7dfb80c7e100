"""Emptying a target's prefix cache before a cell, so a repeat (or the next load level, which
sends the same seeded prompts) is not served from the cache the cell before it filled.

Which call empties it depends on the server, found by asking in turn:
- `POST /reset_prefix_cache`: vLLM (`{"success": bool}`; it fails while blocks are still held,
  so it is tried again a few times) and the engine server (engine/server/cache_reset.py, which
  says it holds no cache across requests). vLLM serves it only with `VLLM_SERVER_DEV_MODE=1` in
  its environment; without, a 404, and `/version` tells that it is vLLM.
- llama-server: `GET /slots`, then `POST /slots/{id}?action=erase` for each slot (their cached
  prompt tokens). It takes slot actions only when started with `--slot-save-path DIR`; it
  refuses them otherwise, and that reason is the cell's. Erasing slots does not empty its host
  RAM prompt cache (`--cache-ram`, on by default): start it with `--cache-ram 0` for that.
A server with neither: not supported, with what was tried. Never raises.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.sweep.cell_models import CacheReset

TRIES, RETRY_S = 4, 0.25
TIMEOUT_S = 10.0


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _error(resp: httpx.Response) -> str:
    data = _json(resp)
    err = data.get("error") if isinstance(data, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return f"HTTP {resp.status_code}: {message or resp.text[:200]}"


def reset_cache(root_url: str, timeout_s: float = TIMEOUT_S) -> CacheReset:
    """Empty the prefix cache of the server at `root_url` (its root, without /v1)."""
    t0 = time.perf_counter()
    root = root_url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as client:
            out = _reset(client, root)
    except httpx.HTTPError as exc:
        out = CacheReset(done=False, detail=f"the reset call failed: {type(exc).__name__}: {exc}")
    out.ms = round((time.perf_counter() - t0) * 1000, 2)
    return out


def _reset(client: httpx.Client, root: str) -> CacheReset:
    how = "POST /reset_prefix_cache"
    for attempt in range(TRIES):
        resp = client.post(root + "/reset_prefix_cache")
        data = _json(resp)
        if resp.status_code == 404:
            return _llama_slots(client, root)
        if resp.status_code == 200 and isinstance(data, dict) and data.get("success"):
            if data.get("prefix_cache") is False:  # the engine server: nothing was held
                return CacheReset(done=True, how=how, detail=f"engine: {data.get('message')}")
            return CacheReset(done=True, how=how, detail="prefix cache reset")
        if attempt < TRIES - 1:
            time.sleep(RETRY_S)  # vLLM: blocks still held (the last requests ending); busy
    why = "answered success=false (blocks still held)" if resp.status_code == 200 else _error(resp)
    return CacheReset(done=False, how=how, detail=f"the server {why} {TRIES} times")


def _llama_slots(client: httpx.Client, root: str) -> CacheReset:
    resp = client.get(root + "/slots")
    slots = _json(resp)
    if resp.status_code != 200 or not isinstance(slots, list):
        return CacheReset(done=False, detail=_unsupported(client, root, resp))
    how = "POST /slots/{id}?action=erase"
    erased = 0
    for slot in slots:
        sid = slot.get("id") if isinstance(slot, dict) else None
        if sid is None:
            continue
        r = client.post(f"{root}/slots/{sid}", params={"action": "erase"})
        if r.status_code != 200:
            return CacheReset(done=False, how=how, detail=f"llama-server refused: {_error(r)}")
        erased += int((_json(r) or {}).get("n_erased") or 0)
    return CacheReset(
        done=True, how=how, detail=f"llama-server: {len(slots)} slot(s) erased ({erased} tokens)"
    )


def _unsupported(client: httpx.Client, root: str, slots: httpx.Response) -> str:
    """Why a server without either call has no reset, naming vLLM's switch where it is vLLM."""
    version = client.get(root + "/version")
    data = _json(version) if version.status_code == 200 else None
    if isinstance(data, dict) and data.get("version"):
        return (
            f"not supported: vLLM {data['version']} serves /reset_prefix_cache only with "
            "VLLM_SERVER_DEV_MODE=1 in its environment"
        )
    return (
        "not supported: the server has no POST /reset_prefix_cache (vLLM, the engine) and no "
        f"GET /slots (llama-server): {slots.status_code}"
    )
