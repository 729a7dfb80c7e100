"""The engine's lab scripts: kernel and end-to-end benchmarks, profiles and answer checks
(the figures they gave are in docs/engine-findings.md; the journal is lab/journal.md)."""
