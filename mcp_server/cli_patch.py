"""`gpurig patch apply|verify|revert|diff`: the Turing clamp from the command line.

Exit codes: 0 when the clamp ends up as asked (apply/verify: present; revert: absent),
1 when verify finds it absent, 2 for a refusal or error (printed with what to do).
"""

from __future__ import annotations

import argparse
import sys

from mcp_server.output import kv_table, print_result


def register(subparsers: argparse._SubParsersAction) -> None:
    patch = subparsers.add_parser(
        "patch",
        help="the Turing shared-memory clamp for vLLM (apply, verify, revert, diff)",
        description="Apply, verify or revert gpurig's clamp of vLLM's Triton attention tiles, "
        "needed to serve Gemma 4 on GPUs below compute capability 8.0 (Turing).",
    )
    sub = patch.add_subparsers(dest="patch_command", metavar="ACTION")
    patch.set_defaults(func=lambda _a: (patch.print_help(), 2)[1])

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--python",
            metavar="PATH",
            help="the interpreter that runs vLLM (default: $GPURIG_PYTHON, else this Python)",
        )
        p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("apply", help="insert the clamp (idempotent; keeps a backup)")
    common(p)
    p.add_argument("--dry-run", action="store_true", help="report what would change, write nothing")
    p.set_defaults(func=_apply)

    p = sub.add_parser(
        "verify",
        help="stock, patched or modified? (exit 1 unless patched; 0 for a CPU build: not needed)",
    )
    common(p)
    p.set_defaults(func=_verify)

    p = sub.add_parser("revert", help="restore the file exactly as the vLLM wheel installed it")
    common(p)
    p.add_argument("--dry-run", action="store_true", help="report what would change, write nothing")
    p.set_defaults(func=_revert)

    p = sub.add_parser("diff", help="print the clamp as a unified diff (git apply -p1 ready)")
    common(p)
    p.add_argument(
        "--upstream", action="store_true", help="leave out gpurig's marker comments (for vLLM)"
    )
    p.add_argument(
        "--file", metavar="PATH", help="diff this file (e.g. in a vLLM checkout) instead"
    )
    p.set_defaults(func=_diff)


def _render(report) -> str:
    rows: list[tuple[str, object]] = [
        ("patch", report.patch),
        ("file", report.path),
        ("vllm", report.vllm_label or report.vllm_version),
        ("python", report.python),
        (
            "state",
            f"{report.state_before} -> {report.state_after}"
            + (" (dry run)" if report.dry_run else ""),
        ),
        ("changed", ("would change" if report.dry_run else "yes") if report.changed else "no"),
        ("detail", report.detail),
        ("backup", report.backup),
    ]
    rows += [("shadowed", s) for s in report.shadowed]
    return f"{kv_table(rows)}\n{report.verdict}\nOCCURRENCES {report.occurrences}"


def _apply(args: argparse.Namespace) -> int:
    from tools.turing import apply_turing_patch

    report = apply_turing_patch(args.python, dry_run=args.dry_run)
    print_result(report, args.json, _render)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tools.turing import verify_turing_patch

    report = verify_turing_patch(args.python)
    print_result(report, args.json, _render)
    return 0 if report.clamp_present or not report.needed else 1


def _revert(args: argparse.Namespace) -> int:
    from tools.turing import revert_turing_patch

    report = revert_turing_patch(args.python, dry_run=args.dry_run)
    print_result(report, args.json, _render)
    return 0


def _diff(args: argparse.Namespace) -> int:
    from tools.turing import patch_diff

    result = patch_diff(args.python, upstream=args.upstream, file=args.file)
    if args.json:
        print_result(result, True, str)
    else:
        sys.stdout.write(result.diff)
    return 0
