"""What the machine and the server did while a cell ran.

- NVML, sampled a few times a second on a thread: utilization, SM clock against its maximum,
  power against the limit, throttle reasons by name, memory used; and its energy counter read
  at the start and the end (bench/sweep/energy.py). No GPU -> the reason.
- The server process's CPU (and its children's: vLLM's engine core is one) with psutil: CPU
  seconds over the cell's wall time, in cores.
- The server's Prometheus /metrics before and after the cell: vLLM's prefix-cache queries and
  hits (a hit rate over the cell), KV cache usage, requests running and waiting (peaks); the
  engine's gauges, its sequences per decode step over the cell (how well it batched), and
  the share of its decode stream's GPU time spent between steps (the host or a prompt pass
  kept the GPU waiting) with the share of steps launched after the one before had ended and
  where the host's time went before those, and its server's garbage-collector pauses;
  llama-server's `llamacpp:` counters under the same names (its slot-cache reuse as the
  prefix-cache hit rate).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx

from bench.sweep.cell_models import CellEnergy
from bench.sweep.energy import EnergyMeter, no_energy
from bench.sweep.models import CellTelemetry, GpuTelemetry
from engine.step_clock import HOST_PHASES
from tools.gpu_nvml import nvml_error_text, throttle_names

SAMPLE_INTERVAL_S = 0.25
# /metrics during a cell: a first look, then one every POLL_INTERVAL_S. Not more often: the
# poll runs in the driver's process, and reading vLLM's page (thousands of histogram lines)
# holds the interpreter long enough to bunch the stream chunks the driver is timing.
FIRST_POLL_S = 0.25
POLL_INTERVAL_S = 1.0
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
# metric name (without labels) -> kept under this key; summed over label sets
KEPT = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:num_requests_running": "requests_running",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "gpurig_engine_num_requests_waiting": "requests_waiting",
    "gpurig_engine_num_requests_running": "requests_running",
    "gpurig_engine_kv_cache_usage_perc": "kv_cache_usage",
    "gpurig_engine_decode_steps_total": "decode_steps",
    "gpurig_engine_decode_step_rows_total": "decode_step_rows",
    "gpurig_engine_decode_gpu_busy_seconds_total": "decode_gpu_busy_s",
    "gpurig_engine_decode_gpu_idle_seconds_total": "decode_gpu_idle_s",
    "gpurig_engine_decode_steps_starved_total": "decode_steps_starved",
    "gpurig_engine_decode_gpu_idle_plain_seconds_total": "decode_gpu_idle_plain_s",
    "gpurig_engine_decode_late_timed_steps_total": "late_timed",
    **{f"gpurig_engine_decode_late_host_{p}_seconds_total": f"late_{p}_s" for p in HOST_PHASES},
    "gpurig_engine_python_gc_seconds_total": "gc_s",
    "gpurig_engine_python_gc_collections_total": "gc_collections",
    "gpurig_engine_engine_process_gc_seconds_total": "engine_gc_s",
    "gpurig_engine_engine_process_gc_collections_total": "engine_gc_collections",
    "gpurig_engine_completion_tokens_total": "generation_tokens",
    "gpurig_engine_prompt_tokens_total": "prompt_tokens",
    "llamacpp:requests_processing": "requests_running",
    "llamacpp:requests_deferred": "requests_waiting",
    "llamacpp:tokens_predicted_total": "generation_tokens",
    "llamacpp:kv_cache_usage_ratio": "kv_cache_usage",
}
# llama-server counts the prompt tokens it computed and those its slot cache held apart; vLLM's
# prefix-cache queries and prompt tokens are both, its hits the cached ones
KEPT_UNDER_MORE: dict[str, tuple[str, ...]] = {
    "llamacpp:prompt_tokens_total": ("prompt_tokens", "prefix_cache_queries"),
    "llamacpp:prompt_tokens_cached_total": (
        "prompt_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ),
}


_KEYS = {name: (key,) for name, key in KEPT.items()} | KEPT_UNDER_MORE
_KEPT_PREFIXES = tuple(sorted({name[:12] for name in _KEYS}))


def parse_metrics(text: str) -> dict[str, float]:
    """The metrics we keep from a Prometheus text page, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        # most of a vLLM page is histogram buckets: skip them before the regex
        if not line.startswith(_KEPT_PREFIXES) or "_bucket" in line:
            continue
        m = _LINE.match(line)
        if not m or m.group(1) not in _KEYS:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        for key in _KEYS[m.group(1)]:
            out[key] = out.get(key, 0.0) + value
    return out


