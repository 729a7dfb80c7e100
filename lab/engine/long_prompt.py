"""Real long prompts through the public API, under the 3,732 MiB cap and uncapped (issue 13).

    python3 -m lab.engine.long_prompt all --out $OUT        # checkpoint, capped, uncapped, summary
    python3 -m lab.engine.long_prompt run --cap 3732 --json x.json   # one process, one setting

For each prompt length (8,192, 32,768 and 131,000 random token ids) a fresh `Engine.stream`
reads the prompt and decodes NEW tokens: seconds to the first token (the whole read plus one
sample), prompt tok/s, decode tok/s after it, the allocator's peak (allocated and reserved)
during the request, and the plan the engine chose (chunk, score budget). Each setting runs in
its own process, so the cap (torch.cuda.set_per_process_memory_fraction) and the allocator's
state belong to it alone. The uncapped process also checks correctness: the last prompt
token's logits after the chunked read (with the capped plan and with its own) against one
whole pass of the reference path (`prefill`, every layer on every token in one chunk), and the
greedy continuations of the three.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from engine.options import EngineOptions
from engine.sampling import SamplingParams
from lab.engine.e2e_bench import CAP_MIB, E2B_DIR, make
from lab.engine.prompt_request import mib, random_prompt, request
from lab.engine.rows import held_rows, read_prompt, read_whole, step_fn

LENGTHS = (8192, 32768, 131000)
CHECK_NEW = 16
# what a capped E2B process has left for a prompt's read after its load (3,732 MiB cap less the
# ~3,336 MiB loaded): the "capped plan" of a check is planned with this much room above what the
# checking process holds, whatever that process holds itself (the uncapped one holds more: its
# pass graphs), so the check reads with the capped process's chunk
CAPPED_ROOM_MIB = 400


def check(eng, n: int, room_mib: int) -> dict[str, Any]:
    """Logits and greedy continuations: one whole reference pass against the chunked reads, the
    capped plan's with `room_mib` above what this process reserves once the rows are held (the
    cap counts reserved memory: engine.memory.available_bytes)."""
    prompt = random_prompt(n, eng.config.vocab_size)
    with held_rows(eng, 1, n + CHECK_NEW + 1) as slots:
        step = step_fn(eng, slots)
        slot = int(slots[0])
        torch.cuda.empty_cache()
        cap = int(torch.cuda.memory_reserved() / 2**20) + room_mib

        def continue_from(logits) -> list[int]:
            out, tok = [], logits.argmax().view(1)
            pos = torch.tensor([n], device=eng.device)
            with torch.no_grad():
                for _ in range(CHECK_NEW):
                    out.append(int(tok))
                    tok = step(tok, pos)[0].argmax().view(1)
                    pos += 1
            return out

        whole = read_whole(eng, prompt, slot, n, score_budget=1 << 60).float().clone()
        runs = {"whole": (whole, continue_from(whole))}
        for name, c in (("capped_plan", cap), ("uncapped_plan", None)):
            logits = read_prompt(eng, prompt, slot, cap=c).float().clone()
            runs[name] = (logits, continue_from(logits))
    res: dict[str, Any] = {"tokens": n, "whole_tokens": runs["whole"][1]}
    for name in ("capped_plan", "uncapped_plan"):
        logits, toks = runs[name]
        agree = next((i for i, (a, b) in enumerate(zip(toks, runs["whole"][1], strict=True)) if a != b),
                     CHECK_NEW)  # fmt: skip
        res[name] = {"max_abs_logit_diff": float((logits - whole).abs().max()),
                     "same_argmax": bool(logits.argmax() == whole.argmax()),
                     "greedy_tokens_agreeing": agree, "tokens": toks}  # fmt: skip
    top2 = whole.topk(2).values
    res["whole_top2_margin"] = float(top2[0] - top2[1])
    return res


def _sdpa_probe() -> bool:
    """Whether torch's memory-efficient kernel takes a 512-wide bf16 head here (else the
    engine's prefix attention falls back to its slices)."""
    from engine.attention import OnlineSoftmax

    dev = torch.device("cuda:0")
    qg = torch.randn(1, 16, 512, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(100, 1, 512, device=dev, dtype=torch.bfloat16)
    return bool(OnlineSoftmax(1, 16, 512, dev).add_whole(qg, keys, keys))


def run(cap: int | None, lengths=LENGTHS, checks: bool = False, save=None) -> dict[str, Any]:
    import engine

    res: dict[str, Any] = {"cap_mib": cap, "device": torch.cuda.get_device_name(0),
                           "torch": torch.__version__}  # fmt: skip
    t0 = time.perf_counter()
    # a child process: its variant comes in its environment, read here as a front door does
    eng = engine.load(E2B_DIR, device="cuda:0", max_context=131072, memory_cap_mib=cap,
                      options=EngineOptions.from_env())  # fmt: skip
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["loaded_mib"] = mib(torch.cuda.memory_allocated())
    res["max_chunk"] = eng.prefill_chunk
    passes = eng.runner.reader.graphs if eng.runner.reader is not None else None
    res["pass_graphs"] = passes is not None and passes.captured  # captured at load's warm-up
    res["prefix_sdpa_runs"] = _sdpa_probe()
    try:
        eng.generate(
            random_prompt(2048, eng.config.vocab_size), SamplingParams(max_tokens=4, stop_ids=())
        )  # compile, capture
    except Exception as exc:  # noqa: BLE001
        res["warm_up_error"] = repr(exc)[:800]
    res["warm_mib"] = mib(torch.cuda.memory_allocated())
    for n in lengths:
        try:
            res[f"prompt_{n}"] = request(eng, n, cap)
        except Exception as exc:  # noqa: BLE001 - recorded: a length that fails is a result
            res[f"prompt_{n}"] = {"error": repr(exc)[:800],
                                  "peak_allocated_mib": mib(torch.cuda.max_memory_allocated())}  # fmt: skip
        if save:
            save(res)
    if checks:
        for n in lengths:
            try:
                res[f"check_{n}"] = check(eng, n, CAPPED_ROOM_MIB)
            except Exception as exc:  # noqa: BLE001
                res[f"check_{n}"] = {"error": repr(exc)[:800], "trace": traceback.format_exc()[-800:]}  # fmt: skip
            if save:
                save(res)
        # fp32 activations: the chunked read and one whole pass should then agree to ~1e-4 and
        # in every greedy token (bf16 rounding moves logits by ~0.1, past many near-ties)
        del eng
        torch.cuda.empty_cache()
        eng = engine.load(E2B_DIR, device="cuda:0", max_context=40000, dtype=torch.float32)
        for n in lengths[:2]:
            try:  # fp32 rows are twice as wide: a little more room for a plan like the capped one
                res[f"check_fp32_{n}"] = check(eng, n, CAPPED_ROOM_MIB + 40)
            except Exception as exc:  # noqa: BLE001
                res[f"check_fp32_{n}"] = {"error": repr(exc)[:800]}
            if save:
                save(res)
    return res


def _save(path: Path):
    def save(res: dict[str, Any]) -> None:
        path.write_text(json.dumps(res, indent=1))

    return save


VARIANTS = (  # name, environment, capped, seconds (most wanted first)
    ("capped", {}, True, 90),
    ("uncapped", {}, False, 170),
)


def _child(args: list[str], out: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """One variant in a fresh process, its switches in the child's environment only."""
    cmd = [sys.executable, "-m", "lab.engine.long_prompt", "run", "--json", str(out), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **env})  # fmt: skip
    except subprocess.TimeoutExpired:
        proc = None
    res = json.loads(out.read_text()) if out.is_file() else {}
    if proc is None:
        res["exit"] = f"timed out after {timeout} s"
    elif proc.returncode:
        res["exit"] = proc.returncode
        res["stderr"] = proc.stderr[-2000:]
    return res


def summary(*runs: dict[str, Any]) -> list[str]:
    lines = [f"{'variant':>22} {'tokens':>8} {'chunk':>6} {'first s':>8} {'prompt tok/s':>13} "
             f"{'decode tok/s':>13} {'peak MiB':>9} {'reserved':>9}"]  # fmt: skip
    for res in runs:
        for n in LENGTHS:
            r = res.get(f"prompt_{n}", {})
            if "error" in r or not r:
                why = r.get("error", "") or res.get("exit", "") or res.get("warm_up_error", "")
                lines.append(f"{res.get('variant', '')!s:>22} {n:>8} FAILED {str(why)[:100]}")
                continue
            lines.append(f"{res.get('variant', '')!s:>22} {n:>8} {r['chunk']:>6} "
                         f"{r['first_token_s']:>8.2f} {r['prompt_tok_per_s']:>13,.0f} "
                         f"{r['decode_tok_per_s']:>13,.1f} {r['peak_allocated_mib']:>9,.0f} "
                         f"{r['peak_reserved_mib']:>9,.0f}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m lab.engine.long_prompt")
    ap.add_argument("what", choices=["all", "run"])
    ap.add_argument("--cap", type=int, default=None, help="memory_cap_mib (run)")
    ap.add_argument("--checks", action="store_true", help="logit / greedy checks (run)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)
    if args.what == "run":
        path = args.json or args.out / "long_prompt_run.json"
        res = run(args.cap, checks=args.checks, save=_save(path))
        _save(path)(res)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"make": make(E2B_DIR)}
    cap = ["--cap", str(CAP_MIB)]
    for name, env, extra, timeout in VARIANTS:
        argv = cap if extra else ["--checks"]
        res[name] = _child(argv, args.out / f"long_prompt_{name}.json", timeout, env)
        res[name]["variant"] = name
    res["summary"] = summary(*(res[name] for name, *_ in VARIANTS))
    (args.out / "long_prompt.json").write_text(json.dumps(res, indent=1))
    print("\n".join(res["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
