"""What is wrong (or notable) about a serving interpreter on this GPU: the diagnosis rules.

The rules are written down below (`RULES`), like tools/host.py's: each a small pure function
over the `Facts` (the probe's report, the driver's view through NVML, how the probe run went)
that returns a `Finding` or None, registered with its stable code and component (the vLLM ones are in
tools/gpu_rules_vllm.py). A reader finds
why a diagnosis fired in one place, and tests replay recorded probe reports through `diagnose`.

The failure modes come from real installs: a `+cpu` torch under a CUDA vLLM, the GPU's
capability missing from torch's arch list, `libcudnn.so.9` missing after
`pip install --no-deps torch`, `import vllm` failing on libcudart, and Turing (sm_7x): no bf16
-> `--dtype float16`, 64 KiB of shared memory per block -> the Turing patch
(patches/turing_smem_clamp.py) for Gemma 4's 512-wide attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from tools.errors import either
from tools.gpu_facts import (
    Component,
    Diagnosis,
    Facts,
    Finding,
    arch_covers,
    version_tuple,
)
from tools.gpu_nvml import NvmlReport
from tools.gpu_probe_run import ProbeDevice, ProbeReport
from tools.gpu_rules_vllm import (
    torchvision_mismatch,
    vllm_cli_cannot_run,
    vllm_cpu_avx512_bf16,
    vllm_cpu_no_avx512,
    vllm_import_failed,
    vllm_import_timeout,
    vllm_libcudart,
    vllm_missing,
    vllm_ok,
)

# Shared memory one block of vLLM's Triton unified attention asks for at Gemma 4's head size 512
# (fp16, BLOCK_M 16, tile 32): (16 + 2*32) * 512 * 2 = 81,920 B; 98,304 B is also seen. A GPU
# whose opt-in limit is below this (a T4: 65,536 B) fails at start-up with Triton's
# OutOfResources unless vLLM carries the Turing clamp (patches/turing_smem_clamp.py).
GEMMA4_ATTENTION_SMEM_BYTES = 81_920
TURING_PATCH_HINT = (
    "apply the Turing patch to the serving interpreter's vLLM ("
    + either(cli="`gpurig patch apply`", mcp="the apply_turing_patch tool")
    + "), and check it with "
    + either(cli="`gpurig patch verify`", mcp="verify_turing_patch")
    + " after every vLLM reinstall"
)

# ---------------------------------------------------------------------------------------------
# The rules: the probe run and the driver (these need no probe report)


def probe_timeout(f: Facts) -> Finding | None:
    """The probe did not finish in time: a hung CUDA init or a hung import."""
    if not f.timed_out:
        return None
    return Finding(
        "fail",
        f"the probe under {f.py} did not finish in time (a hung CUDA init or import)",
        f"run `{f.py} -c 'import torch; print(torch.cuda.is_available())'` by hand "
        "to see where it hangs; check `nvidia-smi` answers",
    )


def probe_crashed(f: Facts) -> Finding | None:
    """The probe started and died without a report (torch segfaulting at import, say)."""
    if not f.crashed:
        return None
    tail = (f.stderr_tail or "").strip().splitlines()
    return Finding(
        "fail",
        f"the probe under {f.py} died ({f.crashed})" + (f": {tail[-1][:300]}" if tail else ""),
        f"run `{f.py} -c 'import torch'` by hand; reinstall torch if it crashes",
    )


def no_gpu(f: Facts) -> Finding | None:
    """No GPU: NVML has no driver (and torch sees no device either), or lists no devices."""
    nvml = f.nvml
    if (not nvml.available or not nvml.gpus) and f.vllm_cpu:
        return Finding(
            "info",
            f"no NVIDIA GPU visible ({nvml.error or 'the driver lists no devices'}); "
            f"{f.vllm_label} serves on the CPU without one",
        )
    if not nvml.available:
        if f.probe and f.probe.torch.devices:
            return None
        return Finding(
            "fail",
            f"no NVIDIA GPU visible ({nvml.error or 'NVML unavailable'})",
            "run on a machine with an NVIDIA GPU and its driver installed "
            "(`nvidia-smi` must list the GPU)",
        )
    if not nvml.gpus:
        return Finding(
            "fail",
            "no NVIDIA GPU visible: the driver is loaded but lists no devices",
            "check `nvidia-smi`; in a container pass the GPU through (--gpus all)",
        )
    return None


# ---------------------------------------------------------------------------------------------
# torch


def torch_missing(f: Facts) -> Finding | None:
    """torch is not installed: install the version vLLM pins, from the driver's CUDA index."""
    if f.torch_state != "missing":
        return None
    assert f.probe is not None
    v = f.v
    return Finding(
        "fail",
        f"torch is not installed for {f.py} (Python {f.probe.python.version})",
        f"{f.py} -m pip install torch{f.pin} --index-url {f.index_url}"
        + (f" (the torch vLLM {v.dist_version} pins)" if f.pin else ""),
    )


