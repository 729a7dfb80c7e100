"""What `compare_outputs`, its server client and its transformers reference share.

Kept apart so that the three import it and none of them imports another for a type: the
comparison uses the client and the reference, the client and the reference use only these.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field


class ServerTarget(BaseModel):
    base_url: str = Field(
        min_length=1,
        max_length=2048,
        description="the server's URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)",
    )
    name: str | None = Field(None, max_length=64, description="label in the report")
    model: str | None = Field(
        None, max_length=512, description="the served model name; default: the first listed"
    )
    api_key: str | None = Field(None, max_length=512, description="Bearer token, if it needs one")

    def root(self) -> str:
        url = self.base_url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Output:
    """One server's greedy answer: token ids, each one's log-probability (None: not given) and
    the top-k map {token id: logprob} per position ({} where not given)."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[dict[int, float]]


def leading_token_apart(a: list[int], b: list[int]) -> bool:
    """The same ids, or the same but for one leading token that one side adds (a BOS)."""
    return a == b or a[1:] == b or b[1:] == a
