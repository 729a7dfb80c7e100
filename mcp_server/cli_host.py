"""`gpurig host`, `gpurig gpu`, `gpurig doctor`: the CLI faces of tools/host, gpu and doctor.

Nothing heavy at import time (`gpurig --help` must be instant): the tools are imported inside the
command functions. Each command prints a table (or --json) and exits 1 on a failing verdict.
"""

from __future__ import annotations

import argparse
import textwrap

from mcp_server.output import grid, kv_table, print_result

GIB = 2**30
_MARK = {"ok": "ok", "info": "info", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "host",
        help="disks, memory, CPUs and GPU count, with advice (check_host_capacity)",
        description="Measure each path on the filesystem that really holds it, RAM and swap, "
        "and advise with exact commands.",
    )
    p.add_argument(
        "--path",
        dest="paths",
        action="append",
        metavar="PATH",
        help="a path to measure (repeatable); default: /, /tmp, ~/.cache, the HF cache",
    )
    p.add_argument("--need-gib", type=float, help="GiB of weights to download and stage")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_host)

    p = subparsers.add_parser(
        "gpu",
        help="can the serving Python run on this GPU? (verify_gpu_arch)",
        description="Probe the serving interpreter's torch/vLLM and the NVIDIA driver, and "
        "diagnose what stops them from serving.",
    )
    p.add_argument("--python", dest="python_bin", help="serving interpreter (GPURIG_PYTHON)")
    p.add_argument("--timeout", type=float, default=120.0, help="probe limit in seconds")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_gpu)

    p = subparsers.add_parser(
        "doctor",
        help="the readiness report for this host: every read-only check",
        description="Every read-only check in one report: host memory and disks, driver, GPU, "
        "torch, vLLM, ... Exit status 1 when a check fails.",
    )
    p.add_argument("--python", dest="python_bin", help="serving interpreter (GPURIG_PYTHON)")
    p.add_argument("--need-gib", type=float, help="GiB of weights to download and stage")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_doctor)


def _exit(verdict: str) -> int:
    return 1 if verdict == "fail" else 0


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f}"


# --- host ------------------------------------------------------------------------------------


def _run_host(args: argparse.Namespace) -> int:
    from tools.host import check_host_capacity

    result = check_host_capacity(paths=args.paths, need_gib=args.need_gib)
    print_result(result, args.json, render_host)
    return _exit(result.verdict)


def render_host(r) -> str:  # r: tools.host.HostCapacity
    fs = grid(
        [
            [
                f.mount_point,
                f.device,
                f.fstype,
                f"{f.free_gib:.1f}",
                f"{f.total_gib:.1f}",
                "\n".join(f.paths),
            ]
            for f in r.filesystems
        ],
        ["mount", "device", "fstype", "free GiB", "total GiB", "paths"],
    )
    notes = [
        [p.path, p.real_path, p.note or ("symlink" if p.is_symlink else "")]
        for p in r.paths
        if p.is_symlink or p.note
    ]
    m = r.memory
    load = " ".join(f"{x:.2f}" for x in r.cpu.load_avg) if r.cpu.load_avg else "?"
    gpus = (
        "? (NVML unavailable: no driver, or not answering)"
        if r.nvidia_gpu_count is None
        else str(r.nvidia_gpu_count)
    )
    facts = kv_table(
        [
            (
                "RAM",
                f"{_gib(m.ram_total_bytes)} GiB total, {_gib(m.ram_available_bytes)} available",
            ),
            ("swap", f"{_gib(m.swap_total_bytes)} GiB total, {_gib(m.swap_used_bytes)} used"),
            ("staging needs", f"{r.staging_need_gib:.1f} GiB of RAM + swap"),
            ("CPUs", f"{r.cpu.count} (usable {r.cpu.usable}), load {load}"),
            ("NVIDIA GPUs", gpus),
        ]
    )
    parts = [fs]
    if notes:
        parts.append(grid(notes, ["path", "real path", "note"]))
    parts.append(facts)
    parts.append("advice:\n" + _advice_lines(r.advice))
    parts.append(f"verdict: {r.verdict}  ({r.seconds:.2f} s)")
    return "\n\n".join(parts)


