"""How long one prompt pass takes: several prompts' chunks read together, as the scheduler packs
them, with a pass's attention in one kernel per layer (`pass_attention`) and segment by segment.

    python3 -m lab.engine.prompt_pass time --out $OUT/prompt_pass.json      (a GPU, e2b)
    TRITON_INTERPRET=1 python3 -m lab.engine.prompt_pass ops --out F.json   (the CPU, tiny)

`ops` counts what a pass launches besides the Triton kernels (torch ops that compute: not views,
nor a `.to` to the dtype a tensor already has, `_to_copy` being the real copy), and the Triton
launches, for 1 and 4 fresh segments both ways: on a GPU each such op is a kernel launch the
host pays for, whatever the model's size, so the counts say what the GPU run should save; it
runs the tiny preset on Triton's CPU interpreter.

`host` (a GPU): where a pass's host time goes, by cProfile (1 x 511, 4 x 511, 1 x 2,047, and
1 x 511 again last, in case the first shape after a load pays for something else).

`time`: for each shape (segments x tokens; the sweep's 512-token prompts arrive as 511-token
bodies, the last token going through the decode step) and each arrangement (a captured CUDA
graph where the pass fits one, engine/fast/prefill_graph.py; the one-launch attention launched
op by op; segment by segment): the median wall time of a pass
(host and GPU, synchronised), prompt tokens per second, and, under the profiler once, the
kernels launched and their summed GPU time (wall minus that is the host's share).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lab.engine.decode_profile import profiled_kernels
from lab.engine.e2e_bench import E2B_DIR, make

SHAPES = ((1, 511), (4, 511), (8, 511), (16, 127), (1, 2047), (2, 1023))


def _pass(eng, segments: int, tokens: int, seed: int) -> None:
    """One pass over fresh slots (opened, granted, read, closed)."""
    pool, reader = eng.pool, eng.runner.reader
    gen = torch.Generator().manual_seed(seed)
    slots = [pool.blocks.open_slot() for _ in range(segments)]
    try:
        grants = tuple(g for s in slots if (g := pool.blocks.grow(s, tokens + 1)) is not None)
        pool.apply(tuple(slots), grants)
        parts = []
        for s in slots:
            ids = torch.randint(3, eng.config.vocab_size, (tokens,), generator=gen)
            parts.append((ids.to(eng.device), 0, pool.view(s)))
        reader.chunks(parts)
    finally:
        for s in slots:
            pool.blocks.close_slot(s)


def time_pass(eng, segments: int, tokens: int, repeats: int = 7) -> dict[str, Any]:
    for i in range(2):
        _pass(eng, segments, tokens, i)
    torch.cuda.synchronize()
    walls = []
    for i in range(repeats):
        t0 = time.perf_counter()
        _pass(eng, segments, tokens, 10 + i)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _pass(eng, segments, tokens, 99)
        torch.cuda.synchronize()
    kernels = profiled_kernels(prof)
    wall = statistics.median(walls)
    return {"segments": segments, "tokens": tokens, "wall_ms": round(wall * 1e3, 2),
            "tok_s": round(segments * tokens / wall), "walls_ms": [round(w * 1e3, 2) for w in walls],
            "kernels": len(kernels),
            "kernel_ms": round(sum(e["dur"] for e in kernels) / 1e3, 2)}  # fmt: skip


def host_profile(eng, segments: int, tokens: int, passes: int = 5, top: int = 25) -> dict[str, Any]:
    """Where a pass's host time goes: the median wall of `passes` plain passes, then the same
    passes under cProfile, its functions by own time and by cumulative time, per pass."""
    import cProfile
    import pstats

    for i in range(2):
        _pass(eng, segments, tokens, i)
    torch.cuda.synchronize()
    walls = []
    for i in range(passes):
        t0 = time.perf_counter()
        _pass(eng, segments, tokens, 10 + i)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(passes):
        _pass(eng, segments, tokens, 20 + i)
    torch.cuda.synchronize()
    prof.disable()
    rows = []
    for (file, line, fn), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        where = f"{'/'.join(Path(file).parts[-2:])}:{line} {fn}"
        rows.append({"where": where, "calls": round(calls / passes, 1),
                     "own_ms": round(own * 1e3 / passes, 3),
                     "cum_ms": round(cum * 1e3 / passes, 3)})  # fmt: skip
    return {"segments": segments, "tokens": tokens,
            "wall_ms": round(statistics.median(walls) * 1e3, 2),
            "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top]}  # fmt: skip


def count_ops(segments: int, tokens: int = 40) -> dict[str, dict[str, Any]]:
    """Per arrangement: the torch ops that compute (views and allocations left out) outside the
    Triton kernels, and the Triton launches, of one pass of `segments` fresh prompts on the
    tiny preset (Triton's interpreter: set TRITON_INTERPRET=1 before importing Triton)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    import engine
    from engine.checkpoint_maker import make_checkpoint
    from engine.kernels import launch
    from engine.options import EngineOptions

    skip = {"view", "slice", "select", "unsqueeze", "squeeze", "permute", "transpose", "t",
            "expand", "as_strided", "reshape", "_unsafe_view", "alias", "detach", "split",
            "unbind", "narrow", "empty", "empty_like", "empty_strided", "to"}  # fmt: skip
    inside = [False]
    launches: collections.Counter[str] = collections.Counter()

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not inside[0] and name not in skip:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    real = launch.run_kernel

    def counted(kernel, grid, *a, **k):
        launches[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
        inside[0] = True
        try:
            return real(kernel, grid, *a, **k)
        finally:
            inside[0] = False

    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp) / "tiny", preset="tiny", seed=1)
        eng = engine.load(Path(tmp) / "tiny", device="cpu", max_context=256,
                          dtype=torch.float32, max_num_seqs=8, warm_up=False,
                          options=EngineOptions(fast="force", cuda_graph=False))  # fmt: skip
        mods = [m for name, m in sys.modules.items()  # every module that imported it
                if name.startswith("engine.") and getattr(m, "run_kernel", None) is real]  # fmt: skip
        for mod in mods:
            mod.run_kernel = counted
        try:
            for joint in (False, True):
                eng.runner.reader.pass_attention = joint
                launches.clear()
                mode = Ops()
                pool = eng.pool
                slots = [pool.blocks.open_slot() for _ in range(segments)]
                grants = tuple(g for s in slots if (g := pool.blocks.grow(s, tokens + 1)))
                pool.apply(tuple(slots), grants)
                parts = [(torch.randint(3, 300, (tokens,)), 0, pool.view(s)) for s in slots]
                with mode:
                    eng.runner.reader.chunks(parts)
                for s in slots:
                    pool.blocks.close_slot(s)
                out["joint" if joint else "each"] = {
                    "ops": sum(mode.ops.values()), "triton_launches": sum(launches.values()),
                    "layers_read": eng.config.first_shared_layer,
                    "most": mode.ops.most_common(10),
                }  # fmt: skip
        finally:
            for mod in mods:
                mod.run_kernel = real
            eng.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["time", "ops", "host"])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prompt_pass.json"))
    args = ap.parse_args(argv)
    if args.part == "ops":
        if os.environ.get("TRITON_INTERPRET") != "1":  # read when Triton decorates a kernel
            ap.error("ops runs the kernels on Triton's CPU interpreter: set TRITON_INTERPRET=1")
        res = {f"{n}_segments": count_ops(n) for n in (1, 4)}
        print(json.dumps(res, indent=1))
        Path(args.out).write_text(json.dumps(res, indent=1))
        return 0
    if not torch.cuda.is_available():
        print(f"{ap.prog} needs an NVIDIA GPU (none is visible to torch here)", file=sys.stderr)
        return 2
    import engine

    make(Path(args.ckpt))
    eng = engine.load(Path(args.ckpt), device="cuda", max_context=8192, max_num_seqs=16)
    reader = eng.runner.reader
    if args.part == "host":
        rows = [host_profile(eng, n, t) for n, t in ((1, 511), (4, 511), (1, 2047), (1, 511))]
        Path(args.out).write_text(json.dumps({"card": torch.cuda.get_device_name(0), "rows": rows},
                                             indent=1))  # fmt: skip
        for r in rows:
            print(r["segments"], r["tokens"], r["wall_ms"], json.dumps(r["by_cum"][:12]))
        eng.close()
        return 0
    res: dict[str, Any] = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "rows": []}  # fmt: skip
    graphs = reader.graphs if reader.graphs is not None and reader.graphs.captured else None
    res["graphs"] = graphs.buckets if graphs is not None else None
    arrangements = [("graph", True, graphs)] if graphs is not None else []
    arrangements += [("joint", True, None), ("each", False, None)]
    for segments, tokens in SHAPES:
        for name, joint, captured in arrangements:
            reader.pass_attention, reader.graphs = joint, captured
            graphed = captured is not None and segments * tokens <= captured.buckets[-1]
            row = {"arrangement": name, "pass_attention": joint, "graph_replayed": graphed,
                   **time_pass(eng, segments, tokens)}  # fmt: skip
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    reader.pass_attention, reader.graphs = True, graphs
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
