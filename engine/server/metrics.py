"""Counters for GET /metrics: requests, tokens, speeds, queue and cancellations.

Prometheus' text format (what scrapers and `curl` readers expect) by default; the same numbers
as JSON with `?format=json` for scripts and tests. Updated from the event loop and the
generation thread, so every change holds a lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.server.gc_watch import GcWatch
from engine.step_clock import HOST_PHASES

if TYPE_CHECKING:
    from engine.textgen import GenerationResult

PREFIX = "gpurig_engine_"


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.started = time.time()
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.generations = 0
        self.cancelled = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.prompt_seconds = 0.0
        self.decode_seconds = 0.0
        self.decode_tokens = 0.0
        self.queue_seconds = 0.0
        # the engine's scheduler (engine.scheduler.Scheduler.stats): the one waiting line
        self.scheduler_stats: Callable[[], Any] | None = None
        self.last_decode_tok_per_s = 0.0
        self.last_prompt_tok_per_s = 0.0
        self.gc = GcWatch()  # the process's collector pauses (installed while the app runs)

    def reset(self) -> None:
        """Every counter back to zero (after the server's in-process first requests)."""
        with self._lock:
            self.started = time.time()
            self.requests.clear()
            self.generations = self.cancelled = self.prompt_tokens = self.completion_tokens = 0
            self.prompt_seconds = self.decode_seconds = self.decode_tokens = 0.0
            self.queue_seconds = self.last_decode_tok_per_s = self.last_prompt_tok_per_s = 0.0
            self.gc.reset()

    def record_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1

    def record_generation(self, r: GenerationResult, queue_ms: float) -> None:
        with self._lock:
            self.generations += 1
            self.prompt_tokens += r.prompt_tokens
            self.completion_tokens += r.new_tokens
            self.prompt_seconds += r.prefill_seconds
            self.decode_seconds += r.decode_seconds
            self.decode_tokens += r.decode_tokens
            self.queue_seconds += queue_ms / 1000
            self.last_decode_tok_per_s = r.decode_tokens_per_s or 0.0
            if r.prefill_seconds > 0:
                self.last_prompt_tok_per_s = r.prompt_tokens / r.prefill_seconds

    def snapshot(self) -> dict[str, Any]:
        batch = self._batch()
        gc = self.gc.totals()
        with self._lock:
            return batch | {
                "python_gc_collections_total": gc.collections,
                "python_gc_full_collections_total": gc.full_collections,
                "python_gc_seconds_total": round(gc.seconds, 6),
                "python_gc_max_pause_seconds": round(gc.max_pause_s, 6),
                "model": self.model_name,
                "uptime_s": round(time.time() - self.started, 3),
                "requests": [
                    {"endpoint": e, "status": s, "count": c}
                    for (e, s), c in sorted(self.requests.items())
                ],
                "requests_total": sum(self.requests.values()),
                "generations_total": self.generations,
                "cancelled_total": self.cancelled,
                "prompt_tokens_total": self.prompt_tokens,
                "completion_tokens_total": self.completion_tokens,
                "prompt_seconds_total": round(self.prompt_seconds, 6),
                "decode_seconds_total": round(self.decode_seconds, 6),
                "queue_seconds_total": round(self.queue_seconds, 6),
                "queue_waiting": batch["num_requests_waiting"],
                "busy": batch["num_requests_running"] > 0,
                "prompt_tok_per_s_avg": _rate(self.prompt_tokens, self.prompt_seconds),
                "decode_tok_per_s_avg": _rate(self.decode_tokens, self.decode_seconds),
                "prompt_tok_per_s_last": round(self.last_prompt_tok_per_s, 2),
                "decode_tok_per_s_last": round(self.last_decode_tok_per_s, 2),
            }

    def _batch(self) -> dict[str, Any]:
        """What the scheduler says (vLLM's gauges): requests running in the batch and waiting
        in its line, KV cache usage, tokens per decode step (zeros before an engine is set)."""
        if self.scheduler_stats is None:
            return {"num_requests_running": 0, "num_requests_waiting": 0}
        st = self.scheduler_stats()
        return {
            "num_requests_running": st.running,
            "num_requests_waiting": st.waiting,
            "max_num_seqs": st.max_num_seqs,
            "kv_cache_usage_perc": round(st.kv_usage, 6),
            "kv_cache_tokens": st.kv_tokens,
            "decode_steps_total": st.steps,
            "decode_step_rows_total": st.step_rows,
            "tokens_per_step_last": st.last_step_rows,
            "tokens_per_step_avg": round(st.step_rows / st.steps, 3) if st.steps else 0.0,
            "decode_gpu_busy_seconds_total": round(st.decode_busy_ms / 1000, 6),
            "decode_gpu_idle_seconds_total": round(st.decode_idle_ms / 1000, 6),
            "decode_steps_starved_total": st.starved_steps,
            "decode_gpu_idle_plain_seconds_total": round(st.decode_plain_idle_ms / 1000, 6),
            "decode_late_timed_steps_total": st.late_timed_steps,
            **{f"decode_late_host_{name}_seconds_total": round(ms / 1000, 6)
               for name, ms in zip(HOST_PHASES, st.late_host_ms, strict=True)},
            "engine_process_gc_collections_total": st.process_gc_collections,
            "engine_process_gc_seconds_total": round(st.process_gc_s, 6),
            "engine_process_gc_max_pause_seconds": round(st.process_gc_max_pause_s, 6),
        }  # fmt: skip

    def prometheus(self) -> str:
        s = self.snapshot()
        label = f'model="{_escape(self.model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value: Any, extra: str = "") -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            lines.append(f"{PREFIX}{name}{{{label}{extra}}} {_num(value)}")

        lines.append(f"# HELP {PREFIX}requests_total HTTP requests by endpoint and status.")
        lines.append(f"# TYPE {PREFIX}requests_total counter")
        for row in s["requests"]:
            lines.append(
                f'{PREFIX}requests_total{{{label},endpoint="{_escape(row["endpoint"])}",'
                f'status="{row["status"]}"}} {row["count"]}'
            )
        metric("generations_total", "counter", "Generations run.", s["generations_total"])
        metric("cancelled_total", "counter", "Generations cancelled.", s["cancelled_total"])
        metric("prompt_tokens_total", "counter", "Prompt tokens read.", s["prompt_tokens_total"])
        metric(
            "completion_tokens_total", "counter", "Tokens generated.", s["completion_tokens_total"]
        )
        metric(
            "prompt_seconds_total", "counter", "Time reading prompts.", s["prompt_seconds_total"]
        )
        metric("decode_seconds_total", "counter", "Time decoding.", s["decode_seconds_total"])
        metric("queue_seconds_total", "counter", "Time waiting in queue.", s["queue_seconds_total"])
        metric("queue_waiting", "gauge", "Requests waiting for the engine.", s["queue_waiting"])
        metric("busy", "gauge", "1 while a generation runs.", int(s["busy"]))
        metric("num_requests_running", "gauge", "Requests in the decode batch (vLLM's "
               "num_requests_running).", s["num_requests_running"])  # fmt: skip
        metric("num_requests_waiting", "gauge", "Requests waiting to join the batch.",
               s["num_requests_waiting"])  # fmt: skip
        for name, kind, text in _BATCH_METRICS + _GC_METRICS:
            if name in s:
                metric(name, kind, text, s[name])
        metric(
            "prompt_tok_per_s_avg", "gauge", "Prompt tokens per second.", s["prompt_tok_per_s_avg"]
        )
        metric(
            "decode_tok_per_s_avg", "gauge", "Decode tokens per second.", s["decode_tok_per_s_avg"]
        )
        metric(
            "decode_tok_per_s_last",
            "gauge",
            "Last request's decode speed.",
            s["decode_tok_per_s_last"],
        )
        return "\n".join(lines) + "\n"


_BATCH_METRICS = (
    ("max_num_seqs", "gauge", "Sequences the engine batches at most."),
    ("kv_cache_usage_perc", "gauge", "Fraction of the KV block pool in use (1 = full)."),
    ("kv_cache_tokens", "gauge", "Tokens the KV block pool holds."),
    ("decode_steps_total", "counter", "Decode steps run."),
    ("decode_step_rows_total", "counter", "Sequences decoded, summed over the steps."),
    ("tokens_per_step_last", "gauge", "Sequences in the last decode step."),
    ("tokens_per_step_avg", "gauge", "Average sequences per decode step."),
    ("decode_gpu_busy_seconds_total", "counter",
     "GPU time inside decode steps (CUDA; timed by events around each step)."),
    ("decode_gpu_idle_seconds_total", "counter", "GPU time of the decode stream between "
     "consecutive steps: waiting for the host, or for a prompt pass the step needs."),
    ("decode_steps_starved_total", "counter",
     "Decode steps the host launched after the step before them had ended (the GPU waited)."),
    ("decode_gpu_idle_plain_seconds_total", "counter", "Of the idle time, that before steps "
     "which admitted, read and ended no request (the step loop's own host time)."),
    ("decode_late_timed_steps_total", "counter",
     "Late decode steps whose host phases were timed (engine/step_clock.py)."),
    *((f"decode_late_host_{name}_seconds_total", "counter",
       f"Host time before late steps: {what}.") for name, what in (
        ("deliver", "handing the tokens of the step before to their requests"),
        ("send", "the engine process sending outputs to the server (0 in one process)"),
        ("receive", "the engine process receiving and adding requests (0 in one process)"),
        ("loop", "back in the stepping loop (its lock, the interpreter held elsewhere)"),
        ("schedule", "the scheduler's plan"),
        ("prepare", "the plan's bookkeeping, admissions and prompt passes before the launch"))),
    ("engine_process_gc_collections_total", "counter",
     "Garbage collections in the engine's own process (--engine-process on; else 0)."),
    ("engine_process_gc_seconds_total", "counter",
     "Time those collections stopped the engine's stepping thread."),
    ("engine_process_gc_max_pause_seconds", "gauge", "The engine process's longest collection."),
)  # fmt: skip


_GC_METRICS = (
    ("python_gc_collections_total", "counter", "The server process's garbage collections."),
    ("python_gc_full_collections_total", "counter", "Of them, full (generation 2) ones."),
    ("python_gc_seconds_total", "counter",
     "Time the collector held the interpreter (every thread, the engine's too, waited)."),
    ("python_gc_max_pause_seconds", "gauge", "The longest collection."),
)  # fmt: skip


def _rate(tokens: float, seconds: float) -> float:
    return round(tokens / seconds, 2) if seconds > 0 else 0.0


def _num(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
