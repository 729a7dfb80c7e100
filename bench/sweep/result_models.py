"""What a sweep gives back: a target's figures per cell, the summary rows, the roofline, a
search's answer, the status of a running sweep and the result of a finished one. Split from
bench/sweep/models.py (what goes in and what each cell records), which re-exports them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from bench.sweep.gate_models import GateReport

CellStatus = Literal["ok", "partial", "failed"]
VARIATION_FLAG = 0.05  # repeat-to-repeat (max - min) / median above this is flagged


class TargetCell(BaseModel):
    """One target at one (input length, concurrency): medians over its repeats."""

    target: str
    status: CellStatus
    repeats_ok: int
    output_tok_s: float | None = None
    per_stream_tok_s: float | None = None
    req_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    e2e_p50_ms: float | None = None
    variation: float | None = Field(None, description="(max - min) / median of output tok/s")
    variable: bool = Field(False, description=f"variation above {VARIATION_FLAG:.0%}")
    vs_first: float | None = Field(None, description="output tok/s over the first target's")
    reason: str | None = None
    mean: dict[str, float | None] = Field(
        default_factory=dict, description="figure -> mean over repeats"
    )
    ci95: dict[str, float | None] = Field(
        default_factory=dict, description="figure -> half-width of the 95% interval of the mean"
    )
    achieved_rate: float | None = None
    goodput_req_s: float | None = None
    slo_share: float | None = None
    slo_met: bool | None = Field(None, description="met in every repeat")
    prefix_cache_hit_rate: float | None = None
    ttft_cold_ms: float | None = None
    ttft_warm_ms: float | None = None
    gate_departs: int | None = Field(
        None, description="repeats whose probe answers departed from the reference's"
    )


class SummaryRow(BaseModel):
    input_len: int
    concurrency: int
    rate: float | None = None
    targets: list[TargetCell]
    winner: str | None = None
    ratio: float | None = Field(None, description="winner's output tok/s over the runner-up's")


class Roofline(BaseModel):
    """Bytes read per decode token from the safetensors headers, the measured read bandwidth,
    and the decode ceiling they give; a missing piece says why."""

    target: str
    model_dir: str | None = None
    bytes_per_token: int | None = None
    parts: dict[str, int] = Field(default_factory=dict, description="bytes by part")
    tensors: int = 0
    bandwidth_gb_s: float | None = None
    device: str | None = None
    ceiling_tok_s: float | None = None
    missing: str | None = Field(None, description="why the ceiling (or a part of it) is missing")
    c1_share: dict[str, float] = Field(
        default_factory=dict,
        description="input length -> concurrency-1 per-stream tok/s as a share of the ceiling",
    )


class SearchLevel(BaseModel):
    load: float
    passed: bool
    repeats: int
    values: dict[str, float | None] = Field(default_factory=dict, description="worst repeat")


class SearchAnswer(BaseModel):
    """One target at one input length: the highest load that met the SLO, and what it took."""

    target: str
    input_len: int
    axis: Literal["concurrency", "rate"]
    answer: float | None = Field(None, description="highest passing load; None: even start failed")
    first_fail: float | None = Field(None, description="lowest failing load above the answer")
    capped: bool = Field(False, description="passed up to the search's max")
    levels: list[SearchLevel] = Field(default_factory=list, description="in the order measured")
    cells: int = 0
    done: bool = False
    reason: str | None = None


class SweepStatus(BaseModel):
    sweep_id: str
    out_dir: str
    state: Literal["pending", "running", "done", "stopped"]
    worker_pid: int | None = None
    cells_total: int
    cells_done: int
    cells_failed: int
    current: str | None = None
    requests_done: int = 0
    requests_total: int = 0
    elapsed_s: float | None = None
    eta_s: float | None = Field(None, description="estimated seconds left")
    message: str = ""
    report: str | None = None


class SweepResult(BaseModel):
    """What run_sweep returns: where everything is, and the main table."""

    sweep_id: str
    out_dir: str
    state: Literal["pending", "running", "done", "stopped"]
    report: str | None = None
    results_json: str | None = None
    results_csv: str | None = None
    plots: list[str] = Field(default_factory=list)
    plots_dir: str | None = Field(None, description="where the PNG plots are (out_dir/plots)")
    plot_note: str | None = Field(None, description="why there are no plots")
    summary: list[SummaryRow] = Field(default_factory=list)
    search: list[SearchAnswer] = Field(default_factory=list)
    roofline: list[Roofline] = Field(default_factory=list)
    failures: list[str] = Field(default_factory=list, description="target: reason, per cause")
    table: str = Field("", description="the main table, as in REPORT.md")
    gate: GateReport | None = Field(None, description="the correctness gate, per cell")
    status: SweepStatus | None = None
