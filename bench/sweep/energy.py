"""The GPU's energy over a cell, from NVML's energy counter, as vLLM's benchmarks/lib/energy.py
measures it: `nvmlDeviceGetTotalEnergyConsumption` (millijoules since the driver loaded, Volta
and later) read when the cell starts and when it ends; joules = the difference, average power =
joules over the time between the reads, joules per output token over the cell's completed
output tokens. A counter that went backwards (a driver reload) gives no figure, as in vLLM.
Sampled power (bench/sweep/telemetry.py) misses what happens between samples; the counter
does not.
"""

from __future__ import annotations

import time
from typing import Any

from bench.sweep.cell_models import CellEnergy

NO_COUNTER = "this GPU has no energy counter (NVML's total energy needs Volta or later)"


def no_energy(reason: str | None) -> CellEnergy:
    return CellEnergy(missing=f"no energy: {reason or 'NVML not started'}")


class EnergyMeter:
    """The counter of one GPU, read at `start()` and `stop()`; `nvml` is the pynvml module (or
    a stand-in with the same functions)."""

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self.nvml, self.handle, self.index = nvml, handle, index
        self._mj0: int | None = None
        self._t0 = 0.0
        self.missing: str | None = None

    def start(self) -> None:
        try:
            self._mj0 = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception as exc:  # NVMLError_NotSupported before Volta
            self.missing = f"{NO_COUNTER}: {exc}"
            return
        self._t0 = time.perf_counter()

    def stop(self) -> CellEnergy:
        if self._mj0 is None:
            return no_energy(self.missing)
        duration = time.perf_counter() - self._t0
        try:
            mj1 = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception as exc:
            return no_energy(f"the energy counter could not be read at the cell's end: {exc}")
        delta = mj1 - self._mj0
        if delta < 0:
            return no_energy("the GPU's energy counter went backwards (reset) during the cell")
        joules = delta / 1000.0
        return CellEnergy(
            gpu_index=self.index,
            energy_j=round(joules, 3),
            duration_s=round(duration, 4),
            avg_power_w=round(joules / duration, 2) if duration > 0 else None,
        )


def per_token(energy: CellEnergy | None, output_tokens: int) -> CellEnergy | None:
    """The cell's energy with joules per completed output token filled in."""
    if energy is not None and energy.energy_j is not None and output_tokens > 0:
        energy.j_per_output_token = round(energy.energy_j / output_tokens, 5)
    return energy
