"""What happens in and between a sweep's cells, as each cell records it: the cache reset before
it, the GPU's energy over it, the stall probes sent beside its load, and whether its queue
grew without bound (over-saturation); plus a rate axis stopped early. Split from
bench/sweep/models.py (which imports these into CellRecord) so that file stays small.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class CacheReset(BaseModel):
    """The target's prefix cache emptied before the cell (bench/sweep/cache_reset.py), so a
    repeat does not find the prompts of the one before it in the cache."""

    done: bool = Field(description="the server said it reset its cache")
    how: str | None = Field(None, description="the call made, e.g. 'POST /reset_prefix_cache'")
    detail: str = Field("", description="what was reset, or why not")
    ms: float | None = Field(None, description="how long the reset took")


class CellEnergy(BaseModel):
    """The GPU's energy counter (NVML nvmlDeviceGetTotalEnergyConsumption, mJ since the driver
    loaded; Volta and later) read as the cell starts and ends, reported as vLLM's
    benchmarks/lib/energy.py reports it (gpu_energy_j, gpu_avg_power_w,
    gpu_energy_per_output_token_j)."""

    gpu_index: int | None = None
    energy_j: float | None = Field(None, description="joules the GPU used over the cell")
    duration_s: float | None = Field(None, description="time between the two counter reads")
    avg_power_w: float | None = Field(None, description="energy_j / duration_s")
    j_per_output_token: float | None = Field(
        None, description="energy_j / the cell's completed output tokens"
    )
    missing: str | None = Field(None, description="'no energy: <reason>' where none was read")


class ProbeStats(BaseModel):
    """Single-token requests sent beside the cell's load at `rate` per second, outside its
    concurrency cap (bench/sweep/probes.py): what the load does to a user who arrives meanwhile."""

    rate: float
    sent: int = 0
    completed: int = 0
    failed: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    failure_reasons: dict[str, int] = Field(default_factory=dict)


class Saturation(BaseModel):
    """An open-loop cell's over-saturation check (bench/sweep/saturation.py): did completions
    keep up with arrivals, and did the requests outstanding grow over the cell."""

    saturated: bool
    reason: str | None = None
    offered_rate: float | None = Field(None, description="the cell's arrivals' own rate, req/s")
    completion_rate: float | None = Field(
        None, description="(n - 1) / (last end - first end) of the completed requests, req/s"
    )
    outstanding_slope: float | None = Field(
        None, description="requests due and not finished: the fitted growth per second"
    )
    outstanding_max: int | None = Field(None, description="most requests due and not finished")


class AxisStop(BaseModel):
    """A request-rate axis stopped early: the rate that failed, why, and the rates not run."""

    target: str
    input_len: int
    concurrency: int = Field(description="the rate cells' cap (0: none)")
    rate: float = Field(description="the rate whose cells failed the SLO or saturated")
    reason: str
    skipped: list[float] = Field(default_factory=list, description="the higher rates not run")


class CellOptions(BaseModel):
    """The sweep's options for what happens in and between cells: fields of both SweepRequest
    (the front doors' one declaration) and SweepConfig (the plan on disk)."""

    cache_reset: bool = Field(
        True,
        description="empty each target's prefix cache before every cell, so repeats compare "
        "(vLLM /reset_prefix_cache, llama-server slot erase, the engine's /reset_prefix_cache)",
    )
    probe_rate: float | None = Field(
        None,
        gt=0,
        le=100,
        description="stall probes: single-token requests per second sent beside each cell's "
        "load, outside its concurrency cap (their TTFT per cell)",
    )
    exclude_first: int = Field(
        0, ge=0, description="warm-up: leave each cell's first N requests out of its figures"
    )
    exclude_first_s: float = Field(
        0.0,
        ge=0,
        description="warm-up: leave the requests sent in each cell's first S seconds out of its "
        "figures",
    )
    saturation_stop: bool = Field(
        True,
        description="stop a request-rate axis after the first rate that misses the SLO or "
        "over-saturates (the higher rates are skipped, the reason reported)",
    )

    @model_validator(mode="after")
    def _builtin_only(self) -> CellOptions:
        driver = getattr(self, "driver", "builtin")  # SweepRequest's and SweepConfig's field
        if driver != "builtin" and (self.probe_rate or self.exclude_first or self.exclude_first_s):
            raise ValueError(
                "stall probes and warm-up exclusion need driver 'builtin' (vllm bench serve "
                "sends and times its own requests)"
            )
        return self