def _import_error(f: Facts) -> str:
    return f.t.import_error or "unknown error"


def cudnn_missing(f: Facts) -> Finding | None:
    """`import torch` fails on libcudnn: a CUDA torch installed with --no-deps."""
    if f.torch_state != "import_failed" or "libcudnn" not in _import_error(f):
        return None
    return Finding(
        "fail",
        f"import torch fails: {_import_error(f)} (a CUDA torch installed with --no-deps "
        "lacks the cuDNN and NVIDIA runtime wheels)",
        f"{f.py} -m pip install --force-reinstall torch=={f.t.dist_version} "
        f"--index-url {f.index_url}   (with its dependencies: no --no-deps)",
    )


def torch_import_failed(f: Facts) -> Finding | None:
    """`import torch` fails for any other reason: reinstall the same version."""
    if f.torch_state != "import_failed" or "libcudnn" in _import_error(f):
        return None
    return Finding(
        "fail",
        f"import torch fails under {f.py}: {_import_error(f)}",
        f"{f.py} -m pip install --force-reinstall torch=={f.t.dist_version} "
        f"--index-url {f.index_url}",
    )


def torch_cpu_build(f: Facts) -> Finding | None:
    """A CPU build of torch: fails under vLLM or next to a GPU, else only a warning."""
    if f.torch_state != "cpu_build":
        return None
    t, v = f.t, f.v
    if f.vllm_cpu:
        return Finding(
            "ok",
            f"torch {t.version} is a CPU build, as {f.vllm_label} needs"
            + (f" (it pins torch{v.torch_requirement})" if v.torch_requirement else ""),
        )
    under_vllm = v.dist_version is not None
    return Finding(
        "fail" if (under_vllm or f.nvml.gpus) else "warn",
        f"torch {t.version} is a CPU build (torch.version.cuda is None, arch list "
        f"{t.arch_list or 'empty'})"
        + (f" under a CUDA build of vLLM {v.dist_version}" if under_vllm else ""),
        f"{f.cuda_torch} (the CUDA build from the PyTorch index, with its "
        "dependencies: no --no-deps)",
    )


def cuda_init_failed(f: Facts) -> Finding | None:
    """A CUDA torch whose CUDA initialisation raised."""
    if f.torch_state != "cuda_error":
        return None
    return Finding(
        "fail",
        f"torch could not initialise CUDA: {f.t.cuda_error}",
        "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and the driver version",
    )


