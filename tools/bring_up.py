"""bring_up: from a bare host to a served, checked and (optionally) measured model in one call.

The steps, in order, stopping at the first failure with its cause and the command that fixes
it: inputs (the model path, the name, the port: milliseconds, so a typo does not wait for the
seconds-long doctor) -> doctor -> turing patch (below capability 8) -> start -> spot check ->
sweep (optional: one input length, concurrency 1 and 4, one repeat). Every step reports what it
found, how long it took and what to do next; progress goes to `progress(done, total, message)`
with `done` in [0, number of steps].

Idempotent: a live server of that name, backend, model and port is reused (its doctor is
skipped: the running server's own RAM would count against the staging check) and a patched vLLM
is verified, not patched again.

Why the sweep is handed in (`measure`): it lives in bench/, and bench imports tools; tools
importing bench back would make the two packages depend on each other. The front doors pass
bench.bring_up_sweep.short_sweep.

What stays running: a server this call started is stopped again if the call ends in an
exception (a crash, Ctrl-C). A server that started and then failed its spot check (or sweep) is
kept, as `vllm serve` would be: it loaded and serves, the wrong answers are there to be looked
at (query_model, logs) without minutes of loading again, and a second bring_up reuses it. The
report says how to stop it.
"""

from __future__ import annotations

import contextlib
import time

from tools.bring_up_models import STEPS, BringUpReport, BringUpRequest, Step, StepName
from tools.bring_up_steps import (
    STEP_FUNCS,
    Measure,
    Outcome,
    Progress,
    Run,
    SweepProgress,
    short_text,
)
from tools.errors import GpurigError, InvalidInputError, either
from tools.serving import state
from tools.serving.control import stop_vllm_server
from tools.serving.preflight import GpuFacts

__all__ = ["Measure", "Progress", "SweepProgress", "bring_up"]


def _run_step(run: Run, name: StepName) -> Step:
    run.tell(0.0, "running")
    t0 = time.monotonic()
    try:
        out = STEP_FUNCS[name](run)
    except GpurigError as err:
        out = Outcome("failed", [short_text(err.message)], err.remedy)
    step = Step(
        name=name,
        status=out.status,
        found=out.found,
        seconds=round(time.monotonic() - t0, 2),
        next=out.next,
    )
    run.tell(1.0, step.status)
    return step


def _final_next(run: Run, failed: Step | None) -> str:
    if failed is not None:
        return failed.next or f"see the {failed.name} step"
    record = run.record
    assert record is not None
    return f"{record.served_model_name} is served at {record.base_url}: " + either(
        cli=f"gpurig serve query 'Hello' --name {record.name}; stop it with "
        f"gpurig serve stop {record.name}",
        mcp=f"query_model(name='{record.name}'); stop_vllm_server(name='{record.name}') when done",
    )


def _stop_if_started(run: Run) -> None:
    """After an exception: stop the server this call started (not one it found running)."""
    with contextlib.suppress(Exception):
        now = state.read_record(run.name) if run.name else None
        before = run.old_record
        if now is None or run.reuse is not None or run.index < STEPS.index("start"):
            return
        if before is not None and before.started_at == now.started_at and before.pid == now.pid:
            return
        stop_vllm_server(now.name, timeout_s=15)


def bring_up(
    request: BringUpRequest,
    progress: Progress | None = None,
    measure: Measure | None = None,
    gpus: GpuFacts | None = None,
) -> BringUpReport:
    """Run the steps (see the module docstring) and return one report of them all.

    `measure` runs the sweep step (bench.bring_up_sweep.short_sweep); `gpus` replaces the
    measured GPU facts (tests replay a recorded T4 with it), as in start_vllm_server."""
    if request.sweep and measure is None:
        raise InvalidInputError(
            "a sweep was asked for, but no sweep runner was given",
            remedy="pass measure=bench.bring_up_sweep.short_sweep (the CLI and MCP tool do)",
        )
    run = Run(request=request, progress=progress, measure=measure, gpus=gpus)
    t0 = time.monotonic()
    failed: Step | None = None
    try:
        for i, name in enumerate(STEPS):
            run.index = i
            step = _run_step(run, name)
            run.steps.append(step)
            if step.status == "failed":
                failed = step
                break
    except BaseException:
        _stop_if_started(run)
        raise
    record = state.read_record(run.record.name) if run.record else None
    return BringUpReport(
        status="failed" if failed else "ok",
        failed_step=failed.name if failed else None,
        steps=run.steps,
        server=record or run.record,
        spot_check=run.spot,
        sweep=run.sweep,
        next=_final_next(run, failed),
        seconds=round(time.monotonic() - t0, 2),
    )
