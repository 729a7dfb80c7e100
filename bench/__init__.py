"""Benchmarks: sweeps, load drivers, roofline, telemetry, reports."""