def cuda_unavailable(f: Facts) -> Finding | None:
    """A CUDA torch without CUDA: a failure when the driver lists GPUs (a driver too old for
    torch's CUDA, or the devices hidden), a note when there is no GPU to use."""
    if f.torch_state != "no_cuda":
        return None
    t, gpus = f.t, f.nvml.gpus
    if not gpus:
        return Finding(
            "info",
            f"torch {t.version} (CUDA {t.cuda}) is a CUDA build; CUDA is not "
            "available because no GPU is visible",
        )
    driver = f.nvml.cuda_driver_version
    too_old = bool(driver and t.cuda and version_tuple(driver)[:2] < version_tuple(t.cuda)[:2])
    return Finding(
        "fail",
        f"torch {t.version} (CUDA {t.cuda}) cannot use the {len(gpus)} GPU(s) the "
        "driver lists" + (f": the driver supports CUDA {driver} only" if too_old else ""),
        (
            f"{f.py} -m pip install --force-reinstall torch --index-url {f.index_url} "
            "(a build for the driver's CUDA), or update the NVIDIA driver"
            if too_old
            else "check CUDA_VISIBLE_DEVICES is not empty and the user may open /dev/nvidia*"
        ),
    )


# ---------------------------------------------------------------------------------------------
# Each GPU torch sees (rules over one device; run device by device)


def arch_missing(f: Facts, dev: ProbeDevice) -> Finding | None:
    """The GPU's capability is not in torch's arch list (a warning when PTX can JIT to it)."""
    major, minor = dev.capability
    native, ptx = arch_covers(f.t.arch_list, major, minor)
    if native:
        return None
    sm = f"sm_{major}{minor}"
    return Finding(
        "warn" if ptx else "fail",
        f"{dev.name} is {sm} (capability {major}.{minor}) but torch "
        f"{f.t.version} was built for {', '.join(f.t.arch_list) or 'no GPU'}"
        + (" (only PTX JIT covers it: slow first start)" if ptx else ""),
        f"install a torch build that includes {sm}: {f.py} -m pip install "
        f"--force-reinstall torch --index-url "
        + (
            "https://download.pytorch.org/whl/cu126 (CUDA 12.8+ wheels dropped pre-Turing GPUs)"
            if (major, minor) < (7, 5)
            else f.index_url
        ),
    )


def no_native_bf16(f: Facts, dev: ProbeDevice) -> Finding | None:
    """Capability below 8 has no bf16 datapath: serve the bf16 checkpoint as fp16."""
    major, minor = dev.capability
    if major >= 8:
        return None
    return Finding(
        "warn",
        f"{dev.name} (sm_{major}{minor}) has no bf16 datapath: bf16 checkpoints must run as fp16",
        "serve with --dtype float16 (vLLM casts the bf16 weights)",
    )


def turing_shared_memory(f: Facts, dev: ProbeDevice) -> Finding | None:
    """Less opt-in shared memory per block than Gemma 4's attention asks: the Turing patch."""
    optin = dev.shared_memory_per_block_optin
    if optin is None or optin >= GEMMA4_ATTENTION_SMEM_BYTES:
        return None
    return Finding(
        "warn",
        f"{dev.name} allows {optin:,} B of shared memory per block; vLLM's "
        f"Triton attention at Gemma 4's head size 512 asks for "
        f"{GEMMA4_ATTENTION_SMEM_BYTES:,}-98,304 B (OutOfResources at start-up)",
        TURING_PATCH_HINT,
    )


def fp16_matmul_wrong(f: Facts) -> Finding | None:
    """The probe's fp16 matmul on GPU 0 disagrees with the CPU (or raised)."""
    mm = f.t.fp16_matmul
    if mm is None or mm.ok:
        return None
    detail = mm.error or f"max abs error {mm.max_abs_err}"
    return Finding(
        "fail",
        f"an fp16 matmul on GPU 0 disagrees with the CPU: {detail}",
        "check the driver and torch build match; run `nvidia-smi -q` for ECC errors",
    )


