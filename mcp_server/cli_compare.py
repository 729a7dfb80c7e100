"""`gpurig compare`: token-level comparison of two OpenAI-compatible servers (compare_outputs).

Nothing heavy at import time: tools.compare (httpx) and transformers load inside the command.
Exit 1 when a prompt diverges beyond a near-tie, 2 for bad input (a down server, mismatched
vocabularies, a missing reference checkpoint), 0 otherwise.
"""

from __future__ import annotations

import argparse

from mcp_server.output import grid, kv_table, print_result


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="greedy tokens of two servers side by side, with log-probabilities (compare_outputs)",
        description="Send the same token-id prompts, greedy, to two OpenAI-compatible servers "
        "and report per prompt the identical leading tokens and, at the first difference, both "
        "tokens with their log-probabilities (a near-tie or a real difference). --reference "
        "adds transformers in-process on a local checkpoint and says which side departs first.",
    )
    p.add_argument("url_a", metavar="URL_A", help="first server, e.g. http://127.0.0.1:8000")
    p.add_argument("url_b", metavar="URL_B", help="second server, e.g. http://127.0.0.1:8100/v1")
    p.add_argument("--name-a", help="label of the first server (default a)")
    p.add_argument("--name-b", help="label of the second server (default b)")
    p.add_argument("--model-a", help="served model name (default: the first it lists)")
    p.add_argument("--model-b", help="served model name (default: the first it lists)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="a token-id prompt, comma-separated (repeatable); default: 8 built-in texts",
    )
    p.add_argument(
        "--text", action="append", metavar="TEXT", help="a text prompt, tokenised by server a"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (32)")
    p.add_argument("--top-logprobs", type=int, default=5, help="alternatives per step (5, <=20)")
    p.add_argument(
        "--near-tie", type=float, default=0.1, help="log-prob gap (nats) that is a near-tie (0.1)"
    )
    p.add_argument("--reference", metavar="DIR", help="local checkpoint for transformers")
    p.add_argument(
        "--reference-dtype", choices=["float32", "float64", "bfloat16"], default="float32"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (300)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)


def _ids(text: str, parser_error) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        parser_error(f"--prompt-ids {text!r} is not a comma-separated list of token ids")
        raise


def _run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tools.compare import CompareRequest, ServerTarget, compare_outputs
    from tools.errors import InvalidInputError

    error = args._parser.error
    prompts = [_ids(t, error) for t in args.prompt_ids] if args.prompt_ids else None
    try:
        request = CompareRequest(
            a=ServerTarget(base_url=args.url_a, name=args.name_a, model=args.model_a),
            b=ServerTarget(base_url=args.url_b, name=args.name_b, model=args.model_b),
            prompts=prompts,
            texts=args.text,
            max_tokens=args.max_tokens,
            top_logprobs=args.top_logprobs,
            near_tie=args.near_tie,
            reference=args.reference,
            reference_dtype=args.reference_dtype,
            timeout_s=args.timeout,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidInputError(
            f"{where}: {first['msg']}", "see `gpurig compare --help` for the accepted values"
        ) from None
    result = compare_outputs(request)
    print_result(result, args.json, render)
    return 1 if result.verdict == "fail" else 0


def _lp(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def render(r) -> str:  # r: tools.compare.CompareResult
    a, b = r.a.name, r.b.name
    with_ref = r.reference is not None
    headers = ["#", "prompt", "agreed", "verdict", "at", "tokens a/b", f"on {a}", f"on {b}"]
    if with_ref:
        headers += ["ref kept a/b", "departs first", "ref margin"]
    rows = []
    for p in r.prompts:
        d = p.difference
        row: list[object] = [p.index, p.prompt_tokens, f"{p.agreed}/{p.compared}", p.verdict]
        if d is None:
            row += ["", "", "", ""]
        else:
            row += [
                d.position,
                f"{d.a.token}/{d.b.token}",
                f"{_lp(d.a.logprob)} / {_lp(d.a.other_logprob)}",
                f"{_lp(d.b.other_logprob)} / {_lp(d.b.logprob)}",
            ]
        if with_ref and p.reference is not None:
            ref = p.reference
            margin = {"a": ref.margin_at_a, "b": ref.margin_at_b}.get(ref.departs_first)
            if ref.departs_first == "both":
                margin = ref.margin_at_a
            row += [f"{ref.agreed_a}/{ref.agreed_b}", ref.departs_first, _lp(margin)]
        rows.append(row)
    head = kv_table(
        [
            ("a", f"{a}: {r.a.base_url} ({r.a.model})"),
            ("b", f"{b}: {r.b.base_url} ({r.b.model})"),
            ("greedy tokens", f"{r.max_tokens} per prompt, top {r.top_logprobs} logprobs"),
            (
                "reference",
                f"transformers {r.reference_dtype} on {r.reference}" if with_ref else "-",
            ),
        ]
    )
    legend = (
        f"at: the first differing token; on X: X's log-probability of token a / of token b "
        f"(-: not in its top {r.top_logprobs}); near-tie: both sides' gaps <= {r.near_tie}"
    )
    if with_ref:
        legend += "; ref margin: transformers' own gap where the first side departs from it"
    tail = (
        f"verdict: {r.verdict}  ({r.identical} identical, {r.near_ties} near-tie, {r.diverged} "
        f"diverged; fewest agreed {r.min_agreed}; {r.seconds:.1f} s)"
    )
    notes = "".join(f"\nnote: {n}" for n in r.notes)
    return f"{head}\n\n{grid(rows, headers)}\n\n{legend}\n{tail}{notes}"
