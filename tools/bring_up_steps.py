"""bring_up's steps: each takes the shared `Run` (the request and what earlier steps learned)
and returns an `Outcome` (status, short facts, what to do next) or raises a GpurigError, which
tools/bring_up.py turns into a failed step with its message and remedy. The order and the
rules (stop at the first failure, reuse, what stays running) are there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.bring_up_models import (
    STEPS,
    BringUpRequest,
    Step,
    StepName,
    StepStatus,
    SweepSummary,
)
from tools.doctor import Check, doctor
from tools.errors import GpurigError, arg, either
from tools.serving import command as cmd
from tools.serving import preflight, process, state
from tools.serving.control import refresh, spot_check
from tools.serving.lifecycle import start_vllm_server, wait_ready
from tools.serving.models import ServerRecord, SpotCheckResult
from tools.serving.preflight import GpuFacts
from tools.settings import resolve_python
from tools.turing import apply_turing_patch, verify_turing_patch

Progress = Callable[[float, float | None, str], None]
SweepProgress = Callable[[int, int, str], None]
Measure = Callable[[ServerRecord, BringUpRequest, SweepProgress], SweepSummary]
HOST_CHECKS = {"filesystems", "host memory", "disk space", "/tmp"}
FACT_CHARS = 200


@dataclass
class Outcome:
    status: StepStatus
    found: list[str]
    next: str | None = None


@dataclass
class Run:
    """What the steps share: the request, what earlier steps learned, the progress sink."""

    request: BringUpRequest
    progress: Progress | None
    measure: Measure | None
    gpus: GpuFacts | None
    index: int = 0
    name: str = ""
    local: str | None = None
    reuse: ServerRecord | None = None
    record: ServerRecord | None = None
    old_record: ServerRecord | None = None  # the name's record before this start
    spot: SpotCheckResult | None = None
    sweep: SweepSummary | None = None
    python: str | None = None
    steps: list[Step] = field(default_factory=list)

    def tell(self, fraction: float, message: str) -> None:
        """Progress is a courtesy: a client that went away must not stop the bring-up."""
        if self.progress is None:
            return
        done = round(self.index + min(max(fraction, 0.0), 0.99 if fraction < 1 else 1.0), 3)
        with contextlib.suppress(Exception):
            self.progress(done, float(len(STEPS)), f"{STEPS[self.index]}: {message}")


def short_text(text: str) -> str:
    """A fact on one line, at most FACT_CHARS long."""
    text = " ".join(str(text).split())
    return text if len(text) <= FACT_CHARS else text[: FACT_CHARS - 3] + "..."


def _clip(text: str, chars: int = 40) -> str:
    """An answer, on one line and short: the whole of it is in the report's spot_check."""
    text = " ".join(text.split())
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def _model_key(model: str, backend: str) -> str:
    """Where a model is, for "is that server serving this model": a local path made absolute."""
    if backend != "vllm" or preflight.is_local_path(model):
        return os.path.abspath(os.path.expanduser(model))
    return model


# ---------------------------------------------------------------------------------------------
# the steps


def step_inputs(run: Run) -> Outcome:
    """The model path, the name and the port; and whether a live server can be reused."""
    req = run.request
    run.name = state.check_name(req.name or f"{req.backend}-{req.port}")
    run.local = preflight.check_model(req.model, req.backend)
    found = [f"model {run.local} (local)" if run.local else f"model {req.model} (a hub id)"]
    existing = state.read_record(run.name)
    if existing and process.is_ours(existing.pid, existing.pid_create_time):
        same = (existing.backend, existing.port, _model_key(existing.model, existing.backend)) == (
            req.backend,
            req.port,
            _model_key(req.model, req.backend),
        )
        if same:
            run.reuse = existing
            found.append(f"server {run.name} already runs it ({existing.base_url}): reused")
            return Outcome("ok", found)
        preflight.check_running(existing)  # refused: that name serves something else
    preflight.check_port(req.host, req.port)
    found.append(f"name {run.name}, port {req.port} free")
    return Outcome("ok", found)


def _blocks(check: Check, req: BringUpRequest) -> bool:
    """Does a failed doctor line stop this backend? The patch step handles the Turing line; the
    engine and llama.cpp need no vLLM, and no GPU unless asked to serve on one."""
    if check.status != "fail" or check.name == "turing patch":
        return False
    if req.backend == "vllm" or check.name in HOST_CHECKS:
        return True
    if req.backend == "engine" and check.name in ("torch", "gpu probe"):
        return True
    return check.name in ("driver", "gpu") and (req.device or "").startswith("cuda")


