"""What the sweep's builtin driver costs the client: CPU per request and per token at
concurrency 16, so it is known never to be the bottleneck (goal: under 1% of the measured TPOT).

    python3 -m lab.sweep_cost [--base-url URL/v1] [--requests 64] [--output-len 64]
        [--out FILE.json]

Without --base-url it writes a tiny checkpoint and starts `gpurig engine serve` on a free
loopback port (CPU) for the run, then stops it. The client's CPU is this process's user + system
time (resource.getrusage) around `driver_builtin.run_requests`, the same function a sweep calls;
a warm-up run comes first. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.sweep.driver_builtin import run_requests
from tools.fileio import write_atomic
from tools.serving.process import free_port

REPO = Path(__file__).resolve().parents[1]


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _start_engine(work: Path) -> tuple[subprocess.Popen, str]:
    from engine.checkpoint_maker import make_checkpoint

    make_checkpoint(work / "tiny", preset="tiny")
    port = free_port()
    log = open(work / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcp_server.cli", "engine", "serve", "--model", str(work / "tiny")]
        + ["--port", str(port), "--device", "cpu", "--log-level", "warning"],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((work / "server.log").read_text())
        try:
            if httpx.get(url + "/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the engine server did not start in 120 s")


def measure(base_url: str, requests: int, output_len: int, concurrency: int) -> dict:
    prompts = [(i, [200 + (i * 7 + j) % 250 for j in range(32)]) for i in range(requests)]
    run_requests(base_url, None, prompts[:concurrency], 4, concurrency)  # warm-up
    cpu0, t0 = _cpu(), time.perf_counter()
    results, duration = run_requests(base_url, None, prompts, output_len, concurrency)
    cpu = _cpu() - cpu0
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.itl_ms) + 1 for r in ok)
    tpot = statistics.median(r.tpot_ms for r in ok if r.tpot_ms)
    per_token_us = cpu / tokens * 1e6
    return {
        "requests": len(results),
        "completed": len(ok),
        "concurrency": concurrency,
        "output_len": output_len,
        "output_tokens": tokens,
        "stream_chunks": chunks,
        "wall_s": round(wall, 3),
        "cell_duration_s": round(duration, 3),
        "client_cpu_s": round(cpu, 4),
        "client_cpu_share_of_one_core": round(cpu / wall, 4),
        "cpu_per_request_ms": round(cpu / len(results) * 1000, 3),
        "cpu_per_token_us": round(per_token_us, 2),
        "median_tpot_ms": round(tpot, 3),
        "cpu_per_token_share_of_tpot": round(per_token_us / 1000 / tpot, 5),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="a running server (default: start a tiny engine here)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", help="JSON file to write (default: print only)")
    args = p.parse_args(argv)
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.base_url
        if url is None:
            proc, url = _start_engine(Path(tmp))
        try:
            result = measure(url, args.requests, args.output_len, args.concurrency)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(15)
    result["server"] = args.base_url or "gpurig engine serve, tiny preset, CPU, loopback"
    result["host"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "httpx": httpx.__version__,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        write_atomic(args.out, text + "\n")
    for key in ("cpu_per_request_ms", "cpu_per_token_us", "median_tpot_ms"):
        print(f"{key:32} {result[key]}")
    print(f"{'client CPU per token / TPOT':32} {result['cpu_per_token_share_of_tpot']:.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
