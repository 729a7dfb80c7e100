"""The recall test: numbered records, each with a random six-digit code, filling a chosen number
of tokens, and the question asking for the code of the record a quarter of the way in.

Why this shape: the answer is one fact at a known depth of a long prompt, so a server whose
attention, KV cache or context handling is off at length gets it wrong while the short suites
still pass; random codes cannot be guessed or known from pre-training. The questions are
generated once from the seed, sized with server a's own tokenizer (/tokenize), and saved with
the run, so both servers (and a resumed run) get the very same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bench.eval.models import Question

HEADER = "Below are numbered records, each with a six-digit code. Read them carefully.\n\n"
PROBE_RECORDS = 64
DEFAULT_QUESTIONS = 8

TokenCounter = Callable[[list[dict[str, str]]], int]


def _records(rng: random.Random, n: int) -> list[str]:
    return [f"record {k:05d}: code {rng.randrange(100_000, 1_000_000)}" for k in range(1, n + 1)]


def _messages(records: list[str], target: int) -> list[dict[str, str]]:
    ask = f"\nWhat is the code of record {target:05d}? Reply with the six digits of its code only."
    return [{"role": "user", "content": HEADER + "\n".join(records) + "\n" + ask}]


def records_for(tokens: int, count: TokenCounter) -> int:
    """How many records make a prompt of about `tokens` tokens: the header's cost and one
    record's, measured once on a probe prompt (codes are random, their token counts close)."""
    rng = random.Random(0)
    bare = count(_messages([], 1))
    probe = count(_messages(_records(rng, PROBE_RECORDS), 1))
    per_record = max(1e-6, (probe - bare) / PROBE_RECORDS)
    return max(4, int((tokens - bare) / per_record))


def load(tokens: int, questions: int, seed: int, count: TokenCounter) -> list[Question]:
    """`questions` prompts of about `tokens` tokens each, question i from random seed (seed, i)."""
    n = records_for(tokens, count)
    target = max(1, n // 4)
    out = []
    for i in range(questions):
        rng = random.Random(f"gpurig-recall-{seed}-{i}")
        records = _records(rng, n)
        code = records[target - 1].rsplit(" ", 1)[1]
        out.append(
            Question(
                id=f"recall-{tokens}-{i:03d}",
                messages=_messages(records, target),
                answer=code,
                scoring="last_number",
            )
        )
    return out