def step_doctor(run: Run) -> Outcome:
    """doctor, judged for this backend; for vLLM also: can the serving interpreter run it?"""
    req = run.request
    if run.reuse:
        return Outcome(
            "skipped",
            [f"{run.name} is running: checked when it started (gpurig doctor checks again)"],
        )
    python = req.python_bin or (cmd.engine_python() if req.backend == "engine" else None)
    weights = preflight.weights_gib(run.local, req.model)
    report = doctor(python, need_gib=weights or None)
    ok = [c.name for c in report.checks if c.status == "ok"]
    found = [f"ok: {', '.join(ok)}"] if ok else []
    blocking = [c for c in report.checks if _blocks(c, req)]
    for c in report.checks:
        if c.name in ("vllm", "turing patch") and req.backend != "vllm":
            continue  # not this backend's business
        if c.status in ("ok", "skip") and c.name != "turing patch":
            continue
        if c in blocking:
            found.append(short_text(f"FAIL {c.name}: {c.detail}"))
        elif c.name == "turing patch":
            found.append(short_text(f"turing patch ({c.status}; the next step): {c.detail}"))
        else:
            note = "" if c.status == "warn" else f" (not needed for the {req.backend})"
            found.append(short_text(f"{c.status} {c.name}{note}: {c.detail}"))
    if req.backend == "vllm":  # the start's own check, before a GPU's absence is judged
        run.python = resolve_python(req.python_bin)
        try:
            install = cmd.find_vllm(run.python, {**os.environ, **req.env})
        except GpurigError as err:
            return Outcome("failed", [err.message, *found], err.remedy)
        found.append(f"{install.label} for {run.python}")
    if blocking:
        fixes = [f"{c.name}: {c.remedy}" for c in blocking if c.remedy]
        if req.backend == "vllm" and any(c.name == "driver" for c in blocking):
            fixes.append(
                "or serve without a GPU: "
                + either(cli="gpurig up MODEL --backend engine", mcp="backend='engine'")
                + " (or vLLM's CPU build)"
            )
        return Outcome("failed", found, "; ".join(fixes) or "read the report: gpurig doctor")
    return Outcome("ok", found)


def step_patch(run: Run) -> Outcome:
    """Below capability 8: verify the Turing clamp, apply it when vLLM is stock, verify again."""
    req = run.request
    if req.backend != "vllm":
        return Outcome("skipped", [f"only vLLM needs it, not the {req.backend}"])
    run.python = run.python or resolve_python(req.python_bin)
    run.gpus = run.gpus or preflight.measure_gpus()
    cap = run.gpus.min_capability
    if cap is None or cap[0] >= 8:
        why = f"capability {cap[0]}.{cap[1]}" if cap else f"no NVIDIA GPU ({run.gpus.error})"
        return Outcome("skipped", [f"{why}: not needed (it is for GPUs below 8.0)"])
    report = verify_turing_patch(run.python)
    where = f"vLLM {report.vllm_version} at {report.path}"
    if not report.needed:
        return Outcome("skipped", [f"{report.vllm_label}: not needed"])
    if report.state_after == "patched":
        return Outcome("reused", [f"{where}: patched", "verified; not applied again"])
    if report.state_after == "stock" and not req.apply_patch:
        return Outcome(
            "failed",
            [f"{where}: stock; capability {cap[0]}.{cap[1]} needs the clamp for Gemma 4"],
            "apply it: "
            + either(
                cli=f"gpurig patch apply --python {run.python}",
                mcp=f"call apply_turing_patch(python_bin='{run.python}')",
            )
            + either(cli=", or run without --no-patch", mcp=", or pass apply_patch=true"),
        )
    applied = apply_turing_patch(run.python)  # refuses a modified file, with the reinstall
    check = verify_turing_patch(run.python)
    if check.state_after != "patched":
        return Outcome(
            "failed",
            [f"{where}: {applied.state_before} -> {check.state_after} ({check.detail})"],
            "report this to gpurig with your vLLM version; gpurig patch diff shows the change",
        )
    return Outcome(
        "ok", [f"{where}: {applied.state_before} -> patched (verified)", f"backup {applied.backup}"]
    )


def _start_progress(run: Run) -> Progress:
    def report(done: float, total: float | None, message: str) -> None:
        run.tell(done / total if total else 0.0, short_text(f"{done:.0f} s: {message}"))

    return report


def _server_facts(record: ServerRecord) -> list[str]:
    f = record.startup_facts
    found = [f"{record.name}: {record.state} at {record.base_url} as {record.served_model_name}"]
    if record.ready_seconds is not None:
        found.append(f"ready in {record.ready_seconds} s")
    facts = {
        "backend": record.vllm_label or record.backend,
        "weights GiB": f.weights_gib,
        "KV cache tokens": f.kv_cache_tokens,
        "max concurrency": f.max_concurrency,
        "device": f.device,
        "attention": f.attention_backend,
        "linear kernel": f.linear_kernel,
    }
    found += [f"{k} {v}" for k, v in facts.items() if v is not None]
    return found


