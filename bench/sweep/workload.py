"""A cell's jobs: what each request (or conversation) sends, the same for every target.

Every choice is seeded by (seed, input length, repeat, kind, index), so a job is the same
whichever target or cell asks for it, after a resume too:
- lengths: fixed, or drawn around the asked one (uniform, as `vllm bench serve
  --random-range-ratio`, or normal), for the prompt and for max_tokens;
- shared prefixes: the cell's jobs fall in `prefix_groups` groups by index, each group's prompts
  starting with the same `prefix_len` ids (seeded per cell slice, so no cell finds another's
  prefix in the cache); the input length is the whole prompt, prefix included;
- multi-turn: a job is a conversation of `turns` user parts; the driver sends the history
  (earlier parts and the model's answers) before each new part;
- a dataset file: text prompts and their output lengths, shuffled per repeat;
- no known vocabulary: seeded words of about the asked length (bench/sweep/vocab.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.sweep.models import CellKey, SweepConfig
from bench.sweep.prompts import DATASET, LENGTHS, PREFIX, slice_start, text_prompt, token_prompt
from bench.sweep.vocab import Codec, approx_tokens, approx_words

Prompt = list[int] | str


@dataclass
class Job:
    """One request, or one conversation of several turns (`parts`, one per turn)."""

    index: int
    parts: list[Prompt]
    output_len: int
    group: int | None = None
    lengths: list[int] = field(default_factory=list)


def draw_len(n: int, ratio: float, dist: str, rng: np.random.Generator) -> int:
    """A length around `n`: uniform in [n(1-r), n(1+r)] or normal with sd r*n; at least 1."""
    if ratio <= 0:
        return n
    if dist == "normal":
        return max(1, round(rng.normal(n, ratio * n)))
    lo, hi = max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))
    return int(rng.integers(lo, hi + 1))


@functools.lru_cache(maxsize=4)
def _dataset(path: str, _mtime_ns: int) -> tuple[tuple[str, int | None, str | None], ...]:
    return tuple(read_dataset(path))


def read_dataset(path: str | Path) -> list[tuple[str, int | None, str | None]]:
    """(prompt, output_len or None, reply text or None) per entry: ShareGPT JSON (a list of
    {"conversations": [{"from": "human", "value"}, {"from": "gpt", "value"}, ...]}, the first
    human turn and the reply after it) or JSONL of {"prompt", "output_len"}. ValueError with
    what is wrong otherwise."""
    text = Path(path).expanduser().read_text(encoding="utf-8")
    out: list[tuple[str, int | None, str | None]] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        for entry in json.loads(text):
            turns = entry.get("conversations") or entry.get("conversation") or []
            for i, turn in enumerate(turns[:-1]):
                if turn.get("from") in ("human", "user") and turns[i + 1].get("value"):
                    out.append((str(turn["value"]), None, str(turns[i + 1]["value"])))
                    break
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path} line {n}: expected {{'prompt': str, 'output_len': int}}")
            length = row.get("output_len")
            out.append((row["prompt"], int(length) if length else None, None))
    out = [e for e in out if e[0].strip()]
    if not out:
        raise ValueError(
            f"{path} holds no prompt: give ShareGPT JSON or JSONL of {{prompt, output_len}}"
        )
    return out


def dataset_entries(path: str) -> tuple[tuple[str, int | None, str | None], ...]:
    p = Path(path).expanduser()
    return _dataset(str(p), p.stat().st_mtime_ns)


def cell_slice(config: SweepConfig, key: CellKey, warmup: bool) -> tuple[int, int]:
    """(first job index, job count) of a cell in its (input length, repeat) stream."""
    if warmup:
        return 0, min(key.concurrency or 4, 4)
    per_cell = [config.conversations_in_cell(c, r) for c, r in config.loads()]
    load = (key.concurrency, key.rate)
    return slice_start(config.loads(), load, per_cell), config.conversations_in_cell(*load)


def cell_jobs(
    config: SweepConfig,
    key: CellKey,
    pool: np.ndarray | None,
    codec: Codec | None,
    as_text: bool,
    kind: int,
) -> list[Job]:
    """The cell's jobs (kind: prompts.MEASURED or WARMUP). `pool` None: no vocabulary is
    known (approximate text); `as_text`: the target takes text, made exact with `codec`."""
    from bench.sweep.prompts import WARMUP

    w = config.workload
    start, count = cell_slice(config, key, kind == WARMUP)
    n, r, seed = key.input_len, key.repeat, config.seed
    if w.dataset:
        entries = dataset_entries(w.dataset)
        order = np.random.default_rng([seed, r, DATASET, kind]).permutation(len(entries))
        jobs = []
        for i in range(start, start + count):
            prompt, out_len, reply = entries[int(order[i % len(entries)])]
            if out_len is None:
                out_len = len(codec.ids(reply)) if codec and reply else approx_tokens(reply or "")
            jobs.append(Job(index=i, parts=[prompt], output_len=max(2, out_len)))
        return jobs
    jobs = []
    for i in range(start, start + count):
        rng = np.random.default_rng([seed, n, r, LENGTHS, kind, i])
        out_len = max(2, draw_len(config.output_len, w.range_ratio, w.length_dist, rng))
        group = (i - start) % w.prefix_groups if w.prefix_len else None
        parts: list[Prompt] = []
        lengths = []
        for t in range(w.turns):
            length = draw_len(n, w.range_ratio, w.length_dist, rng)
            if group is not None and t == 0:
                length = max(length, w.prefix_len + 1)
            lengths.append(length)
            if pool is None:
                parts.append(approx_words([seed, n, r, kind, i, t], length))
                continue
            if group is not None and t == 0:
                # one prefix per group and cell slice: `start` differs per load level
                prefix = token_prompt(pool, seed, n, r, start, PREFIX, group + 1, w.prefix_len)
                ids = prefix + token_prompt(pool, seed, n, r, i, kind, t, length - w.prefix_len)
            else:
                ids = token_prompt(pool, seed, n, r, i, kind, t, length)
            if as_text:
                if codec is None:
                    raise ValueError(
                        "text prompts need the model's tokenizer: give the target a model_dir "
                        "with tokenizer.json, or serve /tokenize"
                    )
                parts.append(text_prompt(codec, ids, length))
            else:
                parts.append(ids)
        jobs.append(Job(index=i, parts=parts, output_len=out_len, group=group, lengths=lengths))
    return jobs
