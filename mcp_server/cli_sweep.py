"""`gpurig sweep run|status|report`: the CLI faces of bench.sweep (the same functions as MCP).

Targets on the command line: `--target LABEL=URL` for a running server (URL ending in /v1),
`--serve LABEL=BACKEND:MODEL` for one the sweep starts and stops (backend engine or vllm), or
`--targets-file FILE` (a JSON list of target objects, as the MCP tool takes them);
`--model-dir LABEL=DIR` names a running target's checkpoint (tokenizer, roofline). Nothing heavy
is imported until a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mcp_server.output import kv_table, print_result
from tools.errors import InvalidInputError

BAR = 30


def register(subparsers: argparse._SubParsersAction) -> None:
    sweep = subparsers.add_parser(
        "sweep",
        help="benchmark servers side by side on the same prompts (run_sweep)",
        description="Sweeps over input lengths x concurrency x repeats with a report.",
    )
    sub = sweep.add_subparsers(dest="sweep_command", metavar="SWEEP_COMMAND")
    sweep.set_defaults(func=lambda _a: (sweep.print_help(), 2)[1])

    p = sub.add_parser("run", help="run a sweep (a progress bar on stderr)")
    p.add_argument("--target", action="append", default=[], metavar="LABEL=URL")
    p.add_argument("--serve", action="append", default=[], metavar="LABEL=BACKEND:MODEL")
    p.add_argument("--targets-file", metavar="FILE", help="JSON list of target objects")
    p.add_argument("--model-dir", action="append", default=[], metavar="LABEL=DIR")
    p.add_argument("--input-lens", type=int_list, default=[512, 4096], metavar="N,N")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16], metavar="C,C")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts-per-cell", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--driver", choices=["builtin", "vllm-bench"], default="builtin")
    p.add_argument("--out", dest="out_dir", help="output directory (default: a new one)")
    p.add_argument("--resume", metavar="DIR|ID", help="continue a sweep from its files")
    p.add_argument("--detach", action="store_true", help="run in a background worker")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)

    p = sub.add_parser("status", help="where a sweep stands (cells done, ETA)")
    p.add_argument("sweep", metavar="DIR|ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)

    p = sub.add_parser("report", help="rebuild REPORT.md, results.json/csv and plots")
    p.add_argument("sweep", metavar="DIR|ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_report)


def int_list(text: str) -> list[int]:
    """An argparse type: '512,4096' -> [512, 4096], with a usage error for anything else."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one number")
    return values


def _pair(text: str, flag: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        raise InvalidInputError(f"{flag} {text!r} is not LABEL=VALUE", f"e.g. {flag} a=...")
    return label, value


def parse_targets(args: argparse.Namespace) -> list[dict]:
    """The targets from --targets-file, --target and --serve, with --model-dir applied."""
    targets: list[dict] = []
    if args.targets_file:
        try:
            loaded = json.loads(Path(args.targets_file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidInputError(
                f"cannot read {args.targets_file}: {exc}", "give a JSON list of target objects"
            ) from None
        if not isinstance(loaded, list):
            raise InvalidInputError(f"{args.targets_file} is not a JSON list", "wrap it in [...]")
        targets += loaded
    for text in args.target:
        label, url = _pair(text, "--target")
        targets.append({"label": label, "base_url": url})
    for text in args.serve:
        label, spec = _pair(text, "--serve")
        backend, sep, model = spec.partition(":")
        if not sep or backend not in ("engine", "vllm"):
            raise InvalidInputError(
                f"--serve {text!r} is not LABEL=BACKEND:MODEL", "e.g. --serve a=engine:/ckpt"
            )
        targets.append({"label": label, "server": {"backend": backend, "model": model}})
    dirs = dict(_pair(t, "--model-dir") for t in args.model_dir)
    for t in targets:
        if isinstance(t, dict) and t.get("label") in dirs:
            t["model_dir"] = dirs.pop(t["label"])
    if dirs:
        raise InvalidInputError(
            f"--model-dir names no target: {', '.join(dirs)}", "use a label of a target"
        )
    return targets


class ProgressBar:
    """One line on stderr, redrawn in place on a terminal, else a line every few seconds."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.first: tuple[float, int] | None = None  # (time, done) at the first request
        self.last = 0.0

    def __call__(self, done: int, total: int, message: str) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 5 and done < total:
            return
        self.last = now
        share = done / total if total else 1.0
        fill = int(share * BAR)
        eta = ""
        if self.first is None and done > 0:
            self.first = (now, done)  # server start-up and the first request are not a rate
        elif self.first is not None and self.first[1] < done < total:
            t1, d1 = self.first
            left = (now - t1) / (done - d1) * (total - done)
            eta = f" ETA {int(left) // 60}:{int(left) % 60:02d}"
        line = f"[{'#' * fill}{'.' * (BAR - fill)}] {done}/{total} requests{eta}  {message}"
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
            if done >= total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _run(args: argparse.Namespace) -> int:
    from bench.sweep.run import run_sweep

    targets = None if args.resume else parse_targets(args)
    bar = None if args.detach or args.json else ProgressBar()
    result = run_sweep(
        targets=targets,
        input_lens=args.input_lens,
        output_len=args.output_len,
        concurrency=args.concurrency,
        repeats=args.repeats,
        prompts_per_cell=args.prompts_per_cell,
        seed=args.seed,
        driver=args.driver,
        out_dir=args.out_dir,
        resume=args.resume,
        wait=not args.detach,
        progress=bar,
    )
    print_result(result, args.json, render_result)
    return 0


def render_result(r) -> str:  # r: bench.sweep.models.SweepResult
    if r.state == "running":
        return kv_table(
            [
                ("sweep", r.sweep_id),
                ("directory", r.out_dir),
                ("state", "running in the background"),
                ("follow", f"gpurig sweep status {r.out_dir}"),
            ]
        )
    lines = [r.table, ""]
    lines += [f"failed: {f}" for f in r.failures]
    lines += [f"report: {r.report}", f"results: {r.results_json} {r.results_csv}"]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from bench.sweep.run import sweep_status

    print_result(sweep_status(args.sweep), args.json, render_status)
    return 0


def render_status(s) -> str:  # s: bench.sweep.models.SweepStatus
    eta = None if s.eta_s is None else f"{int(s.eta_s) // 60} min {int(s.eta_s) % 60} s"
    return kv_table(
        [
            ("sweep", s.sweep_id),
            ("directory", s.out_dir),
            ("state", f"{s.state}: {s.message}"),
            ("cells", f"{s.cells_done} of {s.cells_total} done ({s.cells_failed} failed)"),
            ("requests", f"{s.requests_done} of {s.requests_total}"),
            ("current", s.current),
            ("time left", eta),
            ("report", s.report),
        ]
    )


def _report(args: argparse.Namespace) -> int:
    from bench.sweep.run import sweep_report

    print_result(sweep_report(args.sweep), args.json, render_result)
    return 0
