"""What a sweep's plan is made of: its targets, the workload's shape and an SLO search. Split
from bench/sweep/models.py (the request, the plan, the cells), which re-exports them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class Target(BaseModel):
    """One server to measure: a running one (`base_url`, as the OpenAI client takes it, ending in
    /v1) or one the sweep starts and stops in turn (`server`: start_vllm_server's arguments)."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(pattern=LABEL_PATTERN, description="unique name in tables and files")
    base_url: str | None = Field(None, description="e.g. http://127.0.0.1:8000/v1")
    server: dict[str, Any] | None = Field(
        None, description="start_vllm_server arguments, e.g. {'model': DIR, 'backend': 'engine'}"
    )
    model: str | None = Field(None, description="the served model id; default: /v1/models' first")
    model_dir: str | None = Field(
        None,
        description="local checkpoint directory (tokenizer for the prompts, safetensors headers "
        "for the roofline); default: the server's model where it is a local directory",
    )
    prompt_format: Literal["token_ids", "text"] = Field(
        "token_ids",
        description="token_ids: prompts as token-id lists on /v1/completions (vLLM, the engine); "
        "text: decoded text of exactly input_len tokens of the model's tokenizer",
    )
    python_bin: str | None = Field(
        None, description="serving interpreter for the bandwidth probe and vllm bench"
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.strip().rstrip("/")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url {v!r} must start with http:// or https://")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> Target:
        if (self.base_url is None) == (self.server is None):
            raise ValueError(
                f"target {self.label!r}: give exactly one of base_url (a running server) or "
                "server (start_vllm_server arguments)"
            )
        if self.server is not None and not self.server.get("model"):
            raise ValueError(f"target {self.label!r}: server needs a 'model'")
        return self


class Workload(BaseModel):
    """What the prompts look like (vLLM bench serve's datasets, by another name): fixed or drawn
    lengths, shared-prefix groups, multi-turn conversations, or a user's dataset file."""

    model_config = ConfigDict(extra="forbid")

    range_ratio: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="input and output lengths drawn around the asked ones: uniform in "
        "[n(1-r), n(1+r)] (vllm bench's --random-range-ratio), or normal with sd r*n",
    )
    length_dist: Literal["uniform", "normal"] = "uniform"
    prefix_len: int = Field(0, ge=0, description="tokens shared by every prompt of a group")
    prefix_groups: int = Field(1, ge=1, le=4096, description="distinct shared prefixes per cell")
    turns: int = Field(1, ge=1, le=64, description="turns per conversation (history resent)")
    dataset: str | None = Field(
        None, description="ShareGPT JSON or JSONL of {prompt, output_len}: text prompts"
    )

    @model_validator(mode="after")
    def _one_kind(self) -> Workload:
        if self.dataset and (self.prefix_len or self.turns > 1 or self.range_ratio):
            raise ValueError("a dataset workload takes its prompts and lengths from the file")
        if self.dataset and not Path(self.dataset).expanduser().is_file():
            raise ValueError(f"dataset {self.dataset!r} is not a file")
        return self

    def describe(self) -> str:
        if self.dataset:
            return f"dataset {self.dataset}"
        parts = []
        if self.range_ratio:
            parts.append(f"lengths {self.length_dist} +-{self.range_ratio:.0%}")
        else:
            parts.append("fixed lengths")
        if self.prefix_len:
            parts.append(f"{self.prefix_groups} shared prefix(es) of {self.prefix_len} tokens")
        if self.turns > 1:
            parts.append(f"{self.turns}-turn conversations (history resent)")
        return ", ".join(parts)


class SearchSpec(BaseModel):
    """Find, per target and input length, the highest load that meets the SLO: doubling from
    `start` until a level fails (or `max`), then bisection between the last pass and the first
    fail; a level passes when every repeat meets the SLO."""

    model_config = ConfigDict(extra="forbid")

    axis: Literal["concurrency", "rate"] = Field(
        "concurrency", description="find the highest load meeting the slo along this axis"
    )
    start: float = Field(1.0, gt=0, description="the first level tried")
    max: float = Field(256.0, gt=0, description="the highest level tried")
    precision: float = Field(
        0.1, gt=0, lt=1, description="rate: stop when the bracket is this narrow (relative)"
    )

    @model_validator(mode="after")
    def _range(self) -> SearchSpec:
        if self.max < self.start:
            raise ValueError("search max must be at least its start")
        if self.axis == "concurrency" and (self.start != int(self.start)):
            raise ValueError("a concurrency search starts at a whole number")
        return self
