"""Same-run A/B of two engine trees (e.g. a commit before a refactor and after), one fresh
process per side and repeat, through the public API only, so any two versions compare:

    git worktree add .carry/before <commit>      # an ignored folder: carry it to the device
    python3 -m bench.engine.ab --before .carry/before --out $OUT/ab.json [--preset e2b]

Per side: decode tok/s at each depth (the engine's decode step replayed back to back, the
cache filled with random keys at that depth; the step comes from `engine.fast.decoder_for`
on trees before issue 16 and from `Engine.backend.step()` after), prompt to first token at
4,096 tokens (`Engine.generate(prompt, 1)`), and greedy tokens in float32 (their lists must be
equal between sides). The sides alternate (before, after, before, after) so drift in the
host's speed shows as spread within a side, not as a difference between them.
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


def _step_of(eng):
    if hasattr(eng, "backend"):
        return eng.backend.step()
    from engine.fast import decoder_for  # trees before issue 16

    return decoder_for(eng.model, eng.cache)


def fill_cache(eng, depth: int) -> None:
    """The cache as if positions 0..depth-1 had been read (random keys: decode cost depends on
    how many slots are read, not on what they hold). Kept here, not imported: the other tree
    may not have this tree's bench modules."""
    import torch

    gen = torch.Generator(device=eng.device).manual_seed(depth)
    for layer in eng.cache.layers.values():
        layer.pos.fill_(-1)
        if depth == 0:
            continue
        if layer.window is None:
            positions = torch.arange(min(depth, layer.slots), device=eng.device)
            slots = positions
        else:
            positions = torch.arange(max(0, depth - layer.slots), depth, device=eng.device)
            slots = positions % layer.slots
        for i in range(0, positions.numel(), 8192):
            sl, ps = slots[i : i + 8192], positions[i : i + 8192]
            shape = (ps.numel(), *layer.k.shape[1:])
            layer.k[sl] = torch.randn(shape, device=eng.device, generator=gen).to(layer.k.dtype)
            layer.v[sl] = torch.randn(shape, device=eng.device, generator=gen).to(layer.v.dtype)
            layer.pos[sl] = ps


def side(root: Path, ckpt: Path, device: str, depths: list[int], prompt_len: int) -> dict:
    """One tree, in this process: its engine imported from `root`."""
    sys.path.insert(0, str(root))
    import torch

    import engine

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict[str, Any] = {"root": str(root), "engine_file": engine.__file__}
    eng = engine.load(ckpt, device=device, max_context=max(depths) + prompt_len + 256)
    step = _step_of(eng)
    for depth in depths:
        fill_cache(eng, depth)
        tok = torch.tensor([7], device=eng.device)
        pos = torch.tensor([depth], device=eng.device)
        for _ in range(3):  # capture, tuning
            tok = step(tok, pos)[0].argmax(-1, keepdim=True)
        sync()
        n = 64
        t0 = time.perf_counter()
        for _ in range(n):
            tok = step(tok, pos)[0].argmax(-1, keepdim=True)
            pos += 1
        sync()
        out[f"decode_tok_per_s_depth_{depth}"] = n / (time.perf_counter() - t0)
    vocab = eng.config.vocab_size
    prompt = [2] + [int(t) for t in torch.randint(3, vocab, (prompt_len - 1,))]
    eng.generate(prompt, 1, stop_ids=[])  # warm-up
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        eng.generate(prompt, 1, stop_ids=[])
        sync()
        times.append(time.perf_counter() - t0)
    out[f"prompt_{prompt_len}_tok_per_s"] = prompt_len / min(times)
    del eng, step
    eng32 = engine.load(ckpt, device=device, dtype=torch.float32, max_context=1024)
    out["fp32_greedy"] = eng32.generate([2] + list(range(100, 131)), 32, stop_ids=[])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.engine.ab")
    ap.add_argument("--before", type=Path, required=True, help="the other tree's root")
    ap.add_argument("--after", type=Path, default=HERE)
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/gpurig_ab_ckpt"))
    ap.add_argument("--preset", default="e2b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--depths", default="0,32768")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "ab.json")
    ap.add_argument("--side", type=Path, help=argparse.SUPPRESS)  # internal: one side's run
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",") if d]
    if args.side is not None:
        res = side(args.side, args.ckpt, args.device, depths, args.prompt)
        print("AB_RESULT " + json.dumps(res), flush=True)
        return 0
    res: dict[str, Any] = {"preset": args.preset, "device": args.device, "runs": []}
    if not (args.ckpt / "config.json").is_file():
        sys.path.insert(0, str(HERE))
        from engine.checkpoint_maker import make_checkpoint

        t0 = time.time()
        make_checkpoint(args.ckpt, preset=args.preset, seed=0, emb4=True)
        res["make_s"] = round(time.time() - t0, 1)
    for _ in range(args.rounds):
        for name, root in (("before", args.before), ("after", args.after)):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--before", str(args.before),
                   "--side", str(root.resolve()), "--ckpt", str(args.ckpt), "--device",
                   args.device, "--depths", args.depths, "--prompt", str(args.prompt)]  # fmt: skip
            extra = os.environ.get("PYTHONPATH")  # carried wheels (pydantic) stay importable
            path = str(root.resolve()) + (os.pathsep + extra if extra else "")
            env = {**os.environ, "PYTHONPATH": path}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
            line = next((x for x in done.stdout.splitlines() if x.startswith("AB_RESULT ")), None)
            run = json.loads(line.removeprefix("AB_RESULT ")) if line else {
                "error": done.stderr[-3000:]}  # fmt: skip
            run["side"] = name
            res["runs"].append(run)
            print(name, {k: v for k, v in run.items() if k != "fp32_greedy"}, flush=True)
    sides = {n: [r for r in res["runs"] if r["side"] == n and "error" not in r]
             for n in ("before", "after")}  # fmt: skip
    if all(sides.values()):
        keys = [k for k in sides["before"][0] if k.endswith("tok_per_s") or "tok_per_s_" in k]
        res["summary"] = {k: {n: max(r[k] for r in sides[n]) for n in sides} for k in keys}
        for v in res["summary"].values():
            v["after_vs_before_pct"] = round(100 * (v["after"] / v["before"] - 1), 2)
        greedy = {json.dumps(r["fp32_greedy"]) for n in sides for r in sides[n]}
        res["fp32_greedy_identical"] = len(greedy) == 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res.get("summary"), indent=1), "fp32 greedy identical:",
          res.get("fp32_greedy_identical"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
