"""`gpurig eval`: one or two OpenAI-compatible servers scored and paired question by question
(the MCP tool `evaluate`; both call bench.eval.evaluate).

Nothing heavy at import time. Exit 0 when the run finished (whatever the scores: a score is a
measurement, not a failure), 2 for bad input (a server that is down, a malformed question file,
no BFCL wheel), 130 on Ctrl-C (the finished questions stay stored; --resume continues).
"""

from __future__ import annotations

import argparse

from bench.eval.models import EvalArguments
from mcp_server.output import grid, kv_table, print_result
from mcp_server.request_flags import Door, Flag, add_flags, build
from tools.errors import InvalidInputError

# EvalArguments' fields on the command line where the rule (--field-name) does not fit
EVAL = Door(
    EvalArguments,
    flags={
        "a": Flag(
            names=("urls",),
            nargs="*",
            metavar="URL",
            spread=("a", "b"),
            help="one or two servers (none: --resume)",
        ),
        "a_name": Flag(names=("--name-a",), help="label of the first server (default a)"),
        "b_name": Flag(names=("--name-b",), help="label of the second server (default b)"),
        "a_model": Flag(
            names=("--model-a",), help="served model name (default: the first it lists)"
        ),
        "b_model": Flag(
            names=("--model-b",), help="served model name (default: the first it lists)"
        ),
        "path": Flag(metavar="FILE", help="jsonl suite: the question file"),
        "scoring": Flag(help="jsonl (default: auto)"),
        "recall_tokens": Flag(help="recall prompt size (1024)"),
        "max_tokens": Flag(help="per answer (256)"),
        "temperature": Flag(help="0: greedy (default)"),
        "concurrency": Flag(help="questions in flight (4)"),
        "timeout_s": Flag(names=("--timeout",), help="seconds per answer (300)"),
        "out_dir": Flag(help="run directory (default: GPURIG_HOME/evals/<run id>)"),
        "resume": Flag(metavar="DIR|ID", help="continue a run from its files"),
    },
    cli_only={"--json": "prints the result as JSON instead of tables: nothing to send"},
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score one or two servers on the same questions, paired (evaluate)",
        description="Ask one or two OpenAI-compatible servers the same questions through "
        "/v1/chat/completions (greedy, seeded), score each answer, and pair them question by "
        "question: totals with 95% intervals, both right / only A / only B / both wrong, "
        "McNemar's exact p and the ids that differ. Suites: bfcl (BFCL v4: simple, multiple, parallel, irrelevance, ...), jsonl "
        "(your {id, prompt, answer} file; exact or last number), recall (six-digit codes in "
        "numbered records). A killed run continues with --resume DIR.",
    )
    add_flags(p, EVAL)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bench.eval.run import evaluate
    from bench.sweep.progress import ProgressBar

    if len(args.urls) > 2:
        raise InvalidInputError(
            f"{len(args.urls)} servers given", "give one or two URLs: URL_A [URL_B]"
        )
    request = build(EVAL, args).request()
    result = evaluate(request, None if args.json else ProgressBar())
    print_result(result, args.json, render)
    return 0


def render(r) -> str:  # r: bench.eval.models.EvalResult
    from bench.eval.report import ids_line, paired_table, totals_table

    head = kv_table(
        [
            ("run", f"{r.run_id}  ({r.out_dir})"),
            ("suite", f"{r.suite}: {r.questions} questions ({r.asked_now} asked now)"),
        ]
        + [(t.server, f"{t.base_url} ({t.model})") for t in r.totals]
    )
    parts = [head, totals_table(r, "simple")]
    p = r.paired
    if p is not None:
        a, b = r.totals[0].server, r.totals[1].server
        parts.append(paired_table(r, "simple"))
        parts.append(
            grid(
                [
                    ["McNemar exact p", f"{p.mcnemar_p:.4g}"],
                    ["same answer", f"{p.same_answer} of {r.questions}"],
                    [f"only {a} right", ids_line(p.only_a_ids, 10)],
                    [f"only {b} right", ids_line(p.only_b_ids, 10)],
                    ["answers differ", ids_line(p.differing_ids, 10)],
                ],
                ["", ""],
            )
        )
    tail = f"answers: {r.answers_path}\nreport: {r.report}  ({r.seconds:.1f} s)"
    notes = "".join(f"\nnote: {n}" for n in r.notes)
    return "\n\n".join(parts) + "\n\n" + tail + notes
