"""The engine's lab scripts: kernel and end-to-end benchmarks, profiles and answer checks
(results under bench/results/engine/, read in bench/NOTES.md)."""
