"""`gpurig up MODEL`: bring_up from a shell (doctor, Turing patch, start, spot check, sweep).

Calls the same function as the MCP tool and prints one table of the steps, or JSON with --json.
A live line on stderr follows the steps (rewritten in place on a terminal; elsewhere a line per
step and every 15 s). Exit codes: 0 every step ok, 1 a step failed (the report says which and
what to do), 2 bad input.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import textwrap
import time

from mcp_server.output import grid, print_result
from mcp_server.wording import cli_flag

FOUND_WIDTH = 84


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="bring a model up in one go: doctor, Turing patch, start, spot check, sweep",
        description="From a bare host to a served, checked (and with --sweep measured) model; "
        "stops at the first failure with its cause and the command that fixes it. A running "
        "server of that name and model is reused.",
    )
    p.add_argument("model", help="checkpoint directory or Hugging Face id (org/name)")
    p.add_argument("--backend", choices=["vllm", "engine", "llamacpp"], default="vllm")
    p.add_argument("--name", help="the server's name (default: BACKEND-PORT)")
    p.add_argument("--python", dest="python_bin", help="serving interpreter (GPURIG_PYTHON)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="auto: float16 below capability 8")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, help="context length (engine: --max-ctx)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--device", help="engine only: cuda, cuda:1 or cpu")
    p.add_argument("--cpu-kv-cache-gib", type=int, metavar="N", help="vLLM's CPU build: KV GiB")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--extra-args", action="append", default=[], metavar="'FLAGS'")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for ready")
    p.add_argument(
        "--no-patch",
        dest="apply_patch",
        action="store_false",
        help="below capability 8, stop at a stock vLLM instead of applying the Turing patch",
    )
    p.add_argument("--check", action="append", default=[], metavar="PROMPT=>EXPECT")
    p.add_argument("--no-builtin-checks", action="store_true", help="only the --check ones")
    p.add_argument("--sweep", action="store_true", help="end with concurrency 1 and 4")
    p.add_argument("--sweep-input-len", type=int, default=512, metavar="TOKENS")
    p.add_argument("--sweep-output-len", type=int, default=64, metavar="TOKENS")
    p.add_argument("--sweep-prompts", type=int, default=8, metavar="N", help="per level")
    p.add_argument("--json", action="store_true")
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


def _pairs(args: argparse.Namespace) -> tuple[dict[str, str], list[dict[str, str]]]:
    """--env NAME=VALUE and --check PROMPT=>EXPECT, checked."""
    from tools.errors import InvalidInputError

    env: dict[str, str] = {}
    for pair in args.env:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--env {pair!r} is not NAME=VALUE", "e.g. --env HF_HOME=/hf")
        env[key] = value
    checks = []
    for text in args.check:
        prompt, sep, expect = text.rpartition("=>")
        if not sep or not prompt.strip() or not expect.strip():
            raise InvalidInputError(f"--check {text!r} is not PROMPT=>EXPECT", "e.g. '2+2?=>4'")
        checks.append({"prompt": prompt.strip(), "expect": expect.strip()})
    return env, checks


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
    from pydantic import ValidationError

    from bench.bring_up_sweep import short_sweep
    from tools.bring_up import bring_up
    from tools.bring_up_models import BringUpRequest
    from tools.errors import InvalidInputError

    env, checks = _pairs(args)
    try:
        request = BringUpRequest(
            model=args.model, backend=args.backend, name=args.name, python_bin=args.python_bin,
            host=args.host, port=args.port, dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, device=args.device,
            cpu_kv_cache_gib=args.cpu_kv_cache_gib, env=env,
            extra_args=[a for text in args.extra_args for a in shlex.split(text)],
            timeout_s=args.timeout, apply_patch=args.apply_patch, checks=checks,
            builtin_checks=not args.no_builtin_checks, sweep=args.sweep,
            sweep_input_len=args.sweep_input_len, sweep_output_len=args.sweep_output_len,
            sweep_prompts=args.sweep_prompts,
        )  # fmt: skip
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = cli_flag(str(first["loc"][0])) if first["loc"] else "arguments"
        raise InvalidInputError(f"{flag}: {first['msg']}", remedy="fix that flag") from exc
    live = None if args.json else StepLine()
    try:
        report = bring_up(request, progress=live, measure=short_sweep)
    finally:
        if live:
            live.end()
    print_result(report, args.json, render)
    return 0 if report.status == "ok" else 1
