"""Concurrent requests on the CPU reference path: N requests decoding together against one alone.

    python3 -m lab.engine.cpu_concurrency [--requests 4] [--tokens 64] [--threads 1,2]

The reference computes a batch's rows in the same tensors (Gemma4Model.decode_rows), so N
requests should cost little more than one: issue 23's bar is 4 requests of 64 tokens in at most
2x one request on the tiny checkpoint, each with its alone tokens (checked here too). The
figure is wall time through the public API (Engine.stream, pulled), the median of `--repeats`,
the two cases interleaved so a drift of the host shows in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def run(requests: int, tokens: int, threads: int, repeats: int, prompt_len: int) -> dict:
    import torch

    import engine
    from engine.checkpoint_maker import make_checkpoint
    from engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp) / "tiny", preset="tiny", seed=0)
        eng = engine.load(Path(tmp) / "tiny", device="cpu", max_context=512,
                          max_num_seqs=requests)  # fmt: skip
    params = SamplingParams(max_tokens=tokens, stop_ids=())
    prompts = [[2] + [(7 * i + 13 * r) % 400 + 10 for i in range(prompt_len - 1)]
               for r in range(requests)]  # fmt: skip
    alone = [eng.generate(p, params) for p in prompts]  # also the warm-up
    one, many = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        eng.generate(prompts[0], params)
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gens = [eng.stream(p, params) for p in prompts]
        got = [list(g) for g in gens]
        many.append(time.perf_counter() - t0)
        assert got == alone, "a batched request's tokens differ from the request alone"
    stats = eng.stats()
    return {
        "threads": threads,
        "requests": requests,
        "tokens": tokens,
        "prompt_len": prompt_len,
        "one_s": round(statistics.median(one), 4),
        "together_s": round(statistics.median(many), 4),
        "ratio": round(statistics.median(many) / statistics.median(one), 3),
        "rows_per_step": round(stats.step_rows / max(stats.steps, 1), 2),
        "alone_tokens_equal": True,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m lab.engine.cpu_concurrency")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [run(args.requests, args.tokens, int(t), args.repeats, args.prompt_len)
            for t in args.threads.split(",")]  # fmt: skip
    for r in rows:
        print(json.dumps(r))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
