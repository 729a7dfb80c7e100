"""`gpurig up MODEL`: bring_up from a shell (doctor, Turing patch, start, spot check, sweep).

Calls the same function as the MCP tool and prints one table of the steps, or JSON with --json.
A live line on stderr follows the steps (rewritten in place on a terminal; elsewhere a line per
step and every 15 s). Exit codes: 0 every step ok, 1 a step failed (the report says which and
what to do), 2 bad input.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import time

from mcp_server.cli_serve import PRESENTATION, SERVER_FLAGS, check_pairs
from mcp_server.output import grid, print_result
from mcp_server.request_flags import Door, Flag, add_flags, build
from tools.bring_up_models import BringUpRequest

FOUND_WIDTH = 84

# BringUpRequest's fields on the command line where the rule does not fit (the server's own
# are cli_serve.SERVER_FLAGS, shared with `gpurig serve start`)
UP = Door(
    BringUpRequest,
    flags={
        **SERVER_FLAGS,
        "apply_patch": Flag(
            names=("--no-patch",),
            invert=True,
            help="below capability 8, stop at a stock vLLM instead of applying the Turing patch",
        ),
        "checks": Flag(
            names=("--check",), repeat=True, parse=check_pairs, metavar="PROMPT=>EXPECT"
        ),
        "builtin_checks": Flag(
            names=("--no-builtin-checks",), invert=True, help="only the --check ones"
        ),
        "sweep": Flag(help="end with concurrency 1 and 4"),
        "sweep_input_len": Flag(metavar="TOKENS"),
        "sweep_output_len": Flag(metavar="TOKENS"),
        "sweep_prompts": Flag(metavar="N"),
    },
    cli_only=PRESENTATION,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="bring a model up in one go: doctor, Turing patch, start, spot check, sweep",
        description="From a bare host to a served, checked (and with --sweep measured) model; "
        "stops at the first failure with its cause and the command that fixes it. A running "
        "server of that name and model is reused.",
    )
    add_flags(p, UP)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_up)


class StepLine:
    """The live line: step k of n, its seconds, and its last message."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0
        self.step = ""

    def __call__(self, done: float, total: float | None, message: str) -> None:
        elapsed = time.monotonic() - self.t0
        step, _, _rest = message.partition(":")
        text = (
            f"[{min(int(done) + 1, int(total or 1))}/{total or 0:.0f} {elapsed:5.1f} s] {message}"
        )
        if not self.tty:
            if step != self.step or time.monotonic() - self.last >= 15:
                self.step, self.last = step, time.monotonic()
                sys.stderr.write(f"gpurig: {text[:160]}\n")
            return
        width = shutil.get_terminal_size((100, 20)).columns
        sys.stderr.write("\r" + text[: width - 1].ljust(width - 1))
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def wrap_found(found: list[str], width: int = FOUND_WIDTH) -> list[str]:
    """The found column, folded so the table fits a terminal (continuations indented)."""
    wrap = textwrap.TextWrapper(
        width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )
    return [part for fact in found for part in wrap.wrap(fact)]


def render(report) -> str:
    rows = [
        [s.status.upper() if s.status == "failed" else s.status, s.name, f"{s.seconds:.1f}",
         "\n".join(wrap_found(s.found))]
        for s in report.steps
    ]  # fmt: skip
    out = grid(rows, ["status", "step", "s", "found"])
    todo = [(s.name, s.next) for s in report.steps if s.next and s.status != "failed"]
    if report.failed_step:
        todo_text = textwrap.fill(
            f"what to do: {report.next}", 100, subsequent_indent="    ", break_long_words=False
        )
        out += f"\n\nstopped at: {report.failed_step}\n{todo_text}"
    else:
        out += "\n\n" + "\n".join(f"{name}: {text}" for name, text in todo)
        out += f"\nnext: {report.next}"
    return out + f"\n\nbring-up: {report.status}  ({report.seconds:.1f} s)"


def _up(args: argparse.Namespace) -> int:
    from bench.bring_up_sweep import short_sweep
    from tools.bring_up import bring_up

    request = build(UP, args)
    live = None if args.json else StepLine()
    try:
        report = bring_up(request, progress=live, measure=short_sweep)
    finally:
        if live:
            live.end()
    print_result(report, args.json, render)
    return 0 if report.status == "ok" else 1
