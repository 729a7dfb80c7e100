"""`evaluate`: the answers of one or two OpenAI-compatible servers to the same questions, scored
and paired question by question (the MCP tool `evaluate`, `gpurig eval` and the tests call it).

Why paired: two servers of the same checkpoint (our engine and llama.cpp, or vLLM) should give
the same answers; totals alone hide two servers that are each right on 1,186 questions but not
the same ones (seed 000: 26 going each way on GSM8K). The questions both got right or wrong say
nothing about the difference; McNemar's exact test on the rest does.

The plan (questions, servers, decoding) is saved before the first question; each finished
question is one durable line, so a killed run resumes where it stopped and asks nothing twice.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from pathlib import Path

from bench.eval import report
from bench.eval.client import ChatClient, ServerDown
from bench.eval.judge import judge
from bench.eval.models import EvalRequest, EvalResult, Question, Row, RunConfig, ServerSpec
from bench.eval.store import RunStore
from bench.eval.suites import bfcl, jsonl, recall
from tools.errors import InvalidInputError, NotFoundError, arg
from tools.settings import state_dir

Progress = Callable[[int, int, str], None]
LABELS = ("a", "b")


def evals_dir() -> Path:
    return state_dir() / "evals"


def find_run_dir(ref: str) -> Path:
    """A run directory from a path or a run id (under GPURIG_HOME/evals)."""
    for path in (Path(ref).expanduser(), evals_dir() / ref):
        if RunStore(path).exists():
            return path.resolve()
    raise NotFoundError(
        f"no evaluation run at {ref}",
        f"pass a run's directory or its id (runs live in {evals_dir()})",
    )


def _questions(request: EvalRequest, first: ChatClient) -> list[Question]:
    if request.suite == "bfcl":
        questions = bfcl.load(request.bfcl_category)
    elif request.suite == "recall":
        n = request.limit or recall.DEFAULT_QUESTIONS
        return recall.load(request.recall_tokens, n, request.seed, first.count_tokens)
    else:
        questions = jsonl.load(request.path or "", request.scoring)
    return questions[: request.limit] if request.limit else questions


def _connect(specs: list[ServerSpec], request: EvalRequest) -> list[ChatClient]:
    clients: list[ChatClient] = []
    try:
        for label, spec in zip(LABELS, specs, strict=False):
            clients.append(
                ChatClient(spec, spec.name or label, request.timeout_s, request.concurrency)
            )
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients


def _plan(request: EvalRequest) -> tuple[RunStore, RunConfig, list[Question], list[ChatClient]]:
    """A new run's directory and questions, or a resumed run's, with its servers connected."""
    if request.resume:
        store = RunStore(find_run_dir(request.resume))
        config, questions = store.load_plan()
        specs = config.servers
        if request.servers:  # the same servers again, perhaps on new ports
            if len(request.servers) != len(specs):
                raise InvalidInputError(
                    f"the run has {len(specs)} servers, {len(request.servers)} given",
                    "give as many servers as the run had, or none to reuse its URLs",
                )
            specs = [
                s.model_copy(update={"name": old.name, "model": s.model or old.model})
                for s, old in zip(request.servers, specs, strict=True)
            ]
        return store, config, questions, _connect(specs, config.request)
    run_id = f"eval-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    store = RunStore(
        Path(request.out_dir).expanduser() if request.out_dir else evals_dir() / run_id
    )
    if store.exists():
        raise InvalidInputError(
            f"{store.dir} already holds an evaluation run",
            f"continue it with {arg('resume')} {store.dir}, or choose another {arg('out_dir')}",
        )
    specs = [s.model_copy(update={"name": s.name or lbl}) for lbl, s in zip(LABELS, request.servers, strict=False)]  # fmt: skip
    clients = _connect(specs, request)
    try:
        questions = _questions(request, clients[0])
    except BaseException:
        for c in clients:
            c.close()
        raise
    specs = [c.spec.model_copy(update={"model": c.model}) for c in clients]
    config = RunConfig(run_id=run_id, request=request, servers=specs, questions=len(questions))
    store.save_plan(config, questions)
    return store, config, questions, clients


def _ask_all(
    todo: list[Question],
    clients: list[ChatClient],
    config: RunConfig,
    store: RunStore,
    progress: Progress | None,
    done_before: int,
    total: int,
) -> int:
    """Ask every question of `todo` of every server, `concurrency` questions at a time; each
    is stored as it finishes. A server that goes away stops the run after the questions in
    flight are stored. Returns how many were asked."""
    lock = threading.Lock()
    done = [done_before]
    stop = threading.Event()

    def one(q: Question) -> None:
        if stop.is_set():
            return
        answers = {}
        for c in clients:
            answer, _ = c.ask(q, config.request)
            verdict = judge(q, answer)
            answers[c.name] = answer.model_copy(update=verdict.model_dump())
        with lock:
            store.append(Row(id=q.id, answers=answers))
            done[0] += 1
            if progress:
                progress(done[0], total, q.id)

    with ThreadPoolExecutor(max_workers=config.request.concurrency) as pool:
        futures: list[Future[None]] = [pool.submit(one, q) for q in todo]
        try:
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C: what is stored stays stored
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        failed = [f for f in finished if f.exception() is not None]
        if failed:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            exc = failed[0].exception()
            if isinstance(exc, ServerDown):
                raise ServerDown(
                    f"{exc.message}; {done[0]} of {total} questions are stored in {store.dir}",
                    f"start the server again, then continue with {arg('resume')} {store.dir}",
                ) from None
            raise exc  # type: ignore[misc]
    return done[0] - done_before


def evaluate(request: EvalRequest, progress: Progress | None = None) -> EvalResult:
    """Ask, score, pair and report; see the module docstring. Refused with what to do: a
    server that cannot be reached, a missing or malformed question file, no BFCL wheel."""
    start = time.monotonic()
    store, config, questions, clients = _plan(request)
    try:
        with store.running():
            rows = store.load_rows(repair=True)
            done = {r.id for r in rows}
            todo = [q for q in questions if q.id not in done]
            asked = _ask_all(todo, clients, config, store, progress, len(done), len(questions))
    finally:
        for c in clients:
            c.close()
    by_id = {r.id: r for r in store.load_rows()}
    rows = [by_id[q.id] for q in questions if q.id in by_id]
    return _result(store, config, rows, asked, time.monotonic() - start)


def _result(
    store: RunStore, config: RunConfig, rows: list[Row], asked: int, seconds: float
) -> EvalResult:
    servers = config.servers
    names = [s.name or "" for s in servers]
    notes = []
    if config.request.temperature > 0:
        notes.append(f"sampled at temperature {config.request.temperature}: answers may vary")
    result = EvalResult(
        run_id=config.run_id,
        out_dir=str(store.dir),
        suite=config.request.suite,
        questions=len(rows),
        asked_now=asked,
        totals=report.totals(rows, servers),
        paired=report.paired(rows, names[0], names[1]) if len(names) == 2 else None,
        answers_path=str(store.answers_path),
        report=str(store.report_path),
        seconds=round(seconds, 2),
        notes=notes,
    )
    store.save_results(result.model_dump_json(indent=2) + "\n", report.markdown(result))
    return result
