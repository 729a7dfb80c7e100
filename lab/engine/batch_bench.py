"""Continuous batching in process on the GPU: throughput by concurrency, the GPU time of each
batch bucket's step, a request joining 15 decoding ones, and 8 long streams under a 4 GB cap.

    python3 -m lab.engine.batch_bench all --out $OUT/batch.json [--ckpt /tmp/gpurig_e2b_emb4]
    python3 -m lab.engine.batch_bench capped --ckpt DIR --json x   # a fresh capped process
    python3 -m lab.engine.batch_bench closed --conc 8,16 --rounds 4 --out x.json
    python3 -m lab.engine.batch_bench alone --conc 8,16 --rounds 4 --out x.json

What it measures, on the e2b preset's random weights (4-bit linears and embedding tables):
* `Engine.stream` from c threads at once (c = 1, 4, 8, 16), input 512, 128 tokens each, greedy,
  no stop ids (`closed`: each thread --rounds requests in a row, so requests arrive while the
  others decode, with the late steps' host phases: the sweep's loop without the server;
  `alone`: the same requests from the one thread that steps the engine): aggregate tok/s (all tokens / wall time from the first submit to the last token),
  per-stream tok/s (each stream's tokens after its first / its decode time), TTFT;
* each bucket's graph replayed back to back (CUDA events): the GPU time of one step of B rows,
  on the rows it last ran (little attention), and with B sequences `--depth` tokens deep;
* 15 streams decoding, then a 16th arrives with a 512-token prompt: its time to first token;
* greedy identity on the GPU: fp32 e2b-shaped tokens of 16 requests in one batch against each
  alone, and bf16's agreement (bf16 rows sum in another order in a batch than alone);
* a fresh process capped at 3,732 MiB: the pool's size, then 8 streams of 3,968 + 128 tokens.
The HTTP figures (the server, the sweep's driver) come from lab/sweep_e2b.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from engine.sampling import SamplingParams

E2B_DIR = Path(os.environ.get("GPURIG_BENCH_CKPT", "/tmp/gpurig_e2b_emb4"))


def make(ckpt: Path) -> None:
    if (ckpt / "config.json").is_file():
        return
    from engine.checkpoint_maker import make_checkpoint

    make_checkpoint(ckpt, preset="e2b", seed=0, emb4=True)


def prompt(n: int, salt: int) -> list[int]:
    return [2] + [(7919 * (i + 1) + 104729 * salt) % 200000 + 1000 for i in range(n - 1)]


def load(ckpt: Path, **kw: Any):
    import engine

    return engine.load(ckpt, device="cuda", options=engine.EngineOptions.from_env(), **kw)


def concurrent(eng, conc: int, input_len: int, output_len: int, salt: int = 0,
               rounds: int = 1) -> dict[str, Any]:  # fmt: skip
    """c streams at once; each thread reads its own Generation to the end, `rounds` requests
    one after another (a closed loop: after the first round, requests arrive while the others
    decode, as in the sweep, with no server in the process)."""
    gens: list[Any] = []
    done: list[float] = [0.0] * conc
    barrier = threading.Barrier(conc + 1)

    def run(i: int) -> None:
        barrier.wait()
        for r in range(rounds):
            gen = eng.stream(
                prompt(input_len, salt * 100 + i + 1000 * r),
                SamplingParams(max_tokens=output_len, stop_ids=()),
            )
            gens.append(gen)
            for _ in gen:
                pass
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    clock0 = eng.runner.clock.times()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = max(done) - t0
    tokens = sum(g.completion_tokens for g in gens)
    shape = {"concurrency": conc, "rounds": rounds, "input_len": input_len,
             "output_len": output_len}  # fmt: skip
    return _closed_result(eng, shape, tokens, wall, [g.timings for g in gens], clock0)


def _closed_result(eng, shape: dict[str, int], tokens: int, wall: float, timings: list[Any],
                   clock0: Any) -> dict[str, Any]:  # fmt: skip
    """A closed loop's figures: its shape, throughput, per-stream rates and TTFT from the
    requests' timings (engine.generation.Timings), and the decode stream's clock since clock0
    (engine/step_clock.py: its GPU time between steps, the late steps' host phases)."""
    per_stream = [t.decode_tokens_per_s or 0.0 for t in timings]
    ttft = [t.time_to_first_token * 1000 for t in timings]
    clock1 = eng.runner.clock.times()
    return {
        **shape,
        "tokens": tokens,
        "wall_s": round(wall, 4),
        "aggregate_tok_s": round(tokens / wall, 1),
        "per_stream_tok_s_median": round(statistics.median(per_stream), 1),
        "ttft_ms_median": round(statistics.median(ttft), 1),
        "ttft_ms_max": round(max(ttft), 1),
        "decode_idle_share": _idle_share(clock0, clock1),
        **_late_steps(clock0, clock1),
    }


def alone(eng, conc: int, input_len: int, output_len: int, salt: int = 0,
          rounds: int = 1) -> dict[str, Any]:  # fmt: skip
    """The same closed loop with one thread in the process: it steps the engine and sends each
    stream's next request when its last one ends (what an engine process of its own would see:
    no consumer or server thread wants the interpreter while it launches). `concurrent`'s
    consumer threads each step the engine when their stream has nothing to read, so they
    compete for its lock and the interpreter."""
    params = SamplingParams(max_tokens=output_len, stop_ids=())
    made: dict[int, int] = {}
    seqs: list[Any] = []
    ended: list[int] = []  # streams whose request ended in the last step

    def submit(i: int, r: int) -> None:
        def sink(seq, out) -> None:
            made[id(seq)] = made.get(id(seq), 0) + len(out.tokens)
            if out.finished:
                seq.ended_at = seq.ended_at or time.perf_counter()
                ended.append(i)

        p = prompt(input_len, salt * 100 + i + 1000 * r)
        seqs.append(eng.add_request(p, params, sink))

    sent = [1] * conc
    clock0 = eng.runner.clock.times()
    t0 = time.perf_counter()
    for i in range(conc):
        submit(i, 0)
    while eng.has_work or ended:
        for i in ended:
            if sent[i] < rounds:
                submit(i, sent[i])
                sent[i] += 1
        ended.clear()
        if eng.has_work:
            eng.step()
    wall = time.perf_counter() - t0
    from engine.generation import Timings

    timings = [Timings.of(s, made.get(id(s), 0)) for s in seqs]
    shape = {"concurrency": conc, "rounds": rounds, "input_len": input_len,
             "output_len": output_len}  # fmt: skip
    return _closed_result(eng, shape, sum(made.values()), wall, timings, clock0)


def _late_steps(before, after) -> dict[str, Any]:
    """The steps launched after their predecessor ended, and the host's mean milliseconds
    before one, per phase (engine/step_clock.py HOST_PHASES)."""
    from engine.step_clock import HOST_PHASES

    moved = after.since(before)
    late, timed = moved.starved_steps, moved.late_timed
    return {
        "late_step_share": round(late / moved.timed_steps, 4) if moved.timed_steps else None,
        "late_host_ms": {name: round(ms / timed if timed else 0.0, 3)
                         for name, ms in zip(HOST_PHASES, moved.late_host_ms, strict=True)},
    }  # fmt: skip


def _idle_share(before, after) -> float | None:
    moved = after.since(before)
    return round(moved.idle_share, 4) if moved.busy_ms > 0 else None


def replay_us(graph, iters: int) -> float:
    """Mean microseconds of one replay of `graph`, replayed back to back (CUDA events)."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def bucket_times(eng, iters: int = 50) -> list[dict[str, Any]]:
    """GPU time of one step per bucket: its graph replayed back to back on the rows it last
    ran (the capture's padding rows, or the warm-up's short sequences): the step without
    attention work to speak of."""
    graphs = eng.runner.graphs
    out = []
    if graphs is None:
        return out
    for b in graphs.buckets:
        bucket = graphs._by_size[b]
        if bucket.graph is None:
            continue
        us = replay_us(bucket.graph, iters)
        out.append(
            {"rows": b, "step_us": round(us, 1), "tok_s_at_full_bucket": round(b * 1e6 / us)}
        )
    return out


def replay_us_at_depth(eng, rows: int, depth: int, iters: int = 50) -> float:
    """Mean microseconds of one replay of the `rows` bucket's step graph with every row a
    sequence of its own `depth` tokens deep (random keys)."""
    from lab.engine.rows import fill_rows, held_rows

    graphs = eng.runner.graphs
    with held_rows(eng, rows, depth + 8) as slots, torch.no_grad():
        fill_rows(eng, slots, depth)
        tokens = torch.full((rows,), 7, dtype=torch.int64, device=eng.device)
        positions = torch.full((rows,), depth, dtype=torch.int64, device=eng.device)
        graphs.run(tokens, positions, slots)  # stages these rows in the bucket's inputs
        return replay_us(graphs._by_size[rows].graph, iters)


def bucket_times_at_depth(eng, depth: int, iters: int = 50) -> list[dict[str, Any]]:
    """GPU time of one step per bucket with every row a sequence of its own `depth` tokens
    deep (random keys): the attention a sweep's steps do (input 512 and 128 new tokens: 512 to
    640), which `bucket_times` leaves out (how much: bench/NOTES.md v22)."""
    graphs = eng.runner.graphs
    out: list[dict[str, Any]] = []
    if graphs is None:
        return out
    for b in graphs.buckets:
        if b > eng.max_num_seqs or graphs._by_size[b].graph is None:
            continue
        us = replay_us_at_depth(eng, b, depth, iters)
        out.append({"rows": b, "depth": depth, "step_us": round(us, 1),
                    "tok_s_at_full_bucket": round(b * 1e6 / us)})  # fmt: skip
    return out


def join_ttft(eng, decoding: int = 15, input_len: int = 512) -> dict[str, Any]:
    """`decoding` streams of long outputs run; then one more arrives: its time to first token."""
    stop = threading.Event()
    gens = []

    def background(i: int) -> None:
        gen = eng.stream(prompt(64, 500 + i), SamplingParams(max_tokens=4000, stop_ids=()))
        gens.append(gen)
        for _ in gen:
            if stop.is_set():
                break
        gen.close()

    threads = [threading.Thread(target=background, args=(i,)) for i in range(decoding)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while eng.scheduler.stats().last_step_rows < decoding and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # steady decoding
    samples = []
    for k in range(5):
        gen = eng.stream(prompt(input_len, 900 + k), SamplingParams(max_tokens=4, stop_ids=()))
        next(gen)
        samples.append(gen.timings.time_to_first_token * 1000)
        gen.close()
        time.sleep(0.1)
    rows = eng.scheduler.stats().last_step_rows
    stop.set()
    for t in threads:
        t.join()
    return {
        "decoding": decoding,
        "input_len": input_len,
        "ttft_ms": [round(s, 1) for s in samples],
        "ttft_ms_median": round(statistics.median(samples), 1),
        "rows_in_last_step": rows,
    }


def identity(ckpt: Path, dtypes=(torch.float32, torch.bfloat16)) -> dict[str, Any]:
    """16 requests of different lengths in one batch vs each alone: fp32 (equal) and bf16."""
    import engine

    out: dict[str, Any] = {}
    specs = [(17 + 29 * i, 24 + (i % 5) * 8) for i in range(16)]
    for dtype in dtypes:
        single = engine.load(ckpt, device="cuda", max_context=4096, dtype=dtype)
        alone = [single.generate(prompt(n, 300 + i), SamplingParams(max_tokens=m, stop_ids=())) for i, (n, m) in
                 enumerate(specs)]  # fmt: skip
        del single
        torch.cuda.empty_cache()
        multi = engine.load(ckpt, device="cuda", max_context=4096, dtype=dtype, max_num_seqs=16)
        got: list[Any] = [None] * len(specs)

        def run(i: int, multi=multi, got=got) -> None:
            time.sleep(0.003 * i)
            got[i] = multi.generate(
                prompt(specs[i][0], 300 + i), SamplingParams(max_tokens=specs[i][1], stop_ids=())
            )

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = multi.scheduler.stats()
        multi.close()
        del multi
        torch.cuda.empty_cache()
        same = [a == b for a, b in zip(alone, got, strict=True)]
        agree = [
            next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(alone, got, strict=True)
        ]
        out[str(dtype).removeprefix("torch.")] = {
            "requests": len(specs),
            "identical": sum(same),
            "first_difference_at": agree,
            "tokens_per_step_avg": round(st.step_rows / max(st.steps, 1), 2),
        }
    return out


def capped(ckpt: Path) -> dict[str, Any]:
    """In this (fresh) process: a 3,732 MiB cap, 8 streams of 3,968 prompt + 128 new tokens."""
    t0 = time.perf_counter()
    eng = load(ckpt, max_context=4096, memory_cap_mib=3732, max_num_seqs=8)
    from engine.batching import kv_cache_line

    line = kv_cache_line(eng.batching, eng.pool.nbytes())
    loaded = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    res = concurrent(eng, 8, 3968, 128, salt=7)
    res.update(
        {
            "kv_cache_line": line,
            "kv_cache_tokens": eng.pool.geometry.token_capacity,
            "max_num_seqs": eng.batching.max_num_seqs,
            "load_s": round(loaded, 1),
            "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20),
            "reserved_mib": round(torch.cuda.memory_reserved() / 2**20),
        }
    )
    eng.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["all", "throughput", "closed", "alone", "identity", "capped"])
    ap.add_argument("--ckpt", type=Path, default=E2B_DIR)
    ap.add_argument("--out", type=Path, help="JSON file for everything")
    ap.add_argument("--json", type=Path, help="(capped) where the child writes its result")
    ap.add_argument("--conc", default="1,4,8,16")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="(closed) requests per stream")
    ap.add_argument(
        "--depth",
        type=int,
        default=600,
        help="(throughput) tokens each row already holds in the steps timed at depth",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16", help="(identity) compute dtypes")
    args = ap.parse_args(argv)
    make(args.ckpt)
    if args.what == "capped":
        result: dict[str, Any] = capped(args.ckpt)
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text)
        print(text)
        return 0
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.what in ("closed", "alone"):  # the concurrency runs only, closed loops of --rounds
        eng = load(args.ckpt, max_context=8192, max_num_seqs=16)
        loop = concurrent if args.what == "closed" else alone
        loop(eng, 2, 64, 8)  # warm the paths once
        loop(eng, 16, 64, 8)
        result[args.what] = [
            loop(eng, int(c), args.input_len, args.output_len, salt=k, rounds=args.rounds)
            for k, c in enumerate(args.conc.split(","))
        ]
        eng.close()
    if args.what in ("all", "throughput"):
        t0 = time.perf_counter()
        eng = load(args.ckpt, max_context=8192, max_num_seqs=16)
        result["load_and_capture_s"] = round(time.perf_counter() - t0, 1)
        from engine.batching import kv_cache_line

        result["kv_cache_line"] = kv_cache_line(eng.batching, eng.pool.nbytes())
        concurrent(eng, 2, 64, 8)  # warm the paths once
        result["buckets"] = bucket_times(eng)
        result["buckets_at_depth"] = bucket_times_at_depth(eng, args.depth)
        result["concurrency"] = [
            concurrent(eng, int(c), args.input_len, args.output_len, salt=k)
            for k, c in enumerate(args.conc.split(","))
        ]
        result["join"] = join_ttft(eng)
        eng.close()
        del eng
        torch.cuda.empty_cache()
        print(json.dumps(result, indent=2), flush=True)
    if args.what in ("all", "identity"):
        dtypes = tuple(getattr(torch, name) for name in args.dtypes.split(","))
        result["identity"] = identity(args.ckpt, dtypes)
        print(json.dumps(result["identity"], indent=2), flush=True)
    if args.what == "all":
        child = args.out.with_suffix(".capped.json") if args.out else Path("/tmp/capped.json")
        proc = subprocess.run(
            [sys.executable, "-m", "lab.engine.batch_bench", "capped", "--ckpt",
             str(args.ckpt), "--json", str(child)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        result["capped"] = (
            json.loads(child.read_text()) if proc.returncode == 0 and child.is_file()
            else {"failed": proc.stderr[-3000:]}
        )  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
