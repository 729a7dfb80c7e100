"""How `compare_outputs` asks one server for greedy token ids and their log-probabilities.

Two dialects, told apart by the server's own /v1/models (llama-server says `owned_by:
"llamacpp"`):
- vLLM's (and `gpurig engine serve`'s): /v1/completions with `logprobs`, `return_token_ids` and
  `return_tokens_as_token_ids`; a text prompt's ids come back as `prompt_token_ids`.
- llama.cpp's: its OpenAI endpoint returns no token ids, so the native /completion is used, with
  `return_tokens` (every generated id) and `n_probs` (the top k). Its probability entries are
  one per piece of text: the tokens of an incomplete UTF-8 character are folded into the entry
  that completes it, so an entry belongs to the next generated token with its id, and the folded
  positions have no probabilities (None). Text is tokenised through /tokenize, with the special
  tokens a completion prompt gets (`add_special`: BOS), as vLLM tokenises a text prompt.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx

from tools.compare_types import Output, ServerTarget
from tools.errors import GpurigError

Dialect = Literal["openai", "llamacpp"]


class CompareError(GpurigError):
    """A server that cannot be compared (down, not OpenAI, no logprobs)."""


class NoPromptIds(CompareError):
    """A server that does not return prompt_token_ids (no vLLM `return_token_ids`)."""


class CompareClient:
    def __init__(self, target: ServerTarget, label: str, timeout: float) -> None:
        self.target = target
        self.label = target.name or label
        self.root = target.root()
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.model = target.model or ""
        self.dialect: Dialect = "openai"

    def close(self) -> None:
        self.client.close()

    def _where(self) -> str:
        return f"server {self.label} ({self.root})"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.root + path
        try:
            r = self.client.request(method, url, json=body)
        except httpx.TimeoutException:
            raise CompareError(
                f"{self._where()} did not answer {path} in time",
                "check that it is not stuck or overloaded, or raise the timeout",
            ) from None
        except httpx.HTTPError as exc:
            raise CompareError(
                f"cannot reach {self._where()}: {exc}",
                "check that it is running and the URL is right (`gpurig serve status` lists "
                "the servers gpurig started)",
            ) from None
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code != 200:
            message = _error_message(data) or r.text[:300]
            if r.status_code == 401:
                raise CompareError(f"{self._where()} refused the request (401): {message}",
                                   "pass its API key")  # fmt: skip
            if "logprob" in message.lower() or "token_ids" in message.lower():
                raise CompareError(
                    f"{self._where()} cannot return log-probabilities or token ids "
                    f"({r.status_code}): {message}",
                    "compare servers that support `logprobs` and `return_token_ids` on "
                    "/v1/completions (vLLM, `gpurig engine serve`) or llama-server",
                )
            raise CompareError(
                f"{self._where()} answered {r.status_code} to {path}: {message}",
                "check the prompts and the model name against that server",
            )
        if not isinstance(data, dict):
            raise CompareError(
                f"{self._where()} did not answer {path} with JSON: {r.text[:200]!r}",
                "point it at an OpenAI-compatible server (the URL without a path, or ending in "
                "/v1)",
            )
        return data

    def resolve_model(self) -> None:
        data = self._call("GET", "/v1/models")
        listed = [m for m in data.get("data") or [] if isinstance(m, dict)]
        ids = [m.get("id") for m in listed]
        if not ids or not all(isinstance(i, str) for i in ids):
            raise CompareError(
                f"{self._where()} lists no models at /v1/models: {str(data)[:200]}",
                "point it at an OpenAI-compatible server",
            )
        if not self.model:
            self.model = ids[0]
        if listed[0].get("owned_by") == "llamacpp":
            self.dialect = "llamacpp"

    def complete(self, prompt: list[int] | str, max_tokens: int, k: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if k is not None:
            body |= {"logprobs": k, "return_tokens_as_token_ids": True}
        data = self._call("POST", "/v1/completions", body)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise CompareError(
                f"{self._where()}'s /v1/completions answer has no choices: {str(data)[:200]}",
                "point it at an OpenAI-compatible server",
            )
        return choices[0]

    def prompt_ids(self, text: str) -> list[int]:
        if self.dialect == "llamacpp":
            ids = self._call("POST", "/tokenize", {"content": text, "add_special": True})
            if not _int_list(ids.get("tokens")):
                raise CompareError(f"{self._where()}'s /tokenize gave no token ids: {ids!r:.200}",
                                   "point it at a llama-server")  # fmt: skip
            return list(ids["tokens"])
        choice = self.complete(text, 1, None)
        ids = choice.get("prompt_token_ids")
        if not _int_list(ids):
            raise NoPromptIds(
                f"{self._where()} does not return prompt_token_ids (vLLM's `return_token_ids`), "
                "so it cannot tokenise text prompts for the comparison",
                "pass token-id prompts instead, or use a server with return_token_ids (vLLM "
                ">= 0.10.2, `gpurig engine serve`, llama-server)",
            )
        return list(ids)

    def generate(self, prompt: list[int], max_tokens: int, k: int) -> Output:
        if self.dialect == "llamacpp":
            return self._generate_native(prompt, max_tokens, k)
        choice = self.complete(prompt, max_tokens, k)
        lp = choice.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
            raise CompareError(
                f"{self._where()} returned no logprobs (it ignores the `logprobs` field)",
                "compare servers that return completions logprobs (vLLM, `gpurig engine serve`)",
            )
        tokens = choice.get("token_ids")
        if not _int_list(tokens):
            tokens = [_token_id(t) for t in lp.get("tokens") or []]
            if any(t is None for t in tokens):
                raise CompareError(
                    f"{self._where()} returns neither token_ids nor token_id:N tokens",
                    "use a server with vLLM's `return_token_ids` or `return_tokens_as_token_ids`",
                )
        top = [_top_map(t) for t in lp.get("top_logprobs") or []]
        values = [v if isinstance(v, int | float) else None for v in lp["token_logprobs"]]
        n = len(tokens)
        return Output(list(tokens), values[:n] + [None] * (n - len(values)),
                      top[:n] + [{}] * (n - len(top)))  # fmt: skip

    def _generate_native(self, prompt: list[int], max_tokens: int, k: int) -> Output:
        """llama-server's /completion: greedy, no prompt cache (each prompt read afresh, as
        the other side reads it), every generated id and the top k per text piece."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                "n_probs": k}  # fmt: skip
        data = self._call("POST", "/completion", body)
        tokens = data.get("tokens")
        if not _int_list(tokens):
            raise CompareError(
                f"{self._where()}'s /completion returned no token ids: {str(data)[:200]}",
                "use a llama-server recent enough for `return_tokens` (llama.cpp b4000 or later)",
            )
        return llamacpp_output(list(tokens), data.get("completion_probabilities"))


