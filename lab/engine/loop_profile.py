"""What the engine loop adds to its decode graphs: the GPU's timeline of `Engine.generate` under
the profiler, cut at each graph replay.

    python3 -m lab.engine.loop_profile --out $OUT/loop.json [--streams 1,8]

A sweep's time per output token at one stream is the one-row graph's replay plus whatever runs
between two replays: the staging copy of the step's inputs, the token selection, the copies into
the graph's buffers, the argmax, the copy of the tokens to the host, and any idle time while the
host catches up. `lab.engine.batch_bench` replays the graphs back to back, so it sees none of
that; this script sees all of it. For each stream count: the replays of the most common size
(the decode bucket's graph; prompt-pass graphs have other kernel counts), their period and span,
what the GPU ran between two consecutive ones (per name, per step), and the idle rest.

Kernels launched inside a graph carry the correlation id of its `cudaGraphLaunch` in the trace,
which is how they are told from the loop's own. Under the profiler the host is slower than in a
sweep (every op is recorded), so idle time here is an upper bound.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from lab.engine.decode_profile import kernel_name, trace_events
from lab.engine.e2e_bench import E2B_DIR, make

GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
EAGER_PASS = 40  # more loose GPU ops than this between two replays: a prompt read eagerly


def replays_and_between(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode replays in `events` (a Chrome trace), and what ran between consecutive ones."""
    launches = {
        e["args"]["correlation"]
        for e in events
        if e.get("name") in GRAPH_LAUNCH and "correlation" in e.get("args", {})
    }
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"]
    )
    graphs: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    loose: list[dict[str, Any]] = []
    for e in gpu:
        c = e.get("args", {}).get("correlation")
        (graphs[c] if c in launches else loose).append(e)
    if not graphs:
        return {"error": "no graph replay in the trace"}
    spans = sorted(
        (min(k["ts"] for k in ks), max(k["ts"] + k["dur"] for k in ks), len(ks))
        for ks in graphs.values()
    )
    sizes = collections.Counter(n for _, _, n in spans)
    decode = sizes.most_common(1)[0][0]
    periods, gaps, busy_between = [], [], []
    between: dict[str, list[float]] = collections.defaultdict(list)
    pairs = 0
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:], strict=False):
        if n0 != decode or n1 != decode:
            continue  # a prompt pass's graph on either side: not a plain decode period
        inside = [k for k in loose if e0 <= k["ts"] < s1]
        if len(inside) > EAGER_PASS:
            continue  # an eager prompt pass ran between: not a plain decode period
        pairs += 1
        periods.append(s1 - s0)
        gaps.append(s1 - e0)
        busy_between.append(sum(k["dur"] for k in inside))
        for k in inside:
            between[kernel_name(k["name"])].append(k["dur"])
    spans_us = [e - s for s, e, n in spans if n == decode]
    table = sorted(
        (
            {"op": name, "per_step": round(len(v) / max(pairs, 1), 2),
             "mean_us": round(statistics.fmean(v), 2), "total_per_step_us":
             round(sum(v) / max(pairs, 1), 2)}
            for name, v in between.items()
        ),
        key=lambda r: -r["total_per_step_us"],
    )  # fmt: skip
    med = statistics.median
    return {
        "replays": len(spans),
        "replays_by_kernel_count": dict(sizes.most_common()),
        "decode_kernels": decode,
        "decode_periods": pairs,
        "period_us_p50": round(med(periods), 1) if periods else None,
        "span_us_p50": round(med(spans_us), 1),
        "between_us_p50": round(med(gaps), 1) if gaps else None,
        "busy_between_us_p50": round(med(busy_between), 1) if busy_between else None,
        "between_ops": table,
    }


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [2] + [(131 * i + 17 * salt) % (vocab - 100) + 50 for i in range(n - 1)]


def profile_loop(eng, streams: int, prompt_len: int, new: int) -> dict[str, Any]:
    """`streams` requests generating `new` tokens each from `prompt_len`-token prompts (a
    staggered start, as a closed-loop client's first round), under the profiler."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new, stop_ids=())
    vocab = eng.config.vocab_size
    eng.generate(_prompt(prompt_len, 99, vocab), params)  # warm
    torch.cuda.synchronize()

    def one(j: int) -> None:
        eng.generate(_prompt(prompt_len, j, vocab), params)

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        threads = [threading.Thread(target=one, args=(j,)) for j in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        torch.cuda.synchronize()
    out = {"streams": streams, "prompt_len": prompt_len, "new_tokens": new}
    out.update(replays_and_between(trace_events(prof)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "loop.json"))
    args = ap.parse_args(argv)
    try:
        counts = [int(s) for s in args.streams.split(",") if s]
    except ValueError:
        ap.error(f"--streams takes comma-separated integers, not {args.streams!r}")
    if not counts or min(counts) < 1:
        ap.error("--streams needs at least one count of 1 or more")
    if not torch.cuda.is_available():
        print(f"{ap.prog} needs an NVIDIA GPU (none is visible to torch here)", file=sys.stderr)
        return 2
    import engine

    make(Path(args.ckpt))
    eng = engine.load(Path(args.ckpt), device="cuda", max_num_seqs=max(counts))
    res: dict[str, Any] = {"card": torch.cuda.get_device_name(0), "runs": []}
    for n in counts:
        r = profile_loop(eng, n, args.prompt_len, args.new)
        res["runs"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "between_ops"}), flush=True)
        for row in r.get("between_ops", [])[:12]:
            print(f"   {row['op']:<50} x{row['per_step']:<5} {row['total_per_step_us']:7.2f} us")
        Path(args.out).write_text(json.dumps(res, indent=1))
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
