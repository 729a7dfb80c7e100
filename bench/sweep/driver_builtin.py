"""The builtin load driver: streaming /v1/completions, closed loop or open loop.

Closed loop (a rate of None): at most `concurrency` requests in flight, the next sent as one
ends. Open loop: each job is sent at its seeded arrival time (bench/sweep/arrivals.py), at most
`concurrency` in flight when that is not 0 (vLLM's --max-concurrency: a due job waits for a
slot, and its TTFT is timed from its actual send, as vLLM times it). A multi-turn job sends its
turns one after the other, each with the whole history before it: the earlier user parts and
the model's answers (its token ids from `return_token_ids`, as vLLM and the engine return them;
else the answer's text for text prompts; else seeded stand-in ids of the answer's length).

Each request streams (`stream: true`, `stream_options.include_usage`) with `ignore_eos` and
`max_tokens = output_len`, so it makes exactly output_len tokens; at most `concurrency` are in
flight. The times are the client's own, taken as `vllm bench serve` takes them: TTFT at the first
chunk that carries a choice, an ITL per later chunk, the output token count from the final
usage (the chunk count where a server sends no usage). One event loop per cell, one connection
per request through the lean client in sse_client.py (httpx for https); a chunk is parsed as
JSON only when it carries usage or an error. The driver's own CPU cost is measured by
lab/sweep_cost.py. Stall probes (bench/sweep/probes.py), where asked, run in the same event loop
beside the load, outside its cap, until its last request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from bench.sweep.models import RequestResult
from bench.sweep.probes import ProbePlan, run_probes
from bench.sweep.prompts import sha
from bench.sweep.sse_client import HttpError, StreamClosed, stream_events
from bench.sweep.workload import Job

Prompt = list[int] | str
OnDone = Callable[[RequestResult], None]


def _error_text(body: bytes, status: int) -> str:
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") if isinstance(err, dict) else None
        if message:
            return f"HTTP {status}: {message}"
    except ValueError:
        pass
    return f"HTTP {status}: {body[:200].decode(errors='replace')}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError | httpx.ConnectError):
        return f"connection refused or unreachable ({exc})"
    if isinstance(exc, StreamClosed | httpx.RemoteProtocolError):
        return f"server closed the connection mid-stream ({exc})"
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


async def _httpx_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> AsyncIterator[tuple[bytes, float]]:
    """The same events as sse_client.stream_events, through httpx (https servers)."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise HttpError(resp.status_code, await resp.aread())
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield data.encode(), time.perf_counter()


async def one_request(
    client: httpx.AsyncClient | None,
    url: str,
    model: str | None,
    prompt: Prompt,
    index: int,
    output_len: int,
    cell_start: float,
    timeout_s: float = 600.0,
    answer: list | None = None,
) -> RequestResult:
    """Send one streaming completion and time it (`client` None: the lean http:// client).
    `answer`: a list to collect the answer into (token ids where the server returns them,
    else text pieces); every chunk is then parsed, which costs CPU only multi-turn needs."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if answer is not None and isinstance(prompt, list):
        body["return_token_ids"] = True
    n_in = len(prompt) if isinstance(prompt, list) else 0
    result = RequestResult(index=index, prompt_sha=sha(prompt), input_tokens=n_in)
    start = time.perf_counter()
    result.start_s = round(start - cell_start, 6)
    first: float | None = None
    last = start
    chunks = 0
    usage: dict[str, Any] | None = None
    events = stream_events(url, body) if client is None else _httpx_events(client, url, body)
    try:
        async with asyncio.timeout(timeout_s):
            async for data, now in events:
                if data.startswith(b"{") and (b'"usage"' in data or b'"error"' in data):
                    payload = json.loads(data)
                    if "error" in payload:
                        err = payload["error"]
                        msg = err.get("message") if isinstance(err, dict) else str(err)
                        result.error = f"error in the stream: {msg}"
                        break
                    usage = payload.get("usage") or usage
                    if not payload.get("choices"):
                        continue
                elif b'"choices": []' in data or b'"choices":[]' in data:
                    continue
                if answer is not None and data.startswith(b"{"):
                    _collect(json.loads(data), answer)
                chunks += 1
                if first is None:
                    first = now
                else:
                    result.itl_ms.append(round((now - last) * 1000, 3))
                last = now
    except HttpError as exc:
        result.error = _error_text(exc.body, exc.status)
    except (httpx.HTTPError, OSError, ValueError, StreamClosed, TimeoutError) as exc:
        result.error = _describe(exc)
    end = time.perf_counter()
    result.e2e_ms = round((end - start) * 1000, 3)
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = usage.get("prompt_tokens")
    else:
        result.output_tokens = chunks
    if first is not None:
        result.ttft_ms = round((first - start) * 1000, 3)
        if result.output_tokens > 1:
            result.tpot_ms = round((end - first) * 1000 / (result.output_tokens - 1), 4)
    if result.error is None and result.output_tokens == 0:
        result.error = "the stream ended without any output token"
    return result


def _collect(payload: dict[str, Any], answer: list) -> None:
    """Append a chunk's answer: its token ids where it has them, else its text."""
    for choice in payload.get("choices") or []:
        ids = choice.get("token_ids")
        if ids:
            answer.extend(int(i) for i in ids)
        elif choice.get("text"):
            answer.append(str(choice["text"]))


