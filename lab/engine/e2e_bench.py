"""The whole engine on the GPU: decode and prompt-reading speed, memory, the 4 GB cap, a peer.

Called by `lab.engine.engine_bench` (section e2e) or on its own:

    python3 -m lab.engine.e2e_bench all --out $OUT/e2e.json          # everything below
    python3 -m lab.engine.e2e_bench make --ckpt /tmp/e2b             # the random e2b checkpoint
    python3 -m lab.engine.e2e_bench capped --ckpt /tmp/e2b --json x  # a 131k prompt in 3,732 MiB
    python3 -m lab.engine.e2e_bench peer --ckpt /tmp/e2b --mode eager --json x

What it measures, on the e2b preset's random weights (4-bit linears and 4-bit embedding tables):
* greedy tokens of the fast path (Triton kernels, fused decode step, CUDA graph) against the
  reference path (PyTorch ops, the model's own step) for the tiny and e2b presets;
* decode tok/s at batch 1 with 0, 4,096, 32,768 and 131,072 positions already in the cache (the
  cache is filled with random keys/values at those positions instead of reading a real prompt:
  decode cost depends on how many slots are read, not on what they hold); both the GPU time per
  step (graph replays back to back) and the rate `Engine.generate` delivers (a host sync per
  token, as a server sees it);
* prompt reading tok/s for 512- and 4,096-token prompts; peak memory;
* a fresh process capped at 3,732 MiB (a 4 GB card) reading a real 131,000-token prompt, then decoding;
* transformers' Gemma4ForCausalLM in bf16 on the same weights (dequantised): eager, static cache
  and static + torch.compile, each in its own process (so a crash costs only that process).
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
from lab.engine.rows import fill_rows, held_rows, read_prompt, read_whole, step_fn, variant_runner

E2B_DIR = Path(os.environ.get("GPURIG_BENCH_CKPT", "/tmp/gpurig_e2b_emb4"))
TINY_DIR = Path("/tmp/gpurig_tiny_emb4")
CAP_MIB = 3732
DEPTHS = (0, 4096, 32768, 131072)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make(ckpt: Path, preset: str = "e2b") -> dict[str, Any]:
    from engine.checkpoint_maker import make_checkpoint

    if (ckpt / "config.json").is_file():
        return {"path": str(ckpt), "reused": True}
    t0 = time.time()
    info = make_checkpoint(ckpt, preset=preset, seed=0, emb4=True)
    return {"path": str(ckpt), "seconds": round(time.time() - t0, 1),
            "bytes_on_disk": info.bytes_on_disk, "parameters": info.parameters}  # fmt: skip


def reference_engine(eng):
    """The same checkpoint loaded again with the fast path off (reference ops, the model's own
    step): what the fast path is compared against. A second engine, not a switch: the
    runner is chosen once at load."""
    import engine

    return engine.load(eng.model_dir, device=eng.device, dtype=eng.dtype,
                       max_context=eng.max_context, options=EngineOptions(fast="off"))  # fmt: skip


def with_options(eng, **changes):
    """A runner over `eng`'s model and pool with some options changed (lab.engine.rows)."""
    return variant_runner(eng, **changes)


def read_as_generate(eng, prompt: list[int], runner=None, whole: bool = False):
    """The prompt's last-token logits as the engine reads it (chunks, then the last token by
    the decode step) or, with `whole`, every token through the model's own chunks."""
    with held_rows(eng, 1, len(prompt) + 1) as slots:
        if whole:
            return read_whole(eng, prompt, int(slots[0]))
        return read_prompt(eng, prompt, int(slots[0]), runner)