def gpu_ok(f: Facts) -> Finding | None:
    """GPU 0 computes: its fp16 matmul matches the CPU."""
    t = f.t
    if not t.devices or t.fp16_matmul is None or not t.fp16_matmul.ok:
        return None
    d0 = t.devices[0]
    return Finding(
        "ok",
        f"{d0.name} sm_{d0.capability[0]}{d0.capability[1]}, "
        f"{d0.total_memory_bytes / 2**30:.1f} GiB: fp16 matmul matches the CPU "
        f"(max abs err {t.fp16_matmul.max_abs_err:.3g})",
    )


# ---------------------------------------------------------------------------------------------
# The list, in report order


@dataclass(frozen=True)
class Rule:
    """One diagnosis: its stable code, the component it is about, and the test that finds it.
    `per_device` rules take (facts, device) and run once per GPU torch sees; `needs_probe`
    rules run only when the probe gave a report."""

    code: str
    component: Component
    check: Callable[..., Finding | None]
    per_device: bool = False
    needs_probe: bool = True


RULES: list[Rule] = [
    Rule("probe_timeout", "probe", probe_timeout, needs_probe=False),
    Rule("probe_crashed", "probe", probe_crashed, needs_probe=False),
    Rule("no_gpu", "driver", no_gpu, needs_probe=False),
    Rule("torch_missing", "torch", torch_missing),
    Rule("cudnn_missing", "torch", cudnn_missing),
    Rule("torch_import_failed", "torch", torch_import_failed),
    Rule("torch_cpu_build", "torch", torch_cpu_build),
    Rule("cuda_init_failed", "torch", cuda_init_failed),
    Rule("cuda_unavailable", "torch", cuda_unavailable),
    Rule("arch_missing", "gpu", arch_missing, per_device=True),
    Rule("no_native_bf16", "gpu", no_native_bf16, per_device=True),
    Rule("turing_shared_memory", "gpu", turing_shared_memory, per_device=True),
    Rule("fp16_matmul_wrong", "gpu", fp16_matmul_wrong),
    Rule("gpu_ok", "gpu", gpu_ok),
    Rule("vllm_missing", "vllm", vllm_missing),
    Rule("torchvision_mismatch", "vllm", torchvision_mismatch),
    Rule("vllm_import_timeout", "vllm", vllm_import_timeout),
    Rule("vllm_libcudart", "vllm", vllm_libcudart),
    Rule("vllm_import_failed", "vllm", vllm_import_failed),
    Rule("vllm_ok", "vllm", vllm_ok),
    Rule("vllm_cli_cannot_run", "vllm", vllm_cli_cannot_run),
    Rule("vllm_cpu_no_avx512", "vllm", vllm_cpu_no_avx512),
    Rule("vllm_cpu_avx512_bf16", "vllm", vllm_cpu_avx512_bf16),
]


def diagnose(
    probe: ProbeReport | None,
    nvml: NvmlReport,
    python_bin: str = "python3",
    *,
    timed_out: bool = False,
    crashed: str | None = None,
    stderr_tail: str | None = None,
) -> list[Diagnosis]:
    """Everything wrong (or notable) about this interpreter on this GPU, each with a remedy.

    Pure: depends only on its arguments, so recorded probe reports replay real failures. Runs
    RULES in order; a run of per-device rules goes device by device (all of GPU 0's, then
    GPU 1's), so one GPU's diagnoses stay together.
    """
    facts = Facts(probe, nvml, python_bin, timed_out, crashed, stderr_tail)
    out: list[Diagnosis] = []

    def add(rule: Rule, found: Finding | None) -> None:
        if found is not None:
            out.append(Diagnosis(code=rule.code, component=rule.component, **found._asdict()))

    for per_device, group in itertools.groupby(RULES, key=lambda r: r.per_device):
        rules = [r for r in group if probe is not None or not r.needs_probe]
        if per_device:
            for dev in probe.torch.devices if probe else []:
                for rule in rules:
                    add(rule, rule.check(facts, dev))
        else:
            for rule in rules:
                add(rule, rule.check(facts))
    return out
