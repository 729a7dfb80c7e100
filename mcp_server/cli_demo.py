"""`gpurig demo`: a tiny checkpoint, two engine servers, a sweep between them, the report.

No arguments needed; it prints the report's path and its main table. Nothing heavy is imported
until the command runs.
"""

from __future__ import annotations

import argparse
import sys

from mcp_server.output import print_result


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the whole product in ~2 minutes: two engine servers, a sweep, a report",
        description="Write two tiny random-weight checkpoints, serve each with the engine on a "
        "free loopback port, sweep them on identical prompts, stop them, print the report.",
    )
    p.add_argument("--work-dir", help="where the checkpoints go (default: GPURIG_HOME/demo)")
    p.add_argument("--out", dest="out_dir", help="the sweep's directory (default: a new one)")
    p.add_argument("--device", help="the engine's device (default: cuda if present, else cpu)")
    p.add_argument(
        "--vllm-python",
        metavar="PY",
        help="an interpreter with vLLM: sweep vLLM against the engine on one checkpoint "
        "(default: GPURIG_PYTHON when it has vLLM, else two engine presets)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from bench.sweep.demo import demo_vllm, run_demo
    from mcp_server.cli_sweep import ProgressBar, render_result

    dist = demo_vllm(args.vllm_python)
    if dist is None:
        sys.stderr.write(
            "gpurig demo: two engine servers, one sweep (about two minutes on a CPU)\n"
            "  to compare with vLLM instead: --vllm-python PY (or GPURIG_PYTHON), the python of "
            "a venv with vLLM; README's 'vLLM's CPU build' makes one\n"
        )
    else:
        sys.stderr.write(
            f"gpurig demo: {dist.label} against the engine on one checkpoint (vLLM takes a "
            "few minutes to start on a CPU)\n"
        )
    result = run_demo(
        work_dir=args.work_dir,
        out_dir=args.out_dir,
        device=args.device,
        progress=None if args.json else ProgressBar(),
        vllm_python=dist.python if dist is not None else None,
    )
    print_result(result, args.json, render_result)
    return 0 if not result.failures else 1
