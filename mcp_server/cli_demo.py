"""`gpurig demo`: the engine beside the peers this machine has (vLLM, llama.cpp), or two engine
builds, swept on identical prompts; the report.

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
        help="the whole product in ~2 minutes: the engine and its peers, a sweep, a report",
        description="Write a tiny random-weight checkpoint, serve it with the engine and with "
        "each peer present (a vLLM interpreter, a llama-server), one after the other on free "
        "loopback ports, sweep them on identical prompts, stop them, print the report. Without "
        "a peer: two engine presets against each other.",
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
    p.add_argument(
        "--llama-server",
        metavar="PATH",
        help="a llama-server binary to add llama.cpp (default: gpurig's build or PATH, if any)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from bench.sweep.demo import demo_llama, demo_vllm, missing_peers, run_demo
    from mcp_server.cli_sweep import ProgressBar, render_result

    dist = demo_vllm(args.vllm_python)
    llama = demo_llama(args.llama_server)
    peers = [p for p in (dist.label if dist else None, "llama.cpp" if llama else None) if p]
    if peers:
        sys.stderr.write(
            f"gpurig demo: the engine and {' and '.join(peers)} on one checkpoint, one after the "
            "other" + (" (vLLM takes a few minutes to start on a CPU)" if dist else "") + "\n"
        )
    else:
        sys.stderr.write(
            "gpurig demo: two engine servers, one sweep (about two minutes on a CPU)\n"
        )
    for hint in missing_peers(dist, llama):
        sys.stderr.write(f"  to add {hint}\n")
    result = run_demo(
        work_dir=args.work_dir,
        out_dir=args.out_dir,
        device=args.device,
        progress=None if args.json else ProgressBar(),
        vllm_python=dist.python if dist is not None else None,
        llama_server=str(llama) if llama is not None else None,
    )
    print_result(result, args.json, render_result)
    return 0 if not result.failures else 1
