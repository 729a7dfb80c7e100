"""The correctness gate's fixed probe set: a handful of prompts every target answers greedily
after each cell.

Token-id probes where every target takes token ids (drawn from the sweep's prompt pool, so each
id is valid for every target's vocabulary), else text probes. Both are fixed: the ids come from
a seed of their own (GATE_SEED, not the sweep's), so two sweeps over the same pool send the same
probes and their answers can be set side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.sweep.prompts import token_prompt

GATE_SEED = 53
GATE_KIND = 7  # a prompt stream of its own: never one of the measured prompts
PROBE_LEN = 16  # tokens in an id probe
PROBE_TOKENS = 32  # greedy tokens asked of each probe: enough to see a drift, cheap per cell
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "Translate to German: good morning ->",
    "1, 2, 3, 5, 8, 13,",
)


@dataclass(frozen=True)
class Probe:
    index: int
    ids: list[int] | None = None
    text: str | None = None

    def describe(self) -> str:
        if self.ids is not None:
            return f"{len(self.ids)} token ids: {self.ids[:8]}{'...' if len(self.ids) > 8 else ''}"
        return repr(self.text)

    @property
    def prompt(self) -> list[int] | str:
        return self.ids if self.ids is not None else (self.text or "")


def probe_set(pool: np.ndarray | None, as_ids: bool) -> list[Probe]:
    """The probes: ids from the pool when `as_ids` (every target takes token ids) and there is
    a pool, else the fixed texts."""
    if as_ids and pool is not None:
        return [
            Probe(i, ids=token_prompt(pool, GATE_SEED, PROBE_LEN, 0, i, GATE_KIND))
            for i in range(len(TEXTS))
        ]
    return [Probe(i, text=t) for i, t in enumerate(TEXTS)]
