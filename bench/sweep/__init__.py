"""Benchmark sweeps: the same prompts against every target, over input lengths x concurrency x
repeats, with a roofline, telemetry and a report (see run.py for the entry points).

The entry points are imported on first use: `gpurig`'s command line imports this package's
argument helpers (progress.py) for its parser, and every `gpurig` start paid a third of a second
for the sweep's machinery, `gpurig engine serve` before it could start its engine process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.sweep.lookup import sweep_status
    from bench.sweep.run import run_sweep, sweep_report

__all__ = ["run_sweep", "sweep_report", "sweep_status"]


def __getattr__(name: str) -> Any:
    if name == "sweep_status":
        from bench.sweep.lookup import sweep_status

        return sweep_status
    if name in ("run_sweep", "sweep_report"):
        from bench.sweep import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
