"""How long `gpurig engine serve` takes to be ready, cold and warm, and what the first request of
each prompt length waits against a warm one (issue 26's cold-start goals).

    python3 -m lab.engine.cold_start --ckpt DIR --out FILE.json [--lengths 54,512,1024,2048,4096]
        [--variants cold,warm,cold_serial] [--device cuda] [--max-num-seqs 16]

Each variant starts its own server process (started here, stopped here) with its own Triton
cache directory and kernel-tuning cache:
* cold: an empty Triton cache, the warm-up's compile threads at their default (the cores);
* warm: the same caches again (what every later start of the server meets);
* cold_serial: an empty cache with GPURIG_COMPILE_THREADS=1 (kernels compiled one after
  another, as before the compile pass existed);
* warm_no_first: the warm caches, without the server's in-process first requests
  (GPURIG_FIRST_REQUESTS=0): what its first client paid before they existed;
* warm_in_process: the warm caches, the engine in the server's own process
  (GPURIG_ENGINE_PROCESS=off): what the engine process's own start costs.

Ready is the time from the process's start to /health answering 200. Then, for each length, one
streamed /v1/completions request on token ids (the first of that length: it pays whatever the
warm-up left), then two more of the same length on other ids (warm); the time to first token is
the client's, from sending to the first streamed token. Last, after IDLE_S seconds idle, one
more request of the first length (seen already): what idleness alone costs. The server's own
lines are kept, each with the second it came.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.sweep.progress import int_list
from tools.fileio import write_atomic

VARIANTS = {
    "cold": {"fresh": True, "env": {}},
    "warm": {"fresh": False, "env": {}},
    "cold_serial": {"fresh": True, "env": {"GPURIG_COMPILE_THREADS": "1"}},
    "warm_no_first": {"fresh": False, "env": {"GPURIG_FIRST_REQUESTS": "0"}},
    "warm_in_process": {"fresh": False, "env": {"GPURIG_ENGINE_PROCESS": "off"}},
}


IDLE_S = 3.0  # the pause before the after-idle request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(n: int, salt: int, vocab: int) -> list[int]:
    return [2] + [(104729 * i + 7919 * salt) % (vocab - 3) + 3 for i in range(n - 1)]


def _ttft(client: httpx.Client, url: str, model: str, ids: list[int]) -> float:
    """Seconds from sending to the first streamed token of a 4-token completion."""
    body = {"model": model, "prompt": ids, "max_tokens": 4, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:400]}")
        first = None
        for line in r.iter_lines():  # read to the end: the next request meets an idle engine
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream ended before any token")
    return first


def _copy_lines(proc: subprocess.Popen, log_path: Path, t0: float,
                timed: list[tuple[float, str]]) -> None:  # fmt: skip
    """The server's output into its log file, each line with the time it came (where a start's
    seconds go: the engine process's own start and load against the warm-up it reports)."""
    with log_path.open("w") as log:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            timed.append((time.perf_counter() - t0, line))
            log.write(line + "\n")
            log.flush()


def run_variant(name: str, args: argparse.Namespace, dirs: dict[str, Path]) -> dict[str, Any]:
    spec = VARIANTS[name]
    if spec["fresh"] or "triton" not in dirs:
        root = Path(tempfile.mkdtemp(prefix=f"gpurig-cold-{name}-"))
        dirs.update(triton=root / "triton", kernels=root / "kernels")
    port = _free_port()
    env = dict(os.environ, TRITON_CACHE_DIR=str(dirs["triton"]),
               GPURIG_KERNEL_CACHE=str(dirs["kernels"]), **spec["env"])  # fmt: skip
    cmd = [sys.executable, "-m", "mcp_server.cli", "engine", "serve", "--model", args.ckpt,
           "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-context", str(args.max_context)]  # fmt: skip
    if args.device:
        cmd += ["--device", args.device]
    log_path = Path(tempfile.mkstemp(prefix=f"gpurig-cold-{name}-", suffix=".log")[1])
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    timed: list[tuple[float, str]] = []  # (seconds since the start, line) as the lines came
    copier = threading.Thread(target=_copy_lines, args=(proc, log_path, t0, timed), daemon=True)
    copier.start()
    out: dict[str, Any] = {"variant": name, "env": spec["env"], "command": cmd}
    try:
        with httpx.Client(timeout=600) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}): {log_path}")
                try:
                    if client.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > args.timeout:
                    raise RuntimeError(f"not ready within {args.timeout} s: {log_path}")
                time.sleep(0.1)
            out["ready_s"] = round(time.perf_counter() - t0, 2)
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            rows = []
            for n in args.lengths:
                first = _ttft(client, url, model, _ids(n, 0, args.vocab))
                warm = [_ttft(client, url, model, _ids(n, s, args.vocab)) for s in (1, 2)]
                median = statistics.median(warm)
                rows.append({"tokens": n, "first_ttft_ms": round(first * 1000, 1),
                             "warm_ttft_ms": round(median * 1000, 1),
                             "ratio": round(first / median, 2)})  # fmt: skip
            out["requests"] = rows
            # the first length once more, after the server sat idle: a first request that pays
            # for idleness (clocks, a sleeping engine thread) and not for a missing warm-up pays
            # here too, while a kernel loaded at first use does not
            time.sleep(IDLE_S)
            idle = _ttft(client, url, model, _ids(args.lengths[0], 3, args.vocab))
            out["after_idle"] = {"tokens": args.lengths[0], "idle_s": IDLE_S,
                                 "ttft_ms": round(idle * 1000, 1)}  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    copier.join(10)
    ours = [(t, ln) for t, ln in timed if ln.startswith("gpurig engine:")]
    out["server_lines"] = [ln for _, ln in ours]
    out["server_line_s"] = [round(t, 2) for t, _ in ours]  # when each line came, from the start
    out["triton_cache_entries"] = (
        sum(1 for _ in dirs["triton"].glob("*")) if dirs["triton"].is_dir() else 0
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", type=int_list, default=[54, 512, 1024, 2048, 4096])
    ap.add_argument("--variants", default="cold,warm,cold_serial")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    from engine.config import load_config

    args.vocab = load_config(Path(args.ckpt)).vocab_size
    dirs: dict[str, Path] = {}
    results = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}: use {', '.join(VARIANTS)}")
        res = run_variant(name, args, dirs)
        results.append(res)
        print(
            json.dumps({k: res.get(k) for k in ("variant", "ready_s", "requests", "after_idle")}),
            flush=True,
        )
        write_atomic(Path(args.out), json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