def _history_part(prompt: Prompt, answer: list, stand_in: list[int]) -> Prompt:
    """The answer as it goes into the next turn's history, in the prompt's own kind."""
    if isinstance(prompt, str):
        return "".join(a if isinstance(a, str) else "" for a in answer)
    ids = [a for a in answer if isinstance(a, int)]
    return ids if ids else stand_in


async def _run_jobs(
    base_url: str,
    model: str | None,
    jobs: list[Job],
    concurrency: int,
    timeout_s: float,
    on_done: OnDone | None,
    arrivals: list[float] | None,
    stand_in: Callable[[int, int], list[int]] | None,
    probe: ProbePlan | None = None,
    probe_out: list[RequestResult] | None = None,
) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + "/completions"
    sem = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    client = None
    if url.startswith("https://"):  # the lean client speaks plain http only
        extra = 16 if probe is not None else 0  # probes go outside the cap
        limits = httpx.Limits(max_connections=(concurrency or len(jobs)) + 2 + extra)
        client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0))
    try:
        cell_start = time.perf_counter()

        async def conversation(pos: int, job: Job) -> list[RequestResult]:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, cell_start + arrivals[pos] - time.perf_counter()))
            out = []
            history: Prompt = [] if not job.parts or isinstance(job.parts[0], list) else ""
            multi = len(job.parts) > 1
            async with sem:
                for turn, part in enumerate(job.parts):
                    prompt = history + part  # type: ignore[operator]
                    answer: list | None = [] if multi and turn < len(job.parts) - 1 else None
                    result = await one_request(
                        client, url, model, prompt, job.index, job.output_len, cell_start,
                        timeout_s, answer,
                    )  # fmt: skip
                    result.turn, result.group, result.output_len = turn, job.group, job.output_len
                    if arrivals is not None and turn == 0:
                        result.scheduled_s = round(arrivals[pos], 6)
                    if on_done is not None:
                        on_done(result)
                    out.append(result)
                    if result.error is not None:
                        break
                    if answer is not None:
                        filler = stand_in(job.index, result.output_tokens) if stand_in else []
                        history = prompt + _history_part(part, answer, filler)  # type: ignore[operator]
            return out

        stop = asyncio.Event()
        probing = None
        if probe is not None:

            async def send(prompt: Prompt, i: int) -> RequestResult:
                return await one_request(client, url, model, prompt, i, 1, cell_start, timeout_s)

            probing = asyncio.create_task(run_probes(probe, send, stop))
        try:
            nested = await asyncio.gather(*(conversation(p, j) for p, j in enumerate(jobs)))
        finally:
            stop.set()
            if probing is not None:
                found = await probing
                if probe_out is not None:
                    probe_out.extend(found)
    finally:
        if client is not None:
            await client.aclose()
    results = [r for rs in nested for r in rs]
    _mark_group_firsts(results)
    ends = [r.start_s + (r.e2e_ms or 0) / 1000 for r in results]
    duration = max(ends) - min(r.start_s for r in results) if results else 0.0
    return results, duration


def _mark_group_firsts(results: list[RequestResult]) -> None:
    """The first request sent in each shared-prefix group (the one that pays for the prefix)."""
    seen: set[int] = set()
    for r in sorted(results, key=lambda r: r.start_s):
        if r.group is not None and r.turn == 0 and r.group not in seen:
            seen.add(r.group)
            r.group_first = True


def run_jobs(
    base_url: str,
    model: str | None,
    jobs: list[Job],
    concurrency: int,
    timeout_s: float = 600.0,
    on_done: OnDone | None = None,
    arrivals: list[float] | None = None,
    stand_in: Callable[[int, int], list[int]] | None = None,
    probe: ProbePlan | None = None,
    probe_out: list[RequestResult] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run a cell's jobs: closed loop at `concurrency`, or open loop at `arrivals` (send times,
    s) capped at `concurrency` (0: no cap). Every request's result and the cell's wall time in
    seconds (first send to last byte). `stand_in(index, n)`: ids for an answer the server
    returned no ids of (multi-turn history). `probe`: stall probes beside the load, their
    results appended to `probe_out`."""
    return asyncio.run(
        _run_jobs(base_url, model, jobs, concurrency, timeout_s, on_done, arrivals, stand_in,
                  probe, probe_out)
    )  # fmt: skip


def run_requests(
    base_url: str,
    model: str | None,
    prompts: list[tuple[int, Prompt]],
    output_len: int,
    concurrency: int,
    timeout_s: float = 600.0,
    on_done: OnDone | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `prompts` ((index, prompt) pairs), at most `concurrency` at a time; returns every
    request's result and the cell's wall time in seconds (first send to last byte)."""
    jobs = [Job(index=i, parts=[p], output_len=output_len) for i, p in prompts]
    return run_jobs(base_url, model, jobs, concurrency, timeout_s, on_done)
