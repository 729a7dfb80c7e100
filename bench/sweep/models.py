"""The sweep's pydantic models: what goes in (targets, the plan) and what each cell records; what
comes back (status, summary, roofline) is in bench/sweep/result_models.py, re-exported here.

Everything a sweep writes to disk is one of these models dumped as JSON, so a report can be
rebuilt from the files alone and a resumed sweep reads exactly what the killed one wrote.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bench.sweep.cell_models import CacheReset, CellOptions, ProbeStats, Saturation
from bench.sweep.gate_models import ProbeAnswer
from bench.sweep.order import check_gate_and_order

# the plan's parts (bench/sweep/plan_models.py), importable from here as well
from bench.sweep.plan_models import LABEL_PATTERN, SearchSpec, Target, Workload  # noqa: F401

# what comes back (bench/sweep/result_models.py), importable from here as well: one surface
from bench.sweep.result_models import (  # noqa: F401
    VARIATION_FLAG,
    CellStatus,
    Roofline,
    SearchAnswer,
    SearchLevel,
    SummaryRow,
    SweepResult,
    SweepStatus,
    TargetCell,
)
from bench.sweep.telemetry_models import CellTelemetry, GpuTelemetry  # noqa: F401

Driver = Literal["builtin", "vllm-bench"]
SLO_KEY = r"^(ttft|tpot|itl|e2e)_p(\d{1,2}(\.\d+)?|100)_ms$"
PromptSource = Literal["checkpoint", "server", "hf-cache", "approximate-text", "dataset", "none"]


class SweepRequest(CellOptions):
    """run_sweep's arguments, as the front doors take them: the one declaration of each (the MCP
    tool's input schema and `gpurig sweep run`'s flags are generated from these fields,
    mcp_server/request_params.py and request_flags.py). SweepConfig checks the whole plan."""

    model_config = ConfigDict(extra="forbid")

    targets: list[Target] | None = Field(
        None,
        description="servers to compare, each {'label', 'base_url'} (a running "
        "OpenAI-compatible server, base_url ending in /v1) or {'label', 'server': "
        "{start_vllm_server arguments}} (started and stopped by the sweep, one at a time); "
        "optional 'model_dir' (local checkpoint: tokenizer and roofline), 'model', "
        "'prompt_format' ('token_ids' or 'text'), 'python_bin'",
    )
    input_lens: list[int] = Field([512, 4096], min_length=1, description="prompt lengths")
    output_len: int = Field(128, ge=2, le=65536, description="tokens per request")
    concurrency: list[int] | None = Field(
        None, description="closed-loop levels; default [1, 4, 8, 16] without a rate or search"
    )
    request_rate: list[float] | None = Field(
        None, description="open-loop levels (requests/s), arrivals seeded per cell"
    )
    burstiness: float | None = Field(
        None, gt=0, description="gamma shape of arrival gaps; 1 = Poisson"
    )
    max_concurrency: int | None = Field(
        None, ge=1, description="cap of in-flight requests in rate cells"
    )
    slo: dict[str, float] | None = Field(
        None,
        description="e.g. {'ttft_p99_ms': 500, 'tpot_p99_ms': 50}: METRIC_pP_ms with METRIC "
        "ttft, tpot, itl or e2e; adds goodput and pass/fail per cell",
    )
    search: SearchSpec | None = Field(
        None,
        description="instead of the grid, find the highest load meeting slo per target and "
        "input length",
    )
    workload: Workload | None = Field(
        None, description="drawn lengths, shared prefixes, conversations or a dataset file"
    )
    repeats: int = Field(3, ge=1, le=50)
    prompts_per_cell: int | None = Field(
        None, ge=1, description="requests per cell; default max(8, 4 x concurrency)"
    )
    seed: int = Field(0, ge=0, lt=2**32)
    driver: Driver = "builtin"
    out_dir: str | None = Field(None, description="default: GPURIG_HOME/sweeps/<sweep id>")
    resume: str | None = Field(None, description="a sweep's directory or id to continue")
    wait: bool = Field(True, description="false: return at once; follow with sweep_status")
    gate: bool = Field(
        True, description="after each cell, compare every target's greedy answers to fixed probes"
    )
    reference: str | None = Field(
        None, description="the correctness gate's reference target label; default: the first"
    )
    interleave: bool = Field(
        False, description="alternate running targets cell by cell (ABAB) for paired A/B"
    )

    def arguments(self) -> dict[str, Any]:
        """The request as run_sweep's keyword arguments (nested models as the dicts it takes)."""
        out = {name: getattr(self, name) for name in type(self).model_fields}
        for name in ("search", "workload"):
            if out[name] is not None:
                out[name] = out[name].model_dump(exclude_unset=True)
        return out


