"""What telemetry records around a sweep cell (NVML samples and energy, the server's CPU and
/metrics), split from bench/sweep/models.py, which re-exports these."""

from __future__ import annotations

from pydantic import BaseModel, Field

from bench.sweep.cell_models import CellEnergy


class GpuTelemetry(BaseModel):
    """NVML samples taken a few times a second while the cell ran (GPU 0 or the given index)."""

    index: int
    name: str | None = None
    samples: int
    util_mean: float | None = None
    util_max: float | None = None
    sm_clock_mean_mhz: float | None = None
    sm_clock_max_mhz: float | None = Field(None, description="the GPU's maximum SM clock")
    clock_share: float | None = Field(None, description="mean SM clock / max SM clock")
    power_mean_w: float | None = None
    power_limit_w: float | None = None
    memory_used_max_bytes: int | None = None
    throttle: dict[str, float] = Field(
        default_factory=dict, description="throttle reason -> share of samples it was active"
    )


class CellTelemetry(BaseModel):
    gpu: GpuTelemetry | None = None
    gpu_missing: str | None = Field(None, description="why there are no GPU samples")
    server_pid: int | None = None
    server_cpu_cores: float | None = Field(
        None, description="CPU seconds of the server (and its children) / cell wall time"
    )
    cpu_missing: str | None = None
    metrics_before: dict[str, float] = Field(default_factory=dict)
    metrics_after: dict[str, float] = Field(default_factory=dict)
    prefix_cache_hit_rate: float | None = None
    kv_cache_usage: float | None = Field(None, description="peak KV cache usage (0-1)")
    requests_waiting: float | None = Field(None, description="peak requests waiting")
    requests_running: float | None = Field(None, description="peak requests running")
    decode_rows_per_step: float | None = Field(
        None, description="the engine's sequences per decode step over the cell (batching)"
    )
    decode_idle_share: float | None = Field(
        None, description="the engine's decode stream: GPU time between steps / its GPU time"
    )
    decode_starved_share: float | None = Field(
        None, description="the engine's decode steps launched after the one before had ended"
    )
    decode_idle_plain_share: float | None = Field(
        None, description="of that idle time, the share before steps admitting/ending nothing"
    )
    decode_late_host_ms: dict[str, float] | None = Field(
        None, description="per late decode step, the engine host's ms in each phase before it"
    )
    gc_ms_per_s: float | None = Field(
        None, description="the engine server's garbage-collector pauses, ms per second of cell"
    )
    engine_gc_ms_per_s: float | None = Field(
        None, description="the engine process's own collector pauses (--engine-process on), ms/s"
    )
    metrics_missing: str | None = None
    energy: CellEnergy | None = Field(
        None, description="NVML energy counter over the cell (J, W, J per output token)"
    )