def greedy_pair(eng, prompt: list[int], n: int) -> dict[str, Any]:
    """Greedy tokens with the fast path (`eng`) and with the reference path (the same
    checkpoint loaded with the fast path off), from the same prompt."""
    params = SamplingParams(max_tokens=n, stop_ids=())
    t0 = time.time()
    fast = eng.generate(prompt, params)
    t_fast = time.time() - t0
    ref_eng = reference_engine(eng)
    t0 = time.time()
    ref = ref_eng.generate(prompt, params)
    t_ref = time.time() - t0
    del ref_eng
    same = sum(1 for a, b in zip(fast, ref, strict=False) if a == b)
    first_diff = next((i for i, (a, b) in enumerate(zip(fast, ref, strict=False)) if a != b), None)
    return {"tokens": n, "identical": fast == ref, "first_difference": first_diff,
            "agreeing": same, "fast": fast, "reference": ref,
            "seconds_fast": round(t_fast, 2), "seconds_reference": round(t_ref, 2)}  # fmt: skip


def decode_rate(eng, depth: int, steps: int = 64, runner=None) -> dict[str, Any]:
    """GPU time per decode step (graph replays back to back, argmax on the device) and the rate
    with a host round trip per token (what a request's loop does), at `depth` cached positions
    of one pool slot. `runner`: a variant (with_options); default the engine's own."""
    depth = min(depth, eng.max_context - steps - 8)  # every decoded position must fit
    with held_rows(eng, 1) as slots:
        dec = step_fn(eng, slots, runner)
        fill_rows(eng, slots, depth)
        tok = torch.tensor([7], device=eng.device)
        pos = torch.tensor([depth], device=eng.device)
        for _ in range(3):
            tok = dec(tok, pos).argmax(-1)
            pos += 1
        _sync()
        pos.fill_(depth)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            tok = dec(tok, pos).argmax(-1)
            pos += 1
        b.record()
        b.synchronize()
        gpu_ms = a.elapsed_time(b) / steps
        pos.fill_(depth)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = dec(tok, pos).argmax(-1)
            int(tok.item())
            pos += 1
        host_ms = (time.perf_counter() - t0) * 1000 / steps
    return {"depth": depth, "steps": steps, "ms_per_token_gpu": gpu_ms,
            "tok_per_s_gpu": 1000 / gpu_ms, "ms_per_token_with_sync": host_ms,
            "tok_per_s_with_sync": 1000 / host_ms}  # fmt: skip


def prefill_rate(eng, n: int, repeats: int = 3, whole: bool = False,
                 runner=None) -> dict[str, Any]:  # fmt: skip
    """Seconds from a prompt to its last token's logits, as the engine reads it (the last
    token through the decode step) or, with `whole`, every token through the model's chunks."""
    prompt = [int(t) for t in torch.randint(3, eng.config.vocab_size, (n,))]
    read_as_generate(eng, prompt, runner, whole)  # warm-up (tuning, cuBLAS plans)
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_as_generate(eng, prompt, runner, whole)
        _sync()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"tokens": n, "chunk": eng.prefill_chunk, "seconds": best, "tok_per_s": n / best,
            "last_token_by": "prefill" if whole else "decode step"}  # fmt: skip


PROMPT_MODES = {  # how a prompt reaches its first logits: (option changes, whole)
    "fused": ({}, False),  # fused chunks + the last token by the decode step (the default)
    "whole": ({}, True),  # every token through prefill's chunks, KV-shared layers included
}


def prompt_rates(eng, lengths=(32, 512, 4096)) -> dict[str, Any]:
    """Prompt to first logits for each length and mode, and how far the modes' logits are
    apart (the same prompt; bf16 rounding and matmul order differ, the function does not)."""
    out: dict[str, Any] = {}
    runners = {mode: with_options(eng, **changes) if changes else eng.runner
               for mode, (changes, _) in PROMPT_MODES.items()}  # fmt: skip
    for n in lengths:
        logits = {}
        for mode, (_, whole) in PROMPT_MODES.items():
            out[f"{n}_{mode}"] = prefill_rate(eng, n, whole=whole, runner=runners[mode])
            torch.manual_seed(n)
            prompt = [int(t) for t in torch.randint(3, eng.config.vocab_size, (n,))]
            logits[mode] = read_as_generate(eng, prompt, runners[mode], whole).float()
        ref = logits["whole"]
        for mode in ("fused",):
            out[f"{n}_{mode}"]["max_abs_logit_diff_vs_whole"] = float(
                (logits[mode] - ref).abs().max()
            )
            out[f"{n}_{mode}"]["same_argmax_as_whole"] = bool(logits[mode].argmax() == ref.argmax())
    return out


