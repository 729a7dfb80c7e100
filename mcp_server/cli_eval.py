"""`gpurig eval`: one or two OpenAI-compatible servers scored and paired question by question
(the MCP tool `evaluate`; both call bench.eval.evaluate).

Nothing heavy at import time. Exit 0 when the run finished (whatever the scores: a score is a
measurement, not a failure), 2 for bad input (a server that is down, a malformed question file,
no BFCL wheel), 130 on Ctrl-C (the finished questions stay stored; --resume continues).
"""

from __future__ import annotations

import argparse

from mcp_server.output import grid, kv_table, print_result


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score one or two servers on the same questions, paired (evaluate)",
        description="Ask one or two OpenAI-compatible servers the same questions through "
        "/v1/chat/completions (greedy, seeded), score each answer, and pair them question by "
        "question: totals with 95%% intervals, both right / only A / only B / both wrong, "
        "McNemar's exact p and the ids that differ. Suites: bfcl (BFCL v4 simple), jsonl "
        "(your {id, prompt, answer} file; exact or last number), recall (six-digit codes in "
        "numbered records). A killed run continues with --resume DIR.",
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="one or two servers (none: --resume)")
    p.add_argument("--suite", choices=["bfcl", "jsonl", "recall"], default="jsonl")
    p.add_argument("--path", metavar="FILE", help="jsonl suite: the question file")
    p.add_argument("--scoring", choices=["exact", "last_number"], help="jsonl (default: auto)")
    p.add_argument(
        "--bfcl-category", choices=["simple_python", "live_simple"], default="simple_python"
    )
    p.add_argument("--recall-tokens", type=int, default=1024, help="recall prompt size (1024)")
    p.add_argument("--limit", type=int, help="the first N questions only")
    p.add_argument("--name-a", help="label of the first server (default a)")
    p.add_argument("--name-b", help="label of the second server (default b)")
    p.add_argument("--model-a", help="served model name (default: the first it lists)")
    p.add_argument("--model-b", help="served model name (default: the first it lists)")
    p.add_argument("--max-tokens", type=int, default=256, help="per answer (256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="questions in flight (4)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per answer (300)")
    p.add_argument("--out-dir", help="run directory (default: GPURIG_HOME/evals/<run id>)")
    p.add_argument("--resume", metavar="DIR|ID", help="continue a run from its files")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bench.eval.models import build_request
    from bench.eval.run import evaluate
    from bench.sweep.progress import ProgressBar
    from tools.errors import InvalidInputError

    if len(args.urls) > 2:
        raise InvalidInputError(
            f"{len(args.urls)} servers given", "give one or two URLs: URL_A [URL_B]"
        )
    labels = [(args.name_a, args.model_a), (args.name_b, args.model_b)]
    servers = [
        {"base_url": url, "name": name, "model": model}
        for url, (name, model) in zip(args.urls, labels, strict=False)
    ]
    request = build_request(
        servers=servers,
        suite=args.suite,
        path=args.path,
        scoring=args.scoring,
        bfcl_category=args.bfcl_category,
        recall_tokens=args.recall_tokens,
        limit=args.limit,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        out_dir=args.out_dir,
        resume=args.resume,
    )
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