def llamacpp_output(tokens: list[int], entries: Any) -> Output:
    """Place llama.cpp's per-text-piece probability entries on the token positions: each entry
    goes to the next position holding its id; folded positions keep None and {}."""
    logprobs: list[float | None] = [None] * len(tokens)
    top: list[dict[int, float]] = [{} for _ in tokens]
    position = 0
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
            continue
        while position < len(tokens) and tokens[position] != entry["id"]:
            position += 1
        if position == len(tokens):
            break
        if isinstance(entry.get("logprob"), int | float):
            logprobs[position] = float(entry["logprob"])
        for alt in entry.get("top_logprobs") or []:
            if (
                isinstance(alt, dict)
                and isinstance(alt.get("id"), int)
                and isinstance(alt.get("logprob"), int | float)
            ):
                top[position].setdefault(alt["id"], float(alt["logprob"]))
        position += 1
    return Output(tokens, logprobs, top)


def _error_message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err is not None:
            return str(err)
        if "message" in data:
            return str(data["message"])
    return ""


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) for i in value)


def _token_id(text: Any) -> int | None:
    if isinstance(text, str) and text.startswith("token_id:"):
        try:
            return int(text[len("token_id:") :])
        except ValueError:
            return None
    return None


def _top_map(entry: Any) -> dict[int, float]:
    """{token id: logprob} of one step's top_logprobs ("token_id:N" keys; others dropped)."""
    out: dict[int, float] = {}
    if isinstance(entry, dict):
        for key, value in entry.items():
            tid = _token_id(key)
            if tid is not None and isinstance(value, int | float):
                out.setdefault(tid, float(value))
    return out
