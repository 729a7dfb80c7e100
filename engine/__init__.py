"""The in-process Gemma 4 engine (placeholder until the engine core lands)."""
