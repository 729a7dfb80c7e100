"""The lab: device scripts, probes and benchmarks run from a checkout (python3 -m lab.X); never packaged."""
