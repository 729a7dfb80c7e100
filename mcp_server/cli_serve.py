"""`gpurig serve start|stop|status|logs|query|spot-check`: the serving tools from a shell.

Each command calls the same function as the MCP tool and prints a table, or JSON with --json.
`serve start` shows a live line while it waits (seconds, last log line) on a terminal. Flags
for vLLM that gpurig does not name go in --extra-args: `gpurig serve start M --extra-args='--seed 0'`.
Exit codes: 0 done, 1 the server failed / a check failed, 2 refused or bad input.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time

from mcp_server.output import grid, kv_table, print_result
from mcp_server.request_flags import Door, Flag, add_flags, build
from tools.errors import InvalidInputError
from tools.serving.models import StartRequest

GIB = 2**30


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """--env NAME=VALUE texts as the env dict."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--env {pair!r} is not NAME=VALUE", "e.g. --env HF_HOME=/hf")
        out[key] = value
    return out


def shell_words(texts: list[str]) -> list[str]:
    """--extra-args texts, each split like a shell: --extra-args='--seed 0' -> two words."""
    return [word for text in texts for word in shlex.split(text)]


def check_pairs(texts: list[str]) -> list[dict[str, str]]:
    """--check PROMPT=>EXPECT texts as {prompt, expect} checks."""
    checks = []
    for text in texts:
        prompt, sep, expect = text.rpartition("=>")
        if not sep or not prompt.strip() or not expect.strip():
            raise InvalidInputError(
                f"--check {text!r} is not PROMPT=>EXPECT", 'e.g. --check "What is 2+2?=>4"'
            )
        checks.append({"prompt": prompt.strip(), "expect": expect.strip()})
    return checks


# How ServerArgs' fields (tools/serving/models.py) show on the command line where the rule
# (--field-name, type, default and help from the field) does not fit: `gpurig up` shares it.
SERVER_FLAGS: dict[str, Flag] = {
    "model": Flag(names=("model",), help="checkpoint directory or Hugging Face id (org/name)"),
    "python_bin": Flag(names=("--python",), help="serving interpreter (GPURIG_PYTHON)"),
    "tensor_parallel_size": Flag(names=("-tp", "--tensor-parallel-size")),
    "max_model_len": Flag(help="context length (engine: --max-ctx)"),
    "cpu_kv_cache_gib": Flag(metavar="N"),
    "env": Flag(repeat=True, parse=env_pairs, metavar="NAME=VALUE", help="set for the server"),
    "extra_args": Flag(
        repeat=True,
        parse=shell_words,
        metavar="'FLAGS'",
        help="flags passed to the server as-is, split like a shell: --extra-args='--seed 0' "
        "(checked against the installed vLLM's own flags)",
    ),
    "timeout_s": Flag(names=("--timeout",), help="seconds to wait for ready (default 900)"),
}
PRESENTATION = {"--json": "prints the result as JSON instead of a table: nothing to send"}

START = Door(
    StartRequest,
    flags={
        **SERVER_FLAGS,
        "pipeline_parallel_size": Flag(names=("-pp", "--pipeline-parallel-size")),
        "wait": Flag(names=("--no-wait",), invert=True, help="return once the process started"),
    },
    cli_only=PRESENTATION,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="start, stop and check LLM servers (vLLM or the engine), detached",
        description="Servers run detached with a record under the state directory, so status "
        "and stop work from any later shell or MCP session.",
    )
    sub = serve.add_subparsers(dest="serve_command", metavar="ACTION")
    serve.set_defaults(func=lambda _a: (serve.print_help(), 2)[1])

    p = sub.add_parser("start", help="start a server and wait until it serves")
    add_flags(p, START)
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.set_defaults(func=_start)

    p = sub.add_parser("stop", help="stop a server (SIGTERM, SIGKILL after --timeout)")
    p.add_argument("name", nargs="?", help="default: the only one running")
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_stop)

    p = sub.add_parser("status", help="every recorded server: state, health, uptime, facts")
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)

    p = sub.add_parser("logs", help="the tail of a server's log")
    p.add_argument("name", nargs="?")
    p.add_argument("--tail", type=int, default=200)
    p.add_argument("--grep", help="only lines containing this (case-insensitive)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_logs)

    p = sub.add_parser("query", help="one chat completion (streamed: TTFT, tok/s)")
    p.add_argument("prompt")
    p.add_argument("--name")
    p.add_argument("--base-url", help="any OpenAI-compatible server instead of a named one")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--system")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_query)

    p = sub.add_parser("spot-check", help="the three built-in checks (391, Canberra, Au) and yours")
    p.add_argument("--name")
    p.add_argument("--base-url")
    p.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="PROMPT=>EXPECT",
        help='another check, e.g. "What is 2+2?=>4" (repeatable)',
    )
    p.add_argument("--no-builtin-checks", action="store_true", help="run only the --check ones")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_spot_check)


# --- start -----------------------------------------------------------------------------------


