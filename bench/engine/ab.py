"""Same-run A/B of two engine trees (a commit before a refactor and this tree after it): one
fresh process per side and round, the sides alternating (before, after, before, after), so
drift in the host's speed shows as spread within a side, not as a difference between them.

    git worktree add .carry/before a33c241          # an ignored folder: carry it to the device
    python3 -m bench.engine.ab --before .carry/before --out $OUT/ab.json        # E2B on CUDA
    python3 -m bench.engine.ab --before .carry/before --preset tiny --device cpu \\
        --depths 0,256,1024 --batch-depth 64 --prompt 512 --long 3000    # the CPU check

Each side runs through its own fastest path, an adapter chosen by what its `engine` module
has (`engine.EngineConfig`: the one-design engine of issue 23; else the older two-mode one):

decode      decode tok/s at 1 row at each depth: the side's decode step replayed back to back
            with the KV filled with random keys up to that depth (old: `eng.backend.step()`
            over `eng.cache`; new: `eng.runner.step(tokens, positions, slots)` over a pool slot
            granted the blocks that cover the depth). A depth past the context is clamped to
            it (E2B's 131,072 positions: depth 131,072 runs at 131,072 - steps - 1).
batch       decode tok/s at 8 and 16 rows at `--batch-depth` (old: loaded with max_num_seqs=16,
            `eng.scheduler.runner.step`; new: `eng.runner.step` with max_num_seqs=16).
e2e         end-to-end generate tok/s at 1 row through the public API (a 16-token prompt,
            `--e2e-tokens` new tokens, no stop ids): the host overhead of each side's loop.
prompt      time to first token of a `--prompt`-token prompt (generate 1 token).
long        a `--long`-token prompt under `--cap` MiB with max_context `--long-context`
            (time to first token, torch.cuda.max_memory_allocated): once per side, in its own
            process (the cap is per process).
identity    fp32 greedy tokens: the fast path's equal the reference's (EngineOptions(fast=
            "off")) on each side and equal between sides; 16 requests of different lengths
            decoding together (max_num_seqs=16) each equal to the same request alone.

Summary: per metric the best of each side over the rounds, `after_vs_before_pct`, and the
issue's bar (no regression beyond `--bar` %: tok/s may fall, seconds may rise, by at most it;
the capped prompt must fit on both sides). `--only decode,batch` runs a subset. Each side
imports only its own tree: nothing of this tree's bench or engine reaches the other side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]  # this tree's root
METRICS = ("decode", "batch", "e2e", "prompt", "long", "identity")
ONCE = ("long", "identity")  # run in the first round only (the costly ones)
STEPS = 64  # decode steps timed per measurement
WARM = 3  # steps before timing (capture, tuning)


# ---- the two engine APIs -----------------------------------------------------------------------
class NewAPI:
    """The one-design engine (issue 23): EngineConfig, SamplingParams, a pool for every caller."""

    name = "new"

    def __init__(self, engine) -> None:
        self.engine = engine

    def load(self, ckpt: Path, **fields: Any):
        return self.engine.load(ckpt, self.engine.EngineConfig(**fields))

    def generate(self, eng, ids: list[int], n: int) -> list[int]:
        return eng.generate(ids, self.engine.SamplingParams(max_tokens=n, stop_ids=()))

    def load_batching(self, ckpt: Path, rows: int, **fields: Any):
        return self.load(ckpt, max_num_seqs=rows, **fields)

    def rows_step(self, eng, rows: int, tokens: int):
        """`rows` pool slots holding positions 0..tokens-1 and the runner's step over them."""
        pool = eng.pool
        slots = [pool.blocks.open_slot() for _ in range(rows)]
        grants = tuple(g for s in slots if (g := pool.blocks.grow(s, tokens)) is not None)
        pool.apply(tuple(slots), grants)
        return pool, slots, eng.runner.step

    def release(self, eng, slots: list[int]) -> None:
        for s in slots:
            eng.pool.blocks.close_slot(s)

    def generate_together(self, eng, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Every prompt queued at once, then the engine stepped until all are done."""
        out: dict[int, list[int]] = {}

        def sink(seq, output) -> None:
            out.setdefault(seq.id, []).extend(output.tokens)

        params = self.engine.SamplingParams(max_tokens=n, stop_ids=())
        seqs = [eng.add_request(p, params, sink) for p in prompts]
        while eng.step():
            pass
        return [out.get(s.id, []) for s in seqs]

    def close(self, eng) -> None:
        eng.close()


class OldAPI:
    """The engine before issue 23: `generate(ids, n, stop_ids=[])`, a KVCache and
    `eng.backend.step()` when loaded without max_num_seqs, else a pool and a scheduler thread
    whose BatchRunner steps rows."""

    name = "old"

    def __init__(self, engine) -> None:
        self.engine = engine

    def load(self, ckpt: Path, **fields: Any):
        return self.engine.load(ckpt, **fields)

    def generate(self, eng, ids: list[int], n: int) -> list[int]:
        return eng.generate(ids, n, stop_ids=[])

    def load_batching(self, ckpt: Path, rows: int, **fields: Any):
        return self.load(ckpt, max_num_seqs=rows, **fields)

    def rows_step(self, eng, rows: int, tokens: int):
        pool = eng.pool
        slots = [pool.open_slot() for _ in range(rows)]
        for s in slots:
            if not pool.grow(s, tokens):
                raise RuntimeError(f"the pool does not hold {rows} x {tokens} tokens")
        return pool, slots, eng.scheduler.runner.step

    def release(self, eng, slots: list[int]) -> None:
        for s in slots:
            eng.pool.close_slot(s)

    def generate_together(self, eng, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Every stream opened at once (the scheduler's thread decodes them together)."""
        gens = [eng.stream(p, n, stop_ids=[]) for p in prompts]
        return [list(g) for g in gens]

    def close(self, eng) -> None:
        eng.close()


def api_of(engine) -> NewAPI | OldAPI:
    return NewAPI(engine) if hasattr(engine, "EngineConfig") else OldAPI(engine)


# ---- filling the KV with random keys -----------------------------------------------------------
def _fill(k, v, pos, rows, positions, gen) -> None:
    """Random K/V into `rows` (recorded as holding `positions`), in pieces."""
    import torch

    for i in range(0, positions.numel(), 8192):
        r, p = rows[i : i + 8192], positions[i : i + 8192]
        shape = (p.numel(), *k.shape[1:])
        k[r] = torch.randn(shape, device=k.device, generator=gen).to(k.dtype)
        v[r] = torch.randn(shape, device=v.device, generator=gen).to(v.dtype)
        pos[r] = p


def fill_cache(cache, depth: int, device) -> None:
    """An old KVCache as if positions 0..depth-1 had been read (decode cost depends on how many
    slots are read, not on what they hold)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(depth)
    for layer in cache.layers.values():
        layer.pos.fill_(-1)
        if depth == 0:
            continue
        if layer.window is None:
            positions = torch.arange(min(depth, layer.slots), device=device)
            slots = positions
        else:
            positions = torch.arange(max(0, depth - layer.slots), depth, device=device)
            slots = positions % layer.slots
        _fill(layer.k, layer.v, layer.pos, slots, positions, gen)


def fill_pool(pool, cfg, slots: list[int], depth: int) -> None:
    """Pool slots (both trees' KVPool: full layers in blocks, sliding layers in a ring of
    `ring_slots` rows per slot) as if each had read positions 0..depth-1."""
    import torch

    gen = torch.Generator(device=pool.device).manual_seed(depth)
    r = pool.ring_slots
    for slot in slots:
        for i in pool.k:
            if cfg.is_sliding(i):
                pool.pos[i][slot * r : (slot + 1) * r].fill_(-1)
                positions = torch.arange(max(0, depth - r), depth, device=pool.device)
                rows = slot * r + positions % r
            else:
                positions = torch.arange(depth, device=pool.device)
                rows = pool.rows_of(slot, positions)
            if depth:
                _fill(pool.k[i], pool.v[i], pool.pos[i], rows, positions, gen)


# ---- one side ----------------------------------------------------------------------------------
class Side:
    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        sys.path.insert(0, str(root))
        import torch

        import engine

        self.torch = torch
        self.api = api_of(engine)
        self.args = args
        self.ckpt = args.ckpt
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.out: dict[str, Any] = {"root": str(root), "engine_file": engine.__file__,
                                    "api": self.api.name}  # fmt: skip

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def limit(self) -> int:
        cfg = json.loads((self.ckpt / "config.json").read_text())
        return int(cfg.get("text_config", cfg)["max_position_embeddings"])

    def timed_steps(self, step, tokens, positions) -> float:
        """tok/s of STEPS steps of `step(tokens, positions)` back to back, after WARM steps."""
        with self.torch.no_grad():
            for _ in range(WARM):
                step(tokens, positions)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                tokens = step(tokens, positions).argmax(-1)
                positions += 1
            self.sync()
        return tokens.numel() * STEPS / (time.perf_counter() - t0)

    def decode(self) -> None:
        torch, api = self.torch, self.api
        ctx = min(self.limit(), max(self.args.depths) + STEPS + WARM + 1)
        eng = api.load(self.ckpt, device=self.device, max_context=ctx)
        for depth in self.args.depths:
            d = min(depth, ctx - STEPS - WARM - 1)
            tok = torch.tensor([7], device=eng.device)
            pos = torch.tensor([d], device=eng.device)
            if isinstance(api, OldAPI):
                fill_cache(eng.cache, d, eng.device)
                rate = self.timed_steps(eng.backend.step(), tok, pos)
            else:
                pool, slots, step = api.rows_step(eng, 1, ctx)
                fill_pool(pool, eng.config, slots, d)
                s = torch.tensor(slots, dtype=torch.int32, device=eng.device)
                rate = self.timed_steps(lambda t, p, step=step, s=s: step(t, p, s), tok, pos)
                api.release(eng, slots)
            self.out[f"decode_1row_depth_{depth}_tok_per_s"] = rate
            if d != depth:
                self.out[f"decode_1row_depth_{depth}_measured_at"] = d
        self.out["_engine"] = eng  # reused by e2e / prompt when they run in this process

    def batch(self) -> None:
        torch, api = self.torch, self.api
        depth = self.args.batch_depth
        rows_list = self.args.rows
        ctx = depth + STEPS + WARM + 64
        eng = api.load_batching(self.ckpt, max(rows_list), device=self.device, max_context=ctx)
        for rows in rows_list:
            pool, slots, step = api.rows_step(eng, rows, ctx)
            fill_pool(pool, eng.config, slots, depth)
            tok = torch.full((rows,), 7, dtype=torch.int64, device=eng.device)
            pos = torch.full((rows,), depth, dtype=torch.int64, device=eng.device)
            s = torch.tensor(slots, dtype=torch.int32, device=eng.device)
            rate = self.timed_steps(lambda t, p, step=step, s=s: step(t, p, s), tok, pos)
            api.release(eng, slots)
            self.out[f"decode_{rows}rows_depth_{depth}_tok_per_s"] = rate
        api.close(eng)

    def _plain_engine(self):
        eng = self.out.pop("_engine", None)
        if eng is None:
            ctx = min(self.limit(), self.args.prompt + 256)
            eng = self.api.load(self.ckpt, device=self.device, max_context=ctx)
        return eng

    def prompt_ids(self, n: int) -> list[int]:
        torch = self.torch
        cfg = json.loads((self.ckpt / "config.json").read_text())
        vocab = int(cfg.get("text_config", cfg)["vocab_size"])
        gen = torch.Generator().manual_seed(n)
        return [2] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist()

    def best_time(self, fn, repeats: int = 3) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    def e2e(self) -> None:
        eng, n = self._plain_engine(), self.args.e2e_tokens
        ids = self.prompt_ids(16)
        t = self.best_time(lambda: self.api.generate(eng, ids, n))
        self.out[f"e2e_1row_{n}_tok_per_s"] = n / t
        self.out["_engine"] = eng

    def prompt(self) -> None:
        eng, n = self._plain_engine(), self.args.prompt
        if n + 1 > eng.max_context:
            eng = self.api.load(self.ckpt, device=self.device, max_context=n + 256)
        ids = self.prompt_ids(n)
        self.out[f"prompt_{n}_first_token_s"] = self.best_time(
            lambda: self.api.generate(eng, ids, 1)
        )
        self.out["_engine"] = eng

    def long(self) -> None:
        torch, a = self.torch, self.args
        eng = self.api.load(self.ckpt, device=self.device, max_context=a.long_context,
                            memory_cap_mib=a.cap)  # fmt: skip
        ids = self.prompt_ids(a.long)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        first = self.api.generate(eng, ids, 1)
        self.sync()
        self.out[f"long_{a.long}_first_token_s"] = time.perf_counter() - t0
        if self.cuda:
            self.out[f"long_{a.long}_peak_allocated_mib"] = (
                torch.cuda.max_memory_allocated() / 2**20
            )
        self.out["long_first_token"] = first

    def identity(self) -> None:
        torch, api = self.torch, self.api
        off = api.engine.EngineOptions(fast="off")
        ids, n = [2, *range(100, 131)], 32
        fast = api.load(self.ckpt, device=self.device, dtype=torch.float32, max_context=1024)
        self.out["fp32_greedy_fast"] = api.generate(fast, ids, n)
        del fast
        ref = api.load(self.ckpt, device=self.device, dtype=torch.float32, max_context=1024,
                       options=off)  # fmt: skip
        self.out["fp32_greedy_reference"] = api.generate(ref, ids, n)
        del ref
        eng = api.load_batching(self.ckpt, 16, device=self.device, dtype=torch.float32,
                                max_context=512)  # fmt: skip
        prompts = [self.prompt_ids(5 + 9 * i) for i in range(16)]
        together = api.generate_together(eng, prompts, 24)
        alone = [api.generate(eng, p, 24) for p in prompts]
        self.out["batch_vs_alone_equal"] = [a == b for a, b in zip(together, alone, strict=True)]
        self.out["batch_tokens"] = together
        api.close(eng)

    def run(self, metrics: list[str]) -> dict[str, Any]:
        for m in metrics:
            t0 = time.perf_counter()
            getattr(self, m)()
            self.out[f"{m}_wall_s"] = round(time.perf_counter() - t0, 1)
        self.out.pop("_engine", None)
        return self.out


# ---- the parent: rounds, sides, summary -------------------------------------------------------
def better(key: str) -> str | None:
    """Which way is better for a metric: "up" (tok/s), "down" (seconds, MiB), None (not one)."""
    if key.endswith("_tok_per_s"):
        return "up"
    if key.endswith("_first_token_s") or key.endswith("_mib"):
        return "down"
    return None


def summarise(runs: list[dict], bar: float, cap: int | None) -> dict[str, Any]:
    sides = {
        n: [r for r in runs if r["side"] == n and "error" not in r] for n in ("before", "after")
    }
    keys = sorted({k for rs in sides.values() for r in rs for k in r if better(k)})
    summary: dict[str, Any] = {}
    failures: list[str] = []
    for k in keys:
        way = better(k)
        vals = {n: [r[k] for r in sides[n] if k in r] for n in sides}
        if not all(vals.values()):
            continue
        pick = max if way == "up" else min
        row = {n: round(pick(v), 4) for n, v in vals.items()}
        row["spread"] = {n: [round(x, 4) for x in v] for n, v in vals.items()}
        row["after_vs_before_pct"] = pct = round(100 * (row["after"] / row["before"] - 1), 2)
        if k.endswith("_mib"):  # memory: the bar is that the prompt fits under the cap
            row["fits"] = ok = cap is None or (row["before"] <= cap and row["after"] <= cap)
        else:
            ok = pct >= -bar if way == "up" else pct <= bar
        row["within_bar"] = ok
        if not ok:
            failures.append(k)
        summary[k] = row
    checks: dict[str, Any] = {}
    ident = [r for rs in sides.values() for r in rs if "fp32_greedy_fast" in r]
    if ident:
        checks["fp32_fast_equals_reference"] = {
            r["side"]: r["fp32_greedy_fast"] == r["fp32_greedy_reference"] for r in ident
        }
        checks["fp32_equal_between_sides"] = (
            len({json.dumps(r["fp32_greedy_fast"]) for r in ident}) == 1
            and len({json.dumps(r["fp32_greedy_reference"]) for r in ident}) == 1
        )
        checks["batch_vs_alone_equal"] = {r["side"]: all(r["batch_vs_alone_equal"]) for r in ident}
        checks["batch_tokens_equal_between_sides"] = (
            len({json.dumps(r["batch_tokens"]) for r in ident}) == 1
        )
        for name, v in checks.items():
            if not (all(v.values()) if isinstance(v, dict) else v):
                failures.append(name)
    errors = [r["side"] for r in runs if "error" in r]
    if errors:
        failures.append(f"side errors: {errors}")
    return {"metrics": summary, "checks": checks, "bar_pct": bar, "failures": failures,
            "pass": not failures}  # fmt: skip


def run_side(args: argparse.Namespace, root: Path, metrics: list[str], argv: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--side", str(root.resolve()),
           "--only", ",".join(metrics)]  # fmt: skip
    extra = os.environ.get("PYTHONPATH")  # carried wheels (pydantic) stay importable
    env = {**os.environ, "PYTHONPATH": str(root.resolve()) + (os.pathsep + extra if extra else "")}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    line = next((x for x in done.stdout.splitlines() if x.startswith("AB_RESULT ")), None)
    run = json.loads(line.removeprefix("AB_RESULT ")) if line else {"error": done.stderr[-3000:]}
    run["process_wall_s"] = round(time.perf_counter() - t0, 1)
    return run


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m bench.engine.ab",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--before", type=Path, required=True, help="the other tree's root")
    ap.add_argument("--after", type=Path, default=HERE)
    ap.add_argument("--ckpt", type=Path, help="default /tmp/gpurig_ab_<preset>")
    ap.add_argument("--preset", default="e2b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=",".join(METRICS), help=f"of {','.join(METRICS)}")
    ap.add_argument("--depths", default="0,32768,131072")
    ap.add_argument("--rows", default="8,16")
    ap.add_argument("--batch-depth", type=int, default=512)
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--long", type=int, default=131000)
    ap.add_argument("--long-context", type=int, default=131072)
    ap.add_argument("--cap", type=int, default=3732, help="MiB, the long prompt's memory cap")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bar", type=float, default=3.0, help="the most regression allowed, in %%")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "ab.json")
    ap.add_argument("--make-only", action="store_true", help="write the checkpoint and stop")
    ap.add_argument("--side", type=Path, help=argparse.SUPPRESS)  # internal: one side's run
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.ckpt = (args.ckpt or Path(f"/tmp/gpurig_ab_{args.preset}")).resolve()
    args.depths = [int(d) for d in args.depths.split(",") if d]
    args.rows = [int(r) for r in args.rows.split(",") if r]
    metrics = [m for m in args.only.split(",") if m]
    unknown = set(metrics) - set(METRICS)
    if unknown:
        parser().error(f"unknown metrics {sorted(unknown)}: use {','.join(METRICS)}")
    if args.side is not None:
        res = Side(args.side, args).run(metrics)
        print("AB_RESULT " + json.dumps(res), flush=True)
        return 0
    res: dict[str, Any] = {"preset": args.preset, "device": args.device, "metrics": metrics,
                           "before": str(args.before), "after": str(args.after),
                           "runs": []}  # fmt: skip
    for name, root in (("before", args.before), ("after", args.after)):
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        res[f"{name}_commit"] = head or None
    t_all = time.perf_counter()
    if not (args.ckpt / "config.json").is_file():
        sys.path.insert(0, str(HERE))
        from engine.checkpoint_maker import make_checkpoint

        t0 = time.time()
        make_checkpoint(args.ckpt, preset=args.preset, seed=0, emb4=True)
        res["make_s"] = round(time.time() - t0, 1)
    if args.make_only:
        print(json.dumps({"ckpt": str(args.ckpt), "make_s": res.get("make_s")}))
        return 0
    side_argv = []  # the side processes get the same options, but their own --only and --side
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--only", "--side", "--out"):
            skip = True
            continue
        if a.startswith(("--only=", "--side=", "--out=")):
            continue
        side_argv.append(a)
    side_argv += ["--ckpt", str(args.ckpt)]
    for r in range(args.rounds):
        for name, root in (("before", args.before), ("after", args.after)):
            groups = [[m for m in metrics if m not in ONCE or (r == 0 and m == "identity")]]
            if r == 0 and "long" in metrics:
                groups.append(["long"])  # its own process: the cap is the process's
            for group in groups:
                if not group:
                    continue
                run = run_side(args, root, group, side_argv)
                run.update(side=name, round=r, group=group)
                res["runs"].append(run)
                shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in run.items()
                         if not isinstance(v, list) or k == "group"}  # fmt: skip
                print(name, shown, flush=True)
    res["summary"] = summarise(res["runs"], args.bar, args.cap if args.device != "cpu" else None)
    res["wall_s"] = round(time.perf_counter() - t_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    s = res["summary"]
    for k, v in s["metrics"].items():
        print(f"{k:44s} before {v['before']:>12} after {v['after']:>12} "
              f"{v['after_vs_before_pct']:+7.2f}%  {'ok' if v['within_bar'] else 'REGRESSED'}")  # fmt: skip
    print("checks", json.dumps(s["checks"]), "pass:", s["pass"], s["failures"] or "")
    return 0 if s["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