def generate_rate(eng, prompt_len: int = 32, new: int = 128) -> dict[str, Any]:
    prompt = [2] + [int(t) for t in torch.randint(3, eng.config.vocab_size, (prompt_len - 1,))]
    eng.generate(prompt, SamplingParams(max_tokens=8, stop_ids=()))  # warm-up
    t0 = time.perf_counter()
    out = eng.generate(prompt, SamplingParams(max_tokens=new, stop_ids=()))
    dt = time.perf_counter() - t0
    return {"prompt": prompt_len, "new_tokens": len(out), "seconds": dt,
            "tok_per_s_including_prefill": len(out) / dt}  # fmt: skip


def run_capped(ckpt: Path) -> dict[str, Any]:
    """In this (fresh) process: cap at 3,732 MiB, load with a 131,072-token context, then a
    real 131,000-token prompt read through Engine.stream and the tokens decoded after it
    (lab.engine.prompt_request.request). The capped figure comes from a prompt actually read: until
    issue 13 it came from a cache filled with random keys, which never exercised reading."""
    import engine
    from lab.engine.prompt_request import request

    res: dict[str, Any] = {"cap_mib": CAP_MIB}
    try:
        eng = engine.load(ckpt, device="cuda:0", max_context=131072, memory_cap_mib=CAP_MIB)
        res["prefill_chunk"] = eng.prefill_chunk
        res["loaded_mib"] = torch.cuda.memory_allocated() / 2**20
        warm = [2] + list(range(100, 2147))
        eng.generate(
            warm, SamplingParams(max_tokens=4, stop_ids=())
        )  # compile, tune, capture: not part of the figure
        res["prompt_131000"] = r = request(eng, 131000, CAP_MIB)
        res["decode_tok_per_s"] = r["decode_tok_per_s"]  # Engine.stream's rate, host in the loop
        res["prompt_tok_per_s"] = r["prompt_tok_per_s"]
        res["peak_mib"] = r["peak_allocated_mib"]
        res["peak_reserved_mib"] = r["peak_reserved_mib"]
        res["fits"] = res["peak_reserved_mib"] <= CAP_MIB
        res["prompt_512"] = prefill_rate(eng, 512, repeats=1)
        res["memory_report"] = eng.memory_report().model_dump()
    except Exception as exc:  # noqa: BLE001
        res["fits"] = False
        res["error"] = repr(exc)[:1000]
        res["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return res


def _hf_model(ckpt: Path, device: str = "cuda"):
    """transformers' Gemma4ForCausalLM in bf16 holding the checkpoint's weights, dequantised."""
    import transformers

    from engine import ops
    from engine.checkpoint import CheckpointReader

    raw = json.loads((ckpt / "config.json").read_text())
    for key in ("quantization_config", "gpurig_emb4"):
        raw.pop(key, None)
    cfg = transformers.Gemma4TextConfig(**raw)
    with torch.device(device):
        model = transformers.Gemma4ForCausalLM(cfg).to(torch.bfloat16)
    reader = CheckpointReader(ckpt)
    state, missing = {}, []
    for name, tensor in model.state_dict().items():
        rel = name.removeprefix("model.")
        mod = rel.removesuffix(".weight")
        if rel.endswith(".weight") and reader.has(mod + ".weight_packed"):
            w = reader.linear(mod, device, group_size=0)
            state[name] = ops.dequantize(w, torch.bfloat16)
        elif reader.has(rel):
            state[name] = reader.tensor(rel, device).to(tensor.dtype)
        elif name == "lm_head.weight":
            continue
        else:
            missing.append(name)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.eval()
    return model, missing


def run_peer(ckpt: Path, mode: str, new: int | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"mode": mode}
    new = new or (32 if mode == "eager" else 8)  # the static cache ran at ~0.6 tok/s here
    t0 = time.time()
    model, missing = _hf_model(ckpt)
    res["load_s"] = round(time.time() - t0, 1)
    res["missing"] = missing[:20]
    prompt = torch.tensor([[2] + list(range(10, 41))], device="cuda")
    kwargs: dict[str, Any] = {"max_new_tokens": new, "do_sample": False, "min_new_tokens": new}
    if mode in ("static", "compile"):
        kwargs["cache_implementation"] = "static"
    if mode == "compile":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    with torch.inference_mode():
        for _ in range(2 if mode == "compile" else 1):
            model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        _sync()
        t0 = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        _sync()
        dt = time.perf_counter() - t0
    res["new_tokens"] = int(out.shape[1] - prompt.shape[1])
    res["tok_per_s"] = res["new_tokens"] / dt
    res["tokens"] = out[0, prompt.shape[1] :].tolist()
    return res


def _subprocess(name: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Run one part in a fresh interpreter; its JSON, or what went wrong."""
    out = Path(f"/tmp/gpurig_bench_{name}.json")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "lab.engine.e2e_bench", *args, "--json", str(out)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    res: dict[str, Any] = {}
    if out.is_file():
        res = json.loads(out.read_text())
    if proc.returncode != 0:
        res["returncode"] = proc.returncode
        res["stderr_tail"] = proc.stderr[-1500:]
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def run_all(read_bps: float, save_cb=None, partial: dict | None = None,
            budget_s: float = 480.0) -> dict[str, Any]:  # fmt: skip
    """Everything, in order of importance, inside `budget_s` seconds."""
    import engine

    t_start = time.time()
    res: dict[str, Any] = {}
    if partial is not None:
        partial["e2e"] = res

    def left() -> float:
        return budget_s - (time.time() - t_start)

    def step(name: str, fn, *a, **k):
        t0 = time.time()
        try:
            res[name] = fn(*a, **k)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res[name] = {"error": repr(exc)[:1500]}
        print(f"-- {name}: {time.time() - t0:.1f}s", json.dumps(res[name], default=str)[:600],
              flush=True)  # fmt: skip
        if save_cb:
            save_cb()

    # the tiny preset: greedy identity (fp32 and bf16)
    def tiny():
        make(TINY_DIR, "tiny")
        out = {}
        for dt in (torch.float32, torch.bfloat16):
            eng = engine.load(TINY_DIR, device="cuda", dtype=dt, max_context=1024)
            prompt = [2] + list(range(10, 60))
            out[str(dt)] = greedy_pair(eng, prompt, 48)
        return out

    step("tiny_greedy", tiny)
    step("make_e2b", make, E2B_DIR)
    eng = engine.load(E2B_DIR, device="cuda")
    res["load"] = {"prefill_chunk": eng.prefill_chunk,
                   "memory_report": eng.memory_report().model_dump(),
                   "decode_weight_bytes": eng.model.decode_weight_bytes()}  # fmt: skip
    step("e2b_greedy", greedy_pair, eng, [2] + list(range(100, 131)), 32)
    res["decode"] = []
    for depth in DEPTHS:
        try:
            r = decode_rate(eng, depth)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            r = {"depth": depth, "error": repr(exc)[:800]}
        res["decode"].append(r)
        print("-- decode", json.dumps(r), flush=True)
    if save_cb:
        save_cb()
    for name, changes in (  # the same step otherwise, at depth 0
        ("decode_without_cuda_graph", {"cuda_graph": False}),
    ):
        try:
            res[name] = decode_rate(eng, 0, runner=with_options(eng, **changes))
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:800]}
    step("generate_short", generate_rate, eng)
    step("prompt", prompt_rates, eng)
    for n in (32, 512, 4096):
        res[f"prefill_{n}"] = res["prompt"].get(f"{n}_fused", {})
    res["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    # bound: weights + 7 passes over the full-attention cache per token
    wb = res["load"]["decode_weight_bytes"]
    for r in res["decode"]:
        if "ms_per_token_gpu" in r:
            cache_bytes = 7 * 2 * 512 * 2 * r["depth"]
            bound_ms = (wb + cache_bytes) / read_bps * 1000
            r["bound_ms"] = bound_ms
            r["pct_of_bound"] = 100 * bound_ms / r["ms_per_token_gpu"]
    del eng
    torch.cuda.empty_cache()
    if save_cb:
        save_cb()
    if left() > 40:
        step("capped_3732MiB", _subprocess, "capped", ["capped", "--ckpt", str(E2B_DIR)],
             min(150, left()))  # fmt: skip
    else:
        res["capped_3732MiB"] = {"skipped": "out of time"}
    modes = ["eager", "static"] + (["compile"] if os.environ.get("GPURIG_BENCH_COMPILE") else [])
    chosen = os.environ.get("GPURIG_BENCH_PEERS")  # "0": none; "eager,static": those
    if chosen is not None:
        modes = [m for m in chosen.split(",") if m in ("eager", "static", "compile")]
    for mode in modes:
        if left() < 40:
            res[f"peer_{mode}"] = {"skipped": "out of time"}
            continue
        step(f"peer_{mode}", _subprocess, f"peer_{mode}",
             ["peer", "--ckpt", str(E2B_DIR), "--mode", mode], min(200, left()))  # fmt: skip
    res["summary"] = _summary(res)
    return res


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for r in res.get("decode", []):
        if "tok_per_s_gpu" in r:
            s[f"decode_tok_s_depth_{r['depth']}"] = round(r["tok_per_s_gpu"], 1)
            s[f"decode_tok_s_with_sync_depth_{r['depth']}"] = round(r["tok_per_s_with_sync"], 1)
            s[f"pct_of_bound_depth_{r['depth']}"] = round(r.get("pct_of_bound", 0), 1)
    for k in ("prefill_32", "prefill_512", "prefill_4096"):
        if "tok_per_s" in res.get(k, {}):
            s[f"{k}_tok_s"] = round(res[k]["tok_per_s"])
    s["peak_mib"] = round(res.get("peak_mib", 0))
    cap = res.get("capped_3732MiB", {})
    s["capped_fits"] = cap.get("fits")
    s["capped_tok_s"] = round(cap.get("decode_tok_per_s", 0), 1)  # after a real 131k prompt
    s["capped_prompt_tok_s"] = round(cap.get("prompt_tok_per_s", 0))
    for mode in ("eager", "static", "compile"):
        p = res.get(f"peer_{mode}", {})
        s[f"peer_{mode}_tok_s"] = round(p["tok_per_s"], 2) if "tok_per_s" in p else p.get(
            "error", p.get("skipped", p.get("returncode")))  # fmt: skip
    for k in ("tiny_greedy", "e2b_greedy"):
        g = res.get(k, {})
        if "identical" in g:
            s[f"{k}_identical"] = g["identical"]
        else:
            s[f"{k}_identical"] = {d: v.get("identical") for d, v in g.items()
                                   if isinstance(v, dict)}  # fmt: skip
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["all", "make", "capped", "peer", "prompt"])
    ap.add_argument("--ckpt", default=str(E2B_DIR))
    ap.add_argument("--mode", default="eager")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None,
                    help="where the JSON goes (default $OUT/e2e[_capped|_peer_MODE].json)")  # fmt: skip
    args = ap.parse_args(argv)
    ckpt = Path(args.ckpt)
    suffix = {"all": "", "capped": "_capped", "peer": f"_peer_{args.mode}",
              "prompt": "_prompt"}.get(args.what)  # fmt: skip
    if suffix is not None:  # every measurement is kept, not only printed
        out = args.out or os.path.join(os.environ.get("OUT", "."), f"e2e{suffix}.json")
        args.json = args.json or out
    if args.what == "make":
        res = make(ckpt)
    elif args.what == "capped":
        res = run_capped(ckpt)
    elif args.what == "peer":
        res = run_peer(ckpt, args.mode)
    elif args.what == "prompt":
        import engine

        make(ckpt)
        res = prompt_rates(engine.load(ckpt, device="cuda"))
        for key, row in res.items():
            print(key, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    else:
        res = run_all(4.1e12)
    text = json.dumps(res, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text[-3000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
