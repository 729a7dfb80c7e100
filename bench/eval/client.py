"""How the evaluation asks one server: OpenAI chat completions, greedy, seeded, with `tools` for
BFCL, so both servers render the prompt through their own chat template the same way a client
of theirs would (the path a user's answers take, not a raw-completions shortcut).

A transport failure (refused, reset, the server gone) stops the run: every later question would
fail the same way, and resume picks it up once the server is back. An HTTP error reply (a 400
for a prompt too long, a 500) is that question's answer: stored with the error, counted wrong.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from bench.eval.models import Answer, EvalRequest, Question, ServerSpec
from tools.errors import GpurigError, arg

CHARS_PER_TOKEN = 4  # the estimate where a server has no /tokenize


class ServerDown(GpurigError):
    """A server that cannot be reached (at the start, or mid-run)."""


class ChatClient:
    """One server of the run: its resolved model and a pooled httpx client (thread-safe)."""

    def __init__(self, spec: ServerSpec, name: str, timeout_s: float, pool: int) -> None:
        self.spec = spec
        self.name = name
        self.base = spec.base_url
        self.root = self.base.removesuffix("/v1")
        limits = httpx.Limits(max_connections=pool + 2, max_keepalive_connections=pool + 2)
        self.http = httpx.Client(timeout=timeout_s, limits=limits)
        self.model = spec.model or self._first_model()

    def close(self) -> None:
        self.http.close()

    def _down(self, exc: Exception) -> ServerDown:
        return ServerDown(
            f"cannot reach server {self.name} ({self.base}): {exc}",
            "check that it is running and the URL is right; a run it stopped continues with "
            f"{arg('resume')} and the run's directory",
        )

    def _first_model(self) -> str:
        try:
            r = self.http.get(self.base + "/models", timeout=10)
            data = r.json()["data"]
            return str(data[0]["id"])
        except httpx.HTTPError as exc:
            raise self._down(exc) from None
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServerDown(
                f"server {self.name} ({self.base}) answers /models with no model list",
                "pass the URL of an OpenAI-compatible server (ending in /v1), or name its model",
            ) from None

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        """The chat prompt's token count from /tokenize (vLLM's and the engine's shape), else an
        estimate of one token per four characters."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        try:
            r = self.http.post(self.root + "/tokenize", json=body, timeout=30)
            if r.status_code == 200:
                return int(r.json()["count"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        return sum(len(m.get("content") or "") for m in messages) // CHARS_PER_TOKEN

    def ask(self, q: Question, request: EvalRequest) -> tuple[Answer, list[dict[str, Any]]]:
        """One question, greedy: (the answer with no verdict yet, its calls as {name,
        arguments}). Raises ServerDown when the server cannot be reached at all."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": q.messages,
            "max_tokens": request.max_tokens,
            "temperature": float(request.temperature),
            "seed": request.seed,
            # vLLM's (and the engine's): the answer's token ids, so that "the same answer" is
            # judged on tokens, not on how each side renders a broken UTF-8 byte run
            "return_token_ids": True,
        }
        if q.tools:
            body["tools"] = q.tools
        start = time.monotonic()
        try:
            r = self.http.post(self.base + "/chat/completions", json=body)
        except httpx.TimeoutException:
            took = time.monotonic() - start
            return Answer(right=False, error=f"no answer in {took:.0f} s", seconds=took), []
        except httpx.HTTPError as exc:
            raise self._down(exc) from None
        took = round(time.monotonic() - start, 3)
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code != 200 or not isinstance(data, dict) or not data.get("choices"):
            detail = data.get("error", data) if isinstance(data, dict) else r.text[:200]
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
            return Answer(right=False, error=f"HTTP {r.status_code}: {detail}", seconds=took), []
        choice = data["choices"][0]
        message = choice.get("message") or {}
        calls = [_call(tc) for tc in message.get("tool_calls") or []]
        usage = data.get("usage") or {}
        answer = Answer(
            text=message.get("content"),
            tool_calls=calls,
            right=False,
            seconds=took,
            prompt_tokens=usage.get("prompt_tokens"),
            token_ids=choice.get("token_ids"),
        )
        return answer, calls


def _call(tool_call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as {name, arguments}: arguments parsed from their JSON string (kept
    as the raw string where it is not JSON, which the checker then refuses)."""
    function = tool_call.get("function") or {}
    raw = function.get("arguments")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        args = raw
    return {"name": function.get("name"), "arguments": args}