class SweepConfig(CellOptions):
    """The whole plan, saved as sweep.json before the first request: a resumed sweep runs it."""

    sweep_id: str
    out_dir: str
    created: str
    targets: list[Target] = Field(min_length=1)
    input_lens: list[int] = Field(min_length=1)
    output_len: int = Field(ge=2, le=65536)
    concurrency: list[int] = Field(default_factory=list, description="closed-loop levels")
    request_rate: list[float] = Field(
        default_factory=list, description="open-loop levels, requests per second"
    )
    burstiness: float = Field(
        1.0, gt=0, le=1000, description="gamma shape of the arrival gaps (1: Poisson)"
    )
    max_concurrency: int | None = Field(None, ge=1, le=4096, description="cap of rate cells")
    slo: dict[str, float] = Field(default_factory=dict, description="e.g. {'ttft_p99_ms': 500}")
    search: SearchSpec | None = None
    workload: Workload = Field(default_factory=Workload)
    repeats: int = Field(ge=1, le=50)
    prompts_per_cell: int | None = Field(None, ge=1, le=100000)
    seed: int = Field(ge=0, lt=2**32)
    driver: Driver = "builtin"
    request_timeout_s: float = Field(600.0, gt=0)
    warmup: bool = True
    pool_size: int | None = Field(None, description="prompt ids are drawn from [0, pool_size)")
    pool_exclude: list[int] = Field(default_factory=list, description="special ids never drawn")
    pool_list: list[int] | None = Field(
        None, description="the prompt ids, where a server's /tokenize gave them (no range)"
    )
    prompt_source: PromptSource = "checkpoint"
    prompt_source_note: str = Field("", description="where the prompt vocabulary came from")
    gate: bool = Field(True, description="probe answers after each cell (bench/sweep/gate.py)")
    reference: str | None = Field(None, description="the gate's reference target label")
    interleave: bool = Field(False, description="cells in ABAB order instead of target by target")

    @field_validator("input_lens")
    @classmethod
    def _lens(cls, v: list[int]) -> list[int]:
        if any(n < 0 or n > 1_048_576 for n in v):
            raise ValueError("every input length must be in [1, 1048576]")
        return list(dict.fromkeys(v))

    @field_validator("concurrency")
    @classmethod
    def _conc(cls, v: list[int]) -> list[int]:
        if any(c < 1 or c > 4096 for c in v):
            raise ValueError("every concurrency must be in [1, 4096]")
        return list(dict.fromkeys(v))

    @field_validator("request_rate")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        if any(not 0 < r <= 100000 for r in v):
            raise ValueError("every request rate must be in (0, 100000] requests per second")
        return list(dict.fromkeys(float(r) for r in v))

    @field_validator("slo")
    @classmethod
    def _slo(cls, v: dict[str, float]) -> dict[str, float]:
        for key, limit in v.items():
            if not re.match(SLO_KEY, key):
                raise ValueError(
                    f"SLO key {key!r} is not METRIC_pP_ms with METRIC one of ttft, tpot, itl, e2e "
                    "(e.g. ttft_p99_ms, tpot_p50_ms)"
                )
            if not limit > 0:
                raise ValueError(f"SLO {key} must be a positive number of ms")
        return v

    @model_validator(mode="after")
    def _labels(self) -> SweepConfig:
        labels = [t.label for t in self.targets]
        check_gate_and_order(self, labels)
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"target labels must be unique; repeated: {', '.join(dup)}")
        if self.search is None and not self.concurrency and not self.request_rate:
            raise ValueError("give concurrency levels, request rates, or a search")
        if self.search is not None and not self.slo:
            raise ValueError("a search needs an slo, e.g. {'ttft_p99_ms': 500}")
        w = self.workload
        if 0 in self.input_lens and not w.dataset:
            raise ValueError("every input length must be in [1, 1048576] (0: a dataset's own)")
        if w.prefix_len and any(n <= w.prefix_len for n in self.input_lens):
            raise ValueError("every input length must be longer than workload.prefix_len")
        return self

    def loads(self) -> list[tuple[int, float | None]]:
        """The grid's load levels in run order: (concurrency, None) closed loop, then
        (cap or 0 for none, rate) open loop."""
        return [(c, None) for c in self.concurrency] + [
            (self.max_concurrency or 0, r) for r in self.request_rate
        ]

    def requests_in_cell(self, concurrency: int, rate: float | None = None) -> int:
        """None: enough that every stream stays busy (at least 4 per stream, at least 8), or
        about 8 seconds of arrivals (at least 16); times the turns of a conversation."""
        if self.prompts_per_cell:
            n = self.prompts_per_cell
        elif rate is not None:
            n = max(16, math.ceil(8 * rate))
        else:
            n = max(8, 4 * concurrency)
        return n * self.workload.turns

    def conversations_in_cell(self, concurrency: int, rate: float | None = None) -> int:
        return self.requests_in_cell(concurrency, rate) // self.workload.turns

    def cell_keys(self) -> list[CellKey]:
        """Every cell of the grid in run order: target by target (a started server holds the
        GPU alone). A search's cells are decided as it goes (bench/sweep/search.py)."""
        if self.search is not None:
            return []
        if self.interleave:  # ABAB: every target's cell, then the next cell
            return [
                CellKey(target=t.label, input_len=n, concurrency=c, rate=rate, repeat=r)
                for n in self.input_lens
                for c, rate in self.loads()
                for r in range(self.repeats)
                for t in self.targets
            ]
        return [
            CellKey(target=t.label, input_len=n, concurrency=c, rate=rate, repeat=r)
            for t in self.targets
            for n in self.input_lens
            for c, rate in self.loads()
            for r in range(self.repeats)
        ]


