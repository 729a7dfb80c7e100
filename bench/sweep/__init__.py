"""Benchmark sweeps: the same prompts against every target, over input lengths x concurrency x
repeats, with a roofline, telemetry and a report (see run.py for the entry points)."""

from bench.sweep.lookup import sweep_status
from bench.sweep.run import run_sweep, sweep_report

__all__ = ["run_sweep", "sweep_report", "sweep_status"]
