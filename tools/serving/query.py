"""One chat completion against a running server (streamed, so time to first token is real), and
the built-in spot checks: three questions with one right answer each, at temperature 0."""

from __future__ import annotations

import json
import re
import time

import httpx

from tools.errors import InvalidInputError, NotFoundError, RefusedError
from tools.serving.models import QueryResult, SpotCheckItem, SpotCheckResult

BUILTIN_CHECKS: list[dict[str, str]] = [
    {"prompt": "What is 17*23? Answer with the number only.", "expect": "391"},
    {"prompt": "What is the capital of Australia? Answer with one word.", "expect": "Canberra"},
    {
        "prompt": "What is the chemical symbol for gold? Answer with the symbol only.",
        "expect": "Au",
    },
]


def normalize_base_url(base_url: str) -> str:
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidInputError(
            f"base_url {base_url!r} is not an http(s) URL",
            remedy="pass e.g. http://127.0.0.1:8000/v1",
        )
    return url if url.endswith("/v1") else url + "/v1"


def first_model(client: httpx.Client, base_url: str) -> str:
    try:
        resp = client.get(f"{base_url}/models", timeout=10)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RefusedError(
            f"cannot list the models at {base_url}/models: {exc}",
            remedy="check that the server is ready: gpurig serve status",
        ) from exc
    if not data:
        raise NotFoundError(f"{base_url}/models lists no model", remedy="check the server's log")
    return data[0]["id"]


def chat(
    base_url: str,
    model: str | None,
    prompt: str,
    max_tokens: int = 128,
    temperature: float = 0.0,
    system: str | None = None,
    timeout_s: float = 300.0,
) -> QueryResult:
    """POST /chat/completions with stream=true; text, finish reason, usage, TTFT and tok/s."""
    if not prompt:
        raise InvalidInputError("the prompt is empty", remedy="pass a question")
    if max_tokens < 1:
        raise InvalidInputError(
            f"max_tokens must be at least 1, got {max_tokens}", remedy="pass e.g. max_tokens=128"
        )
    base_url = normalize_base_url(base_url)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10)) as client:
        model = model or first_model(client, base_url)
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        pieces: list[str] = []
        finish: str | None = None
        usage: dict = {}
        ttft: float | None = None
        t0 = time.perf_counter()
        try:
            with client.stream("POST", f"{base_url}/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise RefusedError(
                        f"{base_url}/chat/completions answered {resp.status_code}: "
                        f"{resp.text[:300]}",
                        remedy="check the model name and the server's log",
                    )
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            pieces.append(text)
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as exc:
            raise RefusedError(
                f"the request to {base_url} failed: {exc}",
                remedy="check that the server is ready: gpurig serve status",
            ) from exc
        total = time.perf_counter() - t0
    completion = usage.get("completion_tokens")
    rate = None
    if completion and ttft is not None and total > ttft and completion > 1:
        rate = round((completion - 1) / (total - ttft), 2)
    return QueryResult(
        base_url=base_url,
        model=model,
        text="".join(pieces),
        finish_reason=finish,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=completion,
        ttft_s=round(ttft, 4) if ttft is not None else None,
        total_s=round(total, 4),
        tokens_per_s=rate,
    )


def answer_matches(answer: str, expect: str) -> bool:
    """The expected answer as a whole word, case-insensitive ("Au." and "AU" pass, "Australia"
    does not pass for "Au")."""
    return re.search(rf"(?<![\w]){re.escape(expect.strip())}(?![\w])", answer, re.I) is not None


def run_checks(
    base_url: str, model: str | None, checks: list[dict[str, str]], max_tokens: int = 64
) -> SpotCheckResult:
    items: list[SpotCheckItem] = []
    for check in checks:
        if not check.get("prompt") or not check.get("expect"):
            raise InvalidInputError(
                f"a check needs a prompt and an expect, got {check}",
                remedy='pass e.g. {"prompt": "2+2?", "expect": "4"}',
            )
        t0 = time.perf_counter()
        result = chat(base_url, model, check["prompt"], max_tokens=max_tokens, temperature=0.0)
        model = result.model
        items.append(
            SpotCheckItem(
                prompt=check["prompt"],
                expect=check["expect"],
                answer=result.text,
                passed=answer_matches(result.text, check["expect"]),
                finish_reason=result.finish_reason,
                seconds=round(time.perf_counter() - t0, 3),
            )
        )
    passed = sum(i.passed for i in items)
    return SpotCheckResult(
        base_url=normalize_base_url(base_url),
        model=model or "",
        passed=passed,
        failed=len(items) - passed,
        ok=passed == len(items),
        checks=items,
    )