def step_start(run: Run) -> Outcome:
    """start_vllm_server, or the reused server (waited for, if it is still starting)."""
    req = run.request
    if run.reuse:
        record = run.reuse
        if refresh(record, check_health=True).state == "starting":
            record = wait_ready(record, req.timeout_s, _start_progress(run))
        now = refresh(record, check_health=True)
        run.record = record
        if now.state != "ready":
            return Outcome(
                "failed",
                [f"{run.name} is {now.state} ({now.health_detail or now.ended})"],
                f"gpurig serve logs {run.name}; restart it: gpurig serve stop {run.name}, "
                "then bring it up again",
            )
        return Outcome("reused", [*_server_facts(record), f"up {now.uptime_s} s"])
    run.old_record = state.read_record(run.name)  # to tell the server we start from it
    record = start_vllm_server(
        req.model, backend=req.backend, name=run.name, python_bin=req.python_bin,
        host=req.host, port=req.port, dtype=req.dtype,
        gpu_memory_utilization=req.gpu_memory_utilization,
        tensor_parallel_size=req.tensor_parallel_size, max_model_len=req.max_model_len,
        max_num_seqs=req.max_num_seqs, extra_args=list(req.extra_args), env=dict(req.env),
        timeout_s=req.timeout_s, progress=_start_progress(run), device=req.device,
        cpu_kv_cache_gib=req.cpu_kv_cache_gib, gpus=run.gpus,
    )  # fmt: skip
    run.record = record
    if record.state == "ready":
        return Outcome("ok", _server_facts(record))
    f = record.failure
    found = [f"{record.name} {record.state}"]
    if f is not None:
        found += [short_text(f"{f.title} [{f.cause}]")] + (
            [short_text(f.evidence)] if f.evidence else []
        )
    remedy = f.remedy if f else "read the log"
    return Outcome("failed", found, f"{remedy} (the log: gpurig serve logs {record.name})")


def step_spot_check(run: Run) -> Outcome:
    """The built-in checks and the request's own, at temperature 0."""
    req = run.request
    if not req.builtin_checks and not req.checks:
        return Outcome("skipped", ["no checks asked for"])
    assert run.record is not None
    result = spot_check(
        name=run.record.name,
        checks=[c.model_dump() for c in req.checks],
        builtin_checks=req.builtin_checks,
    )
    run.spot = result
    found = [
        f"{'PASS' if c.passed else 'FAIL'} {c.expect}: answered {_clip(c.answer)!r}"
        for c in result.checks
    ]
    found.insert(0, f"{result.passed}/{len(result.checks)} passed")
    if result.ok:
        return Outcome("ok", found)
    name = run.record.name
    return Outcome(
        "failed",
        found,
        "the server answers, but wrongly (wrong or random weights, the dtype, a patch?); it is "
        "kept running to look at: "
        + either(
            cli=f"gpurig serve query 'What is 17*23?' --name {name}; stop it: "
            f"gpurig serve stop {name}",
            mcp=f"query_model(name='{name}'); stop it: stop_vllm_server(name='{name}')",
        ),
    )


def step_sweep(run: Run) -> Outcome:
    """A short sweep against the server: one input length, concurrency 1 and 4."""
    req = run.request
    if not req.sweep:
        return Outcome("skipped", [f"not asked for ({arg('sweep')}: concurrency 1 and 4)"])
    assert run.record is not None and run.measure is not None

    def report(done: int, total: int, message: str) -> None:
        run.tell(done / total if total else 0.0, short_text(f"{done}/{total}: {message}"))

    summary = run.measure(run.record, req, report)
    run.sweep = summary
    found = [
        f"input {c.input_len}, concurrency {c.concurrency}: {_num(c.output_tok_s)} tok/s "
        f"({_num(c.per_stream_tok_s)} per stream), TTFT p50 {_num(c.ttft_p50_ms)} ms"
        if c.status == "ok"
        else short_text(f"input {c.input_len}, concurrency {c.concurrency}: {c.status} {c.reason}")
        for c in summary.cells
    ]
    found.append(f"report {summary.report or summary.out_dir}")
    if summary.failures or any(c.status != "ok" for c in summary.cells):
        return Outcome(
            "failed",
            found + [short_text(f) for f in summary.failures],
            f"read {summary.report or summary.out_dir} and the server's log "
            f"(gpurig serve logs {run.record.name}); the server is kept running",
        )
    more = either(cli="gpurig sweep run", mcp="run_sweep")
    return Outcome("ok", found, f"more loads and repeats: {more}")


STEP_FUNCS: dict[StepName, Callable[[Run], Outcome]] = {
    "inputs": step_inputs,
    "doctor": step_doctor,
    "turing patch": step_patch,
    "start": step_start,
    "spot check": step_spot_check,
    "sweep": step_sweep,
}