class LiveLine:
    """One line on a terminal's stderr, rewritten in place: elapsed and the last log line."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, elapsed: float, total: float | None, message: str) -> None:
        if not self.tty:
            if message == "ready" or time.monotonic() - self.last >= 15:
                self.last = time.monotonic()
                sys.stderr.write(f"gpurig: {elapsed:.0f} s: {message[:160]}\n")
            return
        width = shutil.get_terminal_size((100, 20)).columns
        of = f"/{total:.0f}" if total else ""
        text = f"[{elapsed:6.1f}{of} s] {message}"
        sys.stderr.write("\r" + text[: width - 1].ljust(width - 1))
        if message == "ready":
            sys.stderr.write("\n")
        sys.stderr.flush()


def _start(args: argparse.Namespace) -> int:
    from tools.serving import start_vllm_server

    request = build(START, args)
    live = LiveLine() if not args.json and request.wait else None
    record = start_vllm_server(**request.model_dump(), progress=live)
    if live and live.tty and record.state != "ready":
        sys.stderr.write("\n")
    print_result(record, args.json, render_record)
    return 1 if record.state == "dead" else 0


def _facts_rows(facts) -> list[tuple[str, object]]:
    rows = []
    for key, value in facts.model_dump().items():
        if value is not None:
            rows.append((key.replace("_", " "), value))
    return rows


def render_record(r) -> str:
    rows: list[tuple[str, object]] = [
        ("name", r.name),
        ("state", r.state),
        (
            "backend",
            r.backend
            + (f" ({r.vllm_label or 'vLLM ' + r.vllm_version})" if r.vllm_version else ""),
        ),
        ("cpu kv cache", f"{r.cpu_kv_cache_gib} GiB" if r.cpu_kv_cache_gib else None),
        ("model", r.model),
        ("served as", r.served_model_name),
        ("base url", r.base_url),
        ("pid", r.pid if not r.server_pid else f"{r.pid} (server {r.server_pid})"),
        ("ready in", f"{r.ready_seconds} s" if r.ready_seconds is not None else None),
        ("log", r.log_path),
        ("command", " ".join(r.command)),
    ]
    for attr in ("uptime_s", "health", "health_detail", "ended"):
        if getattr(r, attr, None) is not None:
            rows.append((attr.replace("_", " "), getattr(r, attr)))
    rows += _facts_rows(r.startup_facts)
    out = kv_table(rows)
    if r.failure:
        f = r.failure
        out += f"\n\nFAILED: {f.title} [{f.cause}]"
        if f.exit:
            out += f" ({f.exit})"
        if f.evidence:
            out += f"\n  seen: {f.evidence}"
        out += f"\n  what to do: {f.remedy}\n  log tail:\n"
        out += "\n".join("    " + ln for ln in f.log_tail[-15:])
    return out


# --- stop, status, logs ----------------------------------------------------------------------


def _stop(args: argparse.Namespace) -> int:
    from tools.serving import stop_vllm_server

    result = stop_vllm_server(args.name, timeout_s=args.timeout)

    def render(r) -> str:
        rows = [("name", r.name), ("was", r.was), ("now", r.state), ("detail", r.detail),
                ("seconds", r.seconds), ("port free", r.port_free)]  # fmt: skip
        for before, after in zip(r.gpu_memory_before, r.gpu_memory_after, strict=False):
            rows.append((f"gpu {before.index} used GiB", f"{_gib(before.used_bytes)} -> "
                         f"{_gib(after.used_bytes)}"))  # fmt: skip
        return kv_table(rows)

    print_result(result, args.json, render)
    return 0


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f}"


def _status(args: argparse.Namespace) -> int:
    from tools.serving import server_status

    report = server_status(args.name)

    def render(r) -> str:
        if not r.servers:
            return f"no servers recorded (in {r.state_dir}); start one: gpurig serve start MODEL"
        if args.name:
            return render_record(r.servers[0])
        rows = [
            [s.name, s.backend, s.state, s.health, s.port, s.model,
             "" if s.uptime_s is None else f"{s.uptime_s:.0f} s",
             s.failure.cause if s.failure else (s.ended or "")]
            for s in r.servers
        ]  # fmt: skip
        headers = ["name", "backend", "state", "health", "port", "model", "uptime", "ended/why"]
        return grid(rows, headers)

    print_result(report, args.json, render)
    return 0


def _logs(args: argparse.Namespace) -> int:
    from tools.serving import get_server_logs

    result = get_server_logs(args.name, tail=args.tail, grep=args.grep)
    print_result(result, args.json, lambda r: "\n".join(r.lines))
    return 0


# --- query, spot-check -----------------------------------------------------------------------


def _query(args: argparse.Namespace) -> int:
    from tools.serving import query_model

    result = query_model(
        args.prompt, name=args.name, base_url=args.base_url, max_tokens=args.max_tokens,
        temperature=args.temperature, system=args.system,
    )  # fmt: skip

    def render(r) -> str:
        stats = kv_table([
            ("model", r.model), ("finish", r.finish_reason),
            ("tokens", f"{r.prompt_tokens} in, {r.completion_tokens} out"),
            ("ttft", f"{r.ttft_s} s"), ("total", f"{r.total_s} s"), ("tok/s", r.tokens_per_s),
        ])  # fmt: skip
        return f"{r.text}\n\n{stats}"

    print_result(result, args.json, render)
    return 0


def _spot_check(args: argparse.Namespace) -> int:
    from tools.serving import spot_check

    checks = check_pairs(args.check)
    result = spot_check(
        name=args.name, base_url=args.base_url, checks=checks,
        builtin_checks=not args.no_builtin_checks,
    )  # fmt: skip

    def render(r) -> str:
        rows = [["PASS" if c.passed else "FAIL", c.prompt[:50], c.expect, " ".join(c.answer.split())[:60],
                 f"{c.seconds:.2f}"] for c in r.checks]  # fmt: skip
        table = grid(rows, ["", "prompt", "expect", "answer", "s"])
        return f"{table}\n{r.passed}/{len(r.checks)} passed ({r.model} at {r.base_url})"

    print_result(result, args.json, render)
    return 0 if result.ok else 1
