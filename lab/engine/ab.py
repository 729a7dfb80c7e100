"""Same-run A/B of two engine trees (a commit before a refactor and this tree after it): one
fresh process per side and round, the sides alternating (before, after, before, after), so
drift in the host's speed shows as spread within a side, not as a difference between them.

    git worktree add .carry/before a33c241          # an ignored folder: carry it to the device
    python3 -m lab.engine.ab --before .carry/before --out $OUT/ab.json        # E2B on CUDA
    python3 -m lab.engine.ab --before .carry/before --preset tiny --device cpu \\
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
import importlib.util
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
SIDE_FILE = Path(__file__).resolve().with_name("ab_side.py")


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


def _side_module():
    """ab_side.py of this tree by its path (in a side's process `bench` is the other tree's)."""
    spec = importlib.util.spec_from_file_location("gpurig_ab_side", SIDE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    ap = argparse.ArgumentParser(prog="python3 -m lab.engine.ab",
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
        res = _side_module().Side(args.side, args).run(metrics)
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
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(args.out)  # whole or not at all
    s = res["summary"]
    for k, v in s["metrics"].items():
        print(f"{k:44s} before {v['before']:>12} after {v['after']:>12} "
              f"{v['after_vs_before_pct']:+7.2f}%  {'ok' if v['within_bar'] else 'REGRESSED'}")  # fmt: skip
    print("checks", json.dumps(s["checks"]), "pass:", s["pass"], s["failures"] or "")
    return 0 if s["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
