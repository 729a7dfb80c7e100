"""bring_up's pydantic models: the request, one step of the report, the report, the sweep's
summary.

Apart from the code (tools/bring_up.py) so that the front doors and bench/bring_up_sweep.py
import the shapes without the steps. Field names are a public interface: keep them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.serving.models import ServerArgs, ServerRecord, SpotCheckResult

StepName = Literal["inputs", "doctor", "turing patch", "start", "spot check", "sweep"]
STEPS: tuple[StepName, ...] = ("inputs", "doctor", "turing patch", "start", "spot check", "sweep")
StepStatus = Literal["ok", "skipped", "reused", "failed"]


class SpotCheckSpec(BaseModel):
    """One more check for the spot-check step: the answer must contain `expect` as a word."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    expect: str = Field(min_length=1, description="must appear in the answer as a whole word")


class BringUpRequest(ServerArgs):
    """What to bring up: start_vllm_server's main arguments (ServerArgs, declared once in
    tools/serving/models.py), the checks and the short sweep. Checked here, before any step
    runs, so bad input starts nothing; the MCP tool's schema and `gpurig up`'s flags are
    generated from these fields (mcp_server/request_params.py, request_flags.py)."""

    apply_patch: bool = Field(
        True,
        description="below capability 8, apply the Turing patch when vLLM is stock; false: "
        "stop there instead (with the command that applies it)",
    )
    checks: list[SpotCheckSpec] = Field(
        default_factory=list, description="more {prompt, expect} spot checks"
    )
    builtin_checks: bool = Field(True, description="391, Canberra, Au; off with no checks: skip")
    sweep: bool = Field(
        False, description="end with a short sweep (concurrency 1 and 4, one repeat)"
    )
    sweep_input_len: int = Field(512, ge=1, le=131072, description="the sweep's prompt tokens")
    sweep_output_len: int = Field(64, ge=2, le=8192, description="tokens per request")
    sweep_prompts: int = Field(8, ge=1, le=256, description="requests per concurrency level")


class Step(BaseModel):
    """One step of the report: what it found, how long it took, what to do next."""

    name: StepName
    status: StepStatus = Field(
        description="ok (done now), reused (already so: nothing redone), skipped, failed"
    )
    found: list[str] = Field(default_factory=list, description="short facts")
    seconds: float
    next: str | None = Field(
        None, description="failed: the command that fixes it; else what to do next, if anything"
    )


class SweepCell(BaseModel):
    """One concurrency level of the short sweep (one repeat)."""

    input_len: int
    concurrency: int
    status: str = Field(description="ok, partial or failed")
    output_tok_s: float | None = None
    per_stream_tok_s: float | None = Field(None, description="1000 / median TPOT")
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None
    reason: str | None = Field(None, description="why a cell failed")


class SweepSummary(BaseModel):
    """What the sweep step measured and where its files are."""

    sweep_id: str
    out_dir: str
    report: str | None = Field(None, description="REPORT.md")
    cells: list[SweepCell]
    failures: list[str] = Field(default_factory=list)


class BringUpReport(BaseModel):
    """bring_up's answer: every step in order, up to the first failure (the rest not run)."""

    status: Literal["ok", "failed"]
    failed_step: StepName | None = Field(None, description="where it stopped")
    steps: list[Step]
    server: ServerRecord | None = Field(None, description="the server, once started or reused")
    spot_check: SpotCheckResult | None = None
    sweep: SweepSummary | None = None
    next: str = Field(description="the one thing to do now")
    seconds: float