def scrape(root_url: str, timeout_s: float = 5.0) -> tuple[dict[str, float], str | None]:
    """(kept metrics, None) or ({}, why there are none)."""
    try:
        resp = httpx.get(root_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {}, f"/metrics unreachable: {type(exc).__name__}"
    if resp.status_code != 200:
        return {}, f"/metrics answered HTTP {resp.status_code}"
    return parse_metrics(resp.text), None


def load_nvml() -> Any:
    """The NVML binding (pynvml); tests put a stand-in that replays recorded values here."""
    import pynvml

    return pynvml


class NvmlSampler:
    """Samples one GPU on a daemon thread between start() and stop(), and reads its energy
    counter at both (`energy` after stop())."""

    def __init__(self, index: int = 0, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.index = index
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.missing: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._static: dict[str, Any] = {}
        self._pynvml: Any = None
        self._handle: Any = None
        self._meter: EnergyMeter | None = None
        self.energy: CellEnergy | None = None

    def start(self) -> None:
        try:
            pynvml = load_nvml()
            pynvml.nvmlInit()
        except Exception as exc:  # no library, no driver, no permission
            self.missing = nvml_error_text(exc) if not isinstance(exc, ImportError) else str(exc)
            return
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as exc:
            self.missing = f"NVML has no GPU {self.index}: {exc}"
            pynvml.nvmlShutdown()
            return
        self._pynvml = pynvml
        self._static = {
            "name": _try(pynvml.nvmlDeviceGetName, self._handle),
            "clock_max": _try(pynvml.nvmlDeviceGetMaxClockInfo, self._handle, pynvml.NVML_CLOCK_SM),
            "limit": _try(pynvml.nvmlDeviceGetPowerManagementLimit, self._handle),
        }
        self._meter = EnergyMeter(pynvml, self._handle, self.index)
        self._meter.start()
        self._thread = threading.Thread(target=self._loop, name="sweep-nvml", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        p, h = self._pynvml, self._handle
        while not self._stop.is_set():
            util = _try(p.nvmlDeviceGetUtilizationRates, h)
            mem = _try(p.nvmlDeviceGetMemoryInfo, h)
            self.samples.append(
                {
                    "util": util.gpu if util is not None else None,
                    "clock": _try(p.nvmlDeviceGetClockInfo, h, p.NVML_CLOCK_SM),
                    "power": _try(p.nvmlDeviceGetPowerUsage, h),
                    "mem": mem.used if mem is not None else None,
                    "throttle": _try(p.nvmlDeviceGetCurrentClocksThrottleReasons, h),
                }
            )
            self._stop.wait(self.interval_s)

    def stop(self) -> tuple[GpuTelemetry | None, str | None]:
        if self._thread is None:
            self.energy = no_energy(self.missing)
            return None, self.missing or "NVML not started"
        self._stop.set()
        self._thread.join(5)
        self.energy = self._meter.stop() if self._meter is not None else no_energy(None)
        self._pynvml.nvmlShutdown()
        return summarize_samples(self.index, self.samples, self._static), None


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return None


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def summarize_samples(
    index: int, samples: list[dict[str, Any]], static: dict[str, Any]
) -> GpuTelemetry:
    """NVML samples -> means, maxima and how often each throttle reason was on."""
    util = [s["util"] for s in samples if s.get("util") is not None]
    clock = [s["clock"] for s in samples if s.get("clock") is not None]
    power = [s["power"] / 1000 for s in samples if s.get("power") is not None]
    mem = [s["mem"] for s in samples if s.get("mem") is not None]
    counts: dict[str, int] = {}
    for s in samples:
        for name in throttle_names(int(s.get("throttle") or 0)):
            counts[name] = counts.get(name, 0) + 1
    clock_max = static.get("clock_max")
    name = static.get("name")
    limit = static.get("limit")
    clock_mean = _mean(clock)
    return GpuTelemetry(
        index=index,
        name=name.decode() if isinstance(name, bytes) else name,
        samples=len(samples),
        util_mean=_mean(util),
        util_max=max(util) if util else None,
        sm_clock_mean_mhz=clock_mean,
        sm_clock_max_mhz=clock_max,
        clock_share=round(clock_mean / clock_max, 4) if clock_mean and clock_max else None,
        power_mean_w=_mean(power),
        power_limit_w=limit / 1000 if limit else None,
        memory_used_max_bytes=max(mem) if mem else None,
        throttle={k: round(v / len(samples), 3) for k, v in sorted(counts.items())},
    )


def _cpu_seconds(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


class CellWatch:
    """Everything telemetry does around one cell: `with CellWatch(...) as w: run()`, then
    `w.result`."""

    def __init__(self, root_url: str, pid: int | None, gpu_index: int = 0) -> None:
        self.root_url = root_url
        self.pid = pid
        self.sampler = NvmlSampler(gpu_index)
        self.result = CellTelemetry(server_pid=pid)
        self._cpu0: float | None = None
        self._t0 = 0.0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._peaks: dict[str, float] = {}

    def _poll(self) -> None:
        """Peaks of the gauges during the cell (after it, the KV cache is empty again): a first
        look soon after the start, then every POLL_INTERVAL_S, so a cell of two seconds (a
        tiny model on a CPU) is still seen running."""
        wait = FIRST_POLL_S
        while not self._stop.wait(wait):
            wait = POLL_INTERVAL_S
            now, _ = scrape(self.root_url, timeout_s=2.0)
            for key in ("kv_cache_usage", "requests_waiting", "requests_running"):
                if key in now:
                    self._peaks[key] = max(self._peaks.get(key, 0.0), now[key])

    def __enter__(self) -> CellWatch:
        self.result.metrics_before, self.result.metrics_missing = scrape(self.root_url)
        if self.pid is None:
            self.result.cpu_missing = "the server's process is not known (not on this host?)"
        else:
            try:
                self._cpu0 = _cpu_seconds(self.pid)
            except Exception as exc:
                self.result.cpu_missing = f"cannot read the server's CPU: {exc}"
        self.sampler.start()
        if self.result.metrics_missing is None:
            self._poller = threading.Thread(target=self._poll, name="sweep-metrics", daemon=True)
            self._poller.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        r = self.result
        r.gpu, r.gpu_missing = self.sampler.stop()
        r.energy = self.sampler.energy
        self._stop.set()
        if self._poller is not None:
            self._poller.join(5)
        if self._cpu0 is not None and self.pid is not None and wall > 0:
            try:
                r.server_cpu_cores = round((_cpu_seconds(self.pid) - self._cpu0) / wall, 4)
            except Exception as exc:
                r.cpu_missing = f"the server's process went away: {exc}"
        after, missing = scrape(self.root_url)
        r.metrics_after = after
        r.metrics_missing = r.metrics_missing or missing
        before = r.metrics_before
        dq = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
        dh = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
        if dq > 0:
            r.prefix_cache_hit_rate = round(dh / dq, 4)
        peaks = {**after, **self._peaks}
        r.kv_cache_usage = peaks.get("kv_cache_usage")
        r.requests_waiting = peaks.get("requests_waiting")
        r.requests_running = peaks.get("requests_running")
        (r.decode_rows_per_step, r.decode_idle_share, r.decode_starved_share,
         r.decode_idle_plain_share) = decode_shares(before, after)  # fmt: skip
        r.decode_late_host_ms = late_host_ms(before, after)
        if _moved(before, after, "gc_collections") > 0 and wall > 0:  # engine/server/gc_watch.py
            r.gc_ms_per_s = round(_moved(before, after, "gc_s") * 1000 / wall, 3)
        if _moved(before, after, "engine_gc_collections") > 0 and wall > 0:  # its own process
            r.engine_gc_ms_per_s = round(_moved(before, after, "engine_gc_s") * 1000 / wall, 3)


def _moved(before: dict[str, float], after: dict[str, float], key: str) -> float:
    """How far a counter moved over a cell (0 where the server does not report it)."""
    return after.get(key, 0.0) - before.get(key, 0.0)


def late_host_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Per late decode step of the cell, the engine's host milliseconds in each phase before
    it (engine/step_clock.py HOST_PHASES); None without a timed late step."""
    steps = _moved(before, after, "late_timed")
    if steps <= 0:
        return None
    return {p: round(_moved(before, after, f"late_{p}_s") * 1000 / steps, 3) for p in HOST_PHASES}


def decode_shares(
    before: dict[str, float], after: dict[str, float]
) -> tuple[float | None, float | None, float | None, float | None]:
    """Over a cell, from the engine's counters: sequences per decode step (its batching); the
    decode stream's GPU time between steps over its GPU time (engine/step_clock.py: the host or
    a prompt pass kept the GPU waiting); the share of steps launched after the one before had
    ended; the share of that idle time before plain steps (no request admitted, read or
    ended). None where the counters did not move (another server, no step, no CUDA)."""

    def moved(key: str) -> float:
        return _moved(before, after, key)

    steps = moved("decode_steps")
    rows = round(moved("decode_step_rows") / steps, 3) if steps > 0 else None
    busy, idle = moved("decode_gpu_busy_s"), moved("decode_gpu_idle_s")
    idle_share = round(idle / (busy + idle), 4) if busy > 0 else None
    starved = round(moved("decode_steps_starved") / steps, 4) if busy > 0 and steps > 0 else None
    plain = round(moved("decode_gpu_idle_plain_s") / idle, 4) if busy > 0 and idle > 0 else None
    return rows, idle_share, starved, plain
