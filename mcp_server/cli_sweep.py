"""`gpurig sweep run|status|report`: the CLI faces of bench.sweep (the same functions as MCP).

Targets on the command line: `--target LABEL=URL` for a running server (URL ending in /v1),
`--serve LABEL=BACKEND:MODEL` for one the sweep starts and stops (backend engine, vllm or llamacpp), or
`--targets-file FILE` (a JSON list of target objects, as the MCP tool takes them);
`--model-dir LABEL=DIR` names a running target's checkpoint (tokenizer, roofline). Nothing heavy
is imported until a command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.sweep.models import SearchSpec, SweepRequest, Workload
from bench.sweep.progress import ProgressBar, float_list, int_list
from mcp_server.output import kv_table, print_result
from mcp_server.request_flags import Composed, Door, Flag, Nested, add_flags, build
from tools.errors import InvalidInputError


def register(subparsers: argparse._SubParsersAction) -> None:
    sweep = subparsers.add_parser(
        "sweep",
        help="benchmark servers side by side on the same prompts (run_sweep)",
        description="Sweeps over input lengths x concurrency x repeats with a report.",
    )
    sub = sweep.add_subparsers(dest="sweep_command", metavar="SWEEP_COMMAND")
    sweep.set_defaults(func=lambda _a: (sweep.print_help(), 2)[1])

    p = sub.add_parser("run", help="run a sweep (a progress bar on stderr)")
    p.add_argument("--target", action="append", default=[], metavar="LABEL=URL",
                   help="a running server, e.g. vllm=http://127.0.0.1:8000/v1 (repeatable)")  # fmt: skip
    p.add_argument("--serve", action="append", default=[], metavar="LABEL=BACKEND:MODEL",
                   help="a server the sweep starts and stops: backend engine, vllm or llamacpp "
                   "(a GGUF), e.g. a=engine:/ckpt (repeatable)")  # fmt: skip
    p.add_argument("--targets-file", metavar="FILE", help="JSON list of target objects")
    p.add_argument("--model-dir", action="append", default=[], metavar="LABEL=DIR",
                   help="a target's checkpoint directory (its tokenizer; the roofline)")  # fmt: skip
    add_flags(p, SWEEP)
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

    p = sub.add_parser("compare", help="the same cells of two or more sweeps side by side")
    p.add_argument("sweeps", nargs="+", metavar="DIR|ID")
    p.add_argument("--out", dest="out_dir", help="where COMPARE.md and plots go")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_compare)


def _pair(text: str, flag: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        raise InvalidInputError(f"{flag} {text!r} is not LABEL=VALUE", f"e.g. {flag} a=...")
    return label, value


def parse_targets(args: argparse.Namespace) -> list[dict] | None:
    """The targets from --targets-file, --target and --serve, with --model-dir applied (none
    with --resume: the sweep's own)."""
    if args.resume:
        return None
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
        if not sep or backend not in ("engine", "vllm", "llamacpp"):
            raise InvalidInputError(
                f"--serve {text!r} is not LABEL=BACKEND:MODEL (backend engine, vllm or llamacpp)",
                "e.g. --serve a=engine:/ckpt or --serve b=llamacpp:/ckpt.gguf",
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


def parse_slo(items: list[str]) -> dict[str, float] | None:
    """--slo KEY=MS pairs as the slo dict (the sweep's model checks the keys)."""
    out = {}
    for text in items:
        key, value = _pair(text, "--slo")
        try:
            out[key] = float(value)
        except ValueError:
            raise InvalidInputError(
                f"--slo {text!r}: {value!r} is not a number of ms", "e.g. --slo ttft_p99_ms=500"
            ) from None
    return out or None


# SweepRequest's fields on the command line where the rule (--field-name) does not fit
SWEEP = Door(
    SweepRequest,
    flags={
        "targets": Composed(
            ("--target", "--serve", "--targets-file", "--model-dir"), build=parse_targets
        ),
        "input_lens": Flag(type=int_list, metavar="N,N", help="prompt lengths (default 512,4096)"),
        "concurrency": Flag(
            type=int_list,
            metavar="C,C",
            help="closed-loop levels (default 1,4,8,16 unless --request-rate or --search)",
        ),
        "request_rate": Flag(
            type=float_list, metavar="R,R", help="open-loop levels in requests per second"
        ),
        "burstiness": Flag(help="gamma shape (1: Poisson)"),
        "max_concurrency": Flag(help="cap of the rate cells"),
        "slo": Flag(
            repeat=True,
            parse=parse_slo,
            metavar="METRIC_pP_ms=MS",
            help="e.g. --slo ttft_p99_ms=500 --slo tpot_p99_ms=50",
        ),
        "search": Nested(
            SearchSpec,
            prefix="search_",
            flags={
                "axis": Flag(names=("--search",), help="find the highest load meeting the --slo")
            },
        ),
        "workload": Nested(Workload),
        "out_dir": Flag(names=("--out",), help="output directory (default: a new one)"),
        "resume": Flag(metavar="DIR|ID", help="continue a sweep from its files"),
        "wait": Flag(names=("--detach",), invert=True, help="run in a background worker"),
        "cache_reset": Flag(
            names=("--no-cache-reset",),
            invert=True,
            help="leave the targets' prefix caches alone between cells",
        ),
        "saturation_stop": Flag(
            names=("--no-saturation-stop",),
            invert=True,
            help="run every rate even after one saturates or misses the SLO",
        ),
        "gate": Flag(names=("--no-gate",), invert=True, help="no correctness probes after cells"),
        "reference": Flag(metavar="LABEL", help="the gate's reference target (default: the first)"),
    },
    cli_only={"--json": "prints the result as JSON instead of a table: nothing to send"},
)


def _run(args: argparse.Namespace) -> int:
    from bench.sweep.run import run_sweep

    request = build(SWEEP, args)
    bar = None if not request.wait or args.json else ProgressBar()
    result = run_sweep(**request.arguments(), progress=bar)
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
    lines = []
    for a in r.search:
        best = "none" if a.answer is None else f"{a.answer:g}"
        lines.append(f"search {a.target} in={a.input_len}: {a.axis} {best} ({a.cells} cells)")
    lines += [r.table, ""]
    lines += [f"failed: {f}" for f in r.failures]
    lines += [f"report: {r.report}", f"results: {r.results_json} {r.results_csv}"]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from bench.sweep.lookup import sweep_status

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


def _compare(args: argparse.Namespace) -> int:
    from bench.sweep.compare import compare_sweeps

    result = compare_sweeps(args.sweeps, out_dir=args.out_dir)
    print_result(result, args.json, lambda r: f"{r.table}\n\nreport: {r.report}")
    return 0