def _advice_lines(advice) -> str:
    lines = []
    for a in advice:
        lines.append(
            textwrap.fill(
                f"[{_MARK[a.status]}] {a.rule}: {a.reason}", width=100, subsequent_indent="    "
            )
        )
        lines.extend(f"    $ {c}" for c in a.commands)
    return "\n".join(lines)


# --- gpu -------------------------------------------------------------------------------------


def _run_gpu(args: argparse.Namespace) -> int:
    from tools.gpu import verify_gpu_arch

    result = verify_gpu_arch(python_bin=args.python_bin, timeout_s=args.timeout)
    print_result(result, args.json, render_gpu)
    return _exit(result.verdict)


def render_gpu(r) -> str:  # r: tools.gpu.GpuArchReport
    rows: list[tuple[str, object]] = [("python", r.python_bin)]
    p = r.probe
    if p:
        t, v = p.torch, p.vllm
        rows += [
            ("python version", p.python.version),
            (
                "torch",
                t.version or (f"{t.dist_version} (import fails)" if t.dist_version else "missing"),
            ),
            ("torch.version.cuda", t.cuda),
            ("CUDA available", t.cuda_available),
            ("arch list", " ".join(t.arch_list) or "(empty)"),
        ]
        for d in t.devices:
            rows += [
                (
                    f"GPU {d.index}",
                    f"{d.name}, capability {d.capability[0]}.{d.capability[1]}, "
                    f"{_gib(d.total_memory_bytes)} GiB, {d.multi_processor_count} SMs",
                ),
                (f"GPU {d.index} smem/block", d.shared_memory_per_block_optin),
                (f"GPU {d.index} bf16", d.bf16_supported),
            ]
        if t.fp16_matmul:
            rows.append(("fp16 matmul ok", t.fp16_matmul.ok))
        rows += [
            ("triton", p.triton_version or "missing"),
            ("vllm", v.dist_version or "missing"),
        ]
        if v.import_attempted:
            rows.append(("import vllm", "ok" if v.import_ok else (v.import_error or "fails")))
    n = r.nvml
    if n.available:
        rows += [("driver", f"{n.driver_version} (CUDA {n.cuda_driver_version})")]
        for g in n.gpus:
            rows.append(
                (
                    f"NVML GPU {g.index}",
                    f"{g.name}, {g.power_limit_w} W limit (default {g.power_default_limit_w}), "
                    f"SM {g.sm_clock_mhz}/{g.sm_clock_max_mhz} MHz, "
                    f"throttle: {', '.join(g.throttle_reasons) or 'none'}",
                )
            )
    else:
        rows.append(("NVML", n.error))
    if r.serve_flags:
        rows.append(("vLLM flags", " ".join(r.serve_flags)))
    lines = []
    for d in r.diagnoses:
        lines.append(
            textwrap.fill(
                f"[{_MARK[d.severity]}] {d.code}: {d.message}", width=100, subsequent_indent="    "
            )
        )
        if d.remedy:
            lines.append(
                textwrap.fill(
                    f"-> {d.remedy}", width=100, initial_indent="    ", subsequent_indent="       "
                )
            )
    return "\n\n".join(
        [kv_table(rows), "diagnoses:\n" + "\n".join(lines), f"verdict: {r.verdict}: {r.summary}"]
    )


# --- doctor ----------------------------------------------------------------------------------


def _run_doctor(args: argparse.Namespace) -> int:
    from tools.doctor import doctor

    result = doctor(python_bin=args.python_bin, need_gib=args.need_gib)
    print_result(result, args.json, render_doctor)
    return _exit(result.status)


def render_doctor(r) -> str:  # r: tools.doctor.DoctorReport
    table = grid(
        [[_MARK[c.status], c.name, textwrap.fill(c.detail, 78)] for c in r.checks],
        ["status", "check", "detail"],
    )
    todo = [c for c in r.checks if c.remedy and c.status in ("warn", "fail")]
    parts = [table]
    if todo:
        parts.append(
            "what to do:\n"
            + "\n".join(
                textwrap.fill(f"- {c.name}: {c.remedy}", 100, subsequent_indent="    ")
                for c in todo
            )
        )
    parts.append(f"readiness: {r.status}  ({r.seconds:.1f} s)")
    return "\n\n".join(parts)