def load_name(concurrency: int, rate: float | None) -> str:
    """'c=4', 'rate=2/s', 'rate=2/s c<=8'."""
    if rate is None:
        return f"c={concurrency}"
    return f"rate={rate:g}/s" + (f" c<={concurrency}" if concurrency else "")


class CellKey(BaseModel):
    model_config = ConfigDict(frozen=True)

    target: str
    input_len: int
    concurrency: int = Field(description="closed loop: streams; open loop: the cap (0: none)")
    repeat: int
    rate: float | None = Field(None, description="open loop: requests per second offered")

    def name(self) -> str:
        load = load_name(self.concurrency, self.rate)
        return f"{self.target} in={self.input_len} {load} r={self.repeat + 1}"


class RequestResult(BaseModel):
    """One measured request, as the client saw it (times in ms from its own send)."""

    index: int = Field(description="the prompt's index in its (input length, repeat) stream")
    prompt_sha: str = Field(description="sha256 (16 hex) of the prompt as sent")
    input_tokens: int = Field(description="prompt length as sent (token ids or tokenizer count)")
    prompt_tokens: int | None = Field(None, description="prompt length the server reported")
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = Field(None, description="(e2e - ttft) / (output_tokens - 1)")
    itl_ms: list[float] = Field(default_factory=list, description="gaps between stream chunks")
    e2e_ms: float | None = None
    start_s: float = Field(0.0, description="send time, seconds after the cell began")
    scheduled_s: float | None = Field(None, description="open loop: the arrival it was due at")
    output_len: int | None = Field(None, description="max_tokens asked (drawn lengths)")
    group: int | None = Field(None, description="shared-prefix group")
    group_first: bool = Field(False, description="the first request of its group to be sent")
    turn: int = Field(0, description="the turn in its conversation (0: the first)")
    error: str | None = None
    excluded: bool = Field(False, description="warm-up: left out of the cell's figures")


class CellRecord(BaseModel):
    """One cell (target, input length, concurrency, repeat), appended to cells.jsonl when done."""

    target: str
    input_len: int
    concurrency: int
    repeat: int
    seed: int = Field(description="the prompt seed of (input length, repeat)")
    driver: Driver
    status: CellStatus
    reason: str | None = None
    started_at: str
    duration_s: float = 0.0
    n_requests: int = 0
    completed: int = 0
    failed: int = 0
    failure_reasons: dict[str, int] = Field(default_factory=dict)
    short_outputs: int = Field(0, description="completed requests with fewer than output_len")
    long_outputs: int = Field(
        0,
        description="completed requests counted with more than output_len tokens: a client's "
        "count of the text re-tokenized, not the server's (vllm bench serve against a server "
        "whose usage it does not read, such as llama-server)",
    )
    input_tokens: int = 0
    output_tokens: int = 0
    output_tok_s: float | None = None
    per_stream_tok_s: float | None = Field(None, description="1000 / median TPOT")
    req_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    rate: float | None = Field(None, description="open loop: requests per second offered")
    scheduled_rate: float | None = Field(None, description="the seeded arrivals' own rate")
    achieved_rate: float | None = Field(None, description="(n - 1) / (last send - first send)")
    slo_values: dict[str, float | None] = Field(
        default_factory=dict, description="each SLO's percentile in this cell (failures as inf)"
    )
    slo_met: bool | None = Field(None, description="every SLO percentile within its limit")
    goodput_req_s: float | None = Field(
        None, description="requests meeting every SLO per second (vLLM's request_goodput)"
    )
    slo_share: float | None = Field(None, description="share of requests meeting every SLO")
    ttft_cold_ms: float | None = Field(None, description="median TTFT, first of each prefix")
    ttft_warm_ms: float | None = Field(None, description="median TTFT, the rest of each group")
    mean_prompt_tokens: float | None = Field(None, description="as the server counted them")
    requests: list[RequestResult] = Field(default_factory=list)
    telemetry: CellTelemetry = Field(default_factory=CellTelemetry)
    cache_reset: CacheReset | None = Field(None, description="the reset before the cell")
    stall_probes: ProbeStats | None = Field(None, description="stall probes beside the load")
    excluded: int = Field(0, description="requests left out of the figures as warm-up")
    saturation: Saturation | None = Field(None, description="rate cells: over-saturation")
    probes: list[ProbeAnswer] = Field(
        default_factory=list, description="the correctness gate's answers, asked after the cell"
    )

    def key(self) -> CellKey:
        return CellKey(
            target=self.target,
            input_len=self.input_len,
            concurrency=self.concurrency,
            repeat=self.repeat,
            rate=self.rate,
        )
