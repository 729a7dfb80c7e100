"""verify_gpu_arch: the probe under real interpreters, and the diagnoses on recorded reports.

CI has no GPU. The probe runs for real under this interpreter (a CUDA torch, no GPU: it must
say so), under a fresh venv without torch, and under venvs holding small stand-in packages that
replay the recorded import failures (libcudart, libcudnn). The GPU cases (a T4 and its Turing
limits) are replayed as probe JSON through the pure `diagnose` function.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools import gpu
from tools.errors import InvalidInputError
from tools.gpu import (
    NvmlGpu,
    NvmlReport,
    ProbeReport,
    ProbeRun,
    build_report,
    diagnose,
    throttle_names,
    verify_gpu_arch,
)


def codes(diagnoses) -> dict[str, str]:
    return {d.code: d.severity for d in diagnoses}


# --- the probe, for real ---------------------------------------------------------------------


def test_probe_json_matches_the_models(bare_venv: Path) -> None:
    """Every key the stdlib-only probe writes is a field of the pydantic models, and back
    (run under a bare venv: the probe writes every key whatever is installed)."""
    out = subprocess.run(
        [str(bare_venv), str(gpu.PROBE_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(gpu.RESULT_MARKER)]
    assert len(lines) == 1, out.stdout
    raw = json.loads(lines[0][len(gpu.RESULT_MARKER) :])
    report = ProbeReport.model_validate(raw)
    assert set(raw) == set(ProbeReport.model_fields)
    assert set(raw["torch"]) == set(type(report.torch).model_fields)
    assert set(raw["vllm"]) == set(type(report.vllm).model_fields)
    assert set(raw["python"]) == set(type(report.python).model_fields)
    assert report.python.executable == str(bare_venv)  # the interpreter that really ran it
    assert report.python.version == ".".join(map(str, sys.version_info[:3]))


def test_current_interpreter_says_no_gpu() -> None:
    """Here: a CUDA build of torch, no driver, no GPU. A verdict, never a crash."""
    started = time.monotonic()
    report = verify_gpu_arch()
    assert time.monotonic() - started < 30
    torch = report.probe.torch
    assert torch.imported
    assert torch.version.startswith(importlib.metadata.version("torch").split("+")[0])
    assert torch.cuda_available is False
    assert torch.devices == []
    assert report.probe.triton_version == importlib.metadata.version("triton")
    assert report.nvml.available is False
    assert report.verdict == "fail"
    assert "no NVIDIA GPU visible" in report.summary
    found = codes(report.diagnoses)
    assert found["no_gpu"] == "fail"
    if torch.cuda:  # this machine's torch is a CUDA build: it must not be called a CPU build
        assert "torch_cpu_build" not in found
        assert "cuda_unavailable" in found


def test_venv_without_torch_says_torch_is_missing(bare_venv: Path) -> None:
    report = verify_gpu_arch(python_bin=str(bare_venv))
    assert Path(report.probe.python.executable).parent == bare_venv.parent
    assert report.probe.torch.dist_version is None
    assert report.probe.torch.imported is False
    assert report.probe.triton_version is None
    assert report.verdict == "fail"
    missing = next(d for d in report.diagnoses if d.code == "torch_missing")
    assert missing.severity == "fail"
    assert f"{bare_venv} -m pip install torch" in missing.remedy


def venv_site_packages(python: Path) -> Path:
    """The site-packages folder of a venv."""
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return Path(out.stdout.strip())


def _fake_dist(site: Path, name: str, version: str, init: str, requires: tuple = ()) -> None:
    """A minimal installed distribution: a package plus its dist-info METADATA."""
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(textwrap.dedent(init))
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_cpu_torch_under_cuda_vllm_replayed(bare_venv: Path) -> None:
    """The seed's install as found: torch 2.11.0+cpu under vLLM 0.26.0; import vllm fails on
    libcudart.so.13. Stand-in packages replay those recorded values through the real probe
    (including its `import vllm` subprocess)."""
    site = venv_site_packages(bare_venv)
    _fake_dist(
        site,
        "torch",
        "2.11.0+cpu",
        """
        __version__ = "2.11.0+cpu"
        class version:
            cuda = None
        class cuda:
            @staticmethod
            def get_arch_list():
                return []
            @staticmethod
            def is_available():
                return False
        """,
    )
    _fake_dist(
        site,
        "vllm",
        "0.26.0",
        """
        raise ImportError(
            "libcudart.so.13: cannot open shared object file: No such file or directory")
        """,
        requires=("torchvision==0.26.0", "torch==2.11.0", "pytest; extra == 'test'"),
    )
    report = verify_gpu_arch(python_bin=str(bare_venv))
    v = report.probe.vllm
    assert v.torch_requirement == "==2.11.0"
    assert v.dist_version == "0.26.0"
    assert v.import_attempted and v.import_ok is False
    assert "libcudart.so.13" in v.import_error
    found = codes(report.diagnoses)
    assert found["torch_cpu_build"] == "fail"
    assert found["vllm_libcudart"] == "fail"
    libcudart = next(d for d in report.diagnoses if d.code == "vllm_libcudart")
    assert "CPU build" in libcudart.message
    assert "-m pip install --force-reinstall torch==2.11.0 --index-url" in libcudart.remedy


def test_torch_without_cudnn_replayed(bare_venv: Path) -> None:
    """A CUDA torch installed with --no-deps: import torch fails on libcudnn.so.9."""
    site = venv_site_packages(bare_venv)
    _fake_dist(
        site,
        "torch",
        "2.11.0+cu130",
        """
        raise ImportError(
            "libcudnn.so.9: cannot open shared object file: No such file or directory")
        """,
    )
    report = verify_gpu_arch(python_bin=str(bare_venv))
    assert report.probe.torch.imported is False
    assert "libcudnn.so.9" in report.probe.torch.import_error
    cudnn = next(d for d in report.diagnoses if d.code == "cudnn_missing")
    assert cudnn.severity == "fail"
    assert "--no-deps" in cudnn.message
    assert "torch==2.11.0+cu130" in cudnn.remedy
    assert "--no-deps" not in cudnn.remedy.split("(")[0]  # the fix installs WITH dependencies


def test_vllm_checkout_in_the_cwd_is_not_what_gets_imported(
    bare_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpurig gpu` run inside a vLLM source checkout tests the installed vLLM."""
    _fake_dist(venv_site_packages(bare_venv), "vllm", "0.33.0", "")
    checkout = tmp_path / "vllm-src"
    (checkout / "vllm").mkdir(parents=True)
    (checkout / "vllm" / "__init__.py").write_text("raise ImportError('the checkout')\n")
    monkeypatch.chdir(checkout)
    run = gpu.run_probe(str(bare_venv), timeout_s=60)
    assert run.report.vllm.import_ok is True, run.report.vllm.import_error


def test_hanging_vllm_import_is_bounded(bare_venv: Path) -> None:
    site = venv_site_packages(bare_venv)
    _fake_dist(site, "vllm", "0.33.0", "import time\ntime.sleep(60)\n")
    run = gpu.run_probe(str(bare_venv), timeout_s=30, vllm_import_timeout_s=0.5)
    assert run.seconds < 15
    assert run.report.vllm.import_timed_out is True
    found = codes(build_report(str(bare_venv), run, NvmlReport(available=False)).diagnoses)
    assert found["vllm_import_timeout"] == "warn"


def test_probe_never_imports_from_a_working_directory(
    bare_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch.py / vllm.py in the directory gpurig (or the probe) runs from is never imported:
    not by the probe, not by its `import vllm` child. The user site stays on (PYTHONUSERBASE)."""
    site = venv_site_packages(bare_venv)
    _fake_dist(site, "vllm", "0.33.0", "")
    evil = tmp_path / "cwd"
    evil.mkdir()
    marker = tmp_path / "imported"
    for mod in ("torch", "vllm"):
        (evil / f"{mod}.py").write_text(f"open({str(marker)!r}, 'a').write('{mod} ')\n")
    monkeypatch.chdir(evil)
    run = gpu.run_probe(str(bare_venv), timeout_s=60)
    assert run.report is not None and run.report.vllm.import_ok is True
    # the probe run by hand from that directory, as someone debugging it would
    subprocess.run(
        [str(bare_venv), str(gpu.PROBE_SCRIPT)], cwd=evil, capture_output=True, timeout=60
    )
    assert not marker.exists(), marker.read_text()


def test_timeout_must_be_positive() -> None:
    with pytest.raises(InvalidInputError):
        verify_gpu_arch(timeout_s=0)


# --- diagnoses on recorded reports (pure) ----------------------------------------------------

SEED_T4_NVML = NvmlReport(
    available=True,
    driver_version="615.71.09",
    cuda_driver_version="13.0",
    gpus=[
        NvmlGpu(
            index=0,
            name="Tesla T4",
            capability=(7, 5),
            memory_total_bytes=15360 * 2**20,
            power_limit_w=70.0,
            power_default_limit_w=70.0,
            sm_clock_mhz=1290,
            sm_clock_max_mhz=1590,
            throttle_reasons=["sw_power_cap"],
        )
    ],
)
NO_DRIVER = NvmlReport(available=False, error="no NVIDIA driver: libnvidia-ml.so (NVML) not found")
T4 = {
    "index": 0,
    "name": "Tesla T4",
    "capability": [7, 5],
    "total_memory_bytes": 15_655_829_504,
    "shared_memory_per_block_optin": 65536,
    "multi_processor_count": 40,
    "bf16_supported": False,
}
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def probe(torch: dict | None = None, vllm: dict | None = None) -> ProbeReport:
    """A probe report as the seed's T4 host (vLLM 0.29.0, torch 2.13.0+cu130) produced it."""
    t = {
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
    v = {
        "dist_version": "0.29.0",
        "import_attempted": True,
        "import_ok": True,
        "import_seconds": 9.1,
    }
    return ProbeReport.model_validate(
        {
            "probe_version": 1,
            "python": {"version": "3.13.5", "executable": "/usr/bin/python3.13"},
            "torch": {**t, **(torch or {})},
            "triton_version": "3.7.1",
            "vllm": {**v, **(vllm or {})},
        }
    )


def test_seed_t4_needs_fp16_and_the_turing_patch() -> None:
    report = build_report(
        "/usr/bin/python3.13", ProbeRun(report=probe(), seconds=12.0), SEED_T4_NVML
    )
    found = codes(report.diagnoses)
    assert found["no_native_bf16"] == "warn"
    assert found["turing_shared_memory"] == "warn"
    assert found["gpu_ok"] == "ok" and found["vllm_ok"] == "ok"
    assert not [c for c, s in found.items() if s == "fail"]
    assert report.verdict == "warn"
    assert report.serve_flags[:2] == ["--dtype", "float16"]
    smem = next(d for d in report.diagnoses if d.code == "turing_shared_memory")
    assert "65,536" in smem.message
    assert "apply_turing_patch" in smem.remedy
    bf16 = next(d for d in report.diagnoses if d.code == "no_native_bf16")
    assert "--dtype float16" in bf16.remedy
    assert report.summary.startswith("Tesla T4 sm_75 ready")


def test_ampere_needs_nothing() -> None:
    a10 = {
        **T4,
        "name": "NVIDIA A10G",
        "capability": [8, 6],
        "bf16_supported": True,
        "shared_memory_per_block_optin": 101376,
    }
    report = build_report("py", ProbeRun(report=probe({"devices": [a10]}), seconds=1), SEED_T4_NVML)
    assert report.verdict == "ok"
    assert report.serve_flags == []


def test_cpu_torch_under_cuda_vllm() -> None:
    p = probe(
        {
            "dist_version": "2.11.0+cpu",
            "version": "2.11.0+cpu",
            "cuda": None,
            "cuda_available": False,
            "device_count": 0,
            "arch_list": [],
            "devices": [],
            "fp16_matmul": None,
        },
        {
            "dist_version": "0.26.0",
            "torch_requirement": "==2.11.0",
            "import_ok": False,
            "import_error": "ImportError: libcudart.so.13: cannot open shared object file: "
            "No such file or directory",
        },
    )
    found = diagnose(p, SEED_T4_NVML, "/usr/bin/python3.13")
    cpu = next(d for d in found if d.code == "torch_cpu_build")
    assert cpu.severity == "fail"
    assert "vLLM 0.26.0" in cpu.message
    assert "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130" in cpu.remedy
    assert codes(found)["vllm_libcudart"] == "fail"
    report = build_report("/usr/bin/python3.13", ProbeRun(report=p, seconds=3), SEED_T4_NVML)
    assert report.summary == "a CPU build of torch; import vllm fails on libcudart"


def test_libcudart_with_a_cuda_torch_points_at_the_cuda_mismatch() -> None:
    p = probe(
        {"version": "2.13.0+cu126", "cuda": "12.6"},
        {"import_ok": False, "import_error": "OSError: libcudart.so.13: cannot open shared object"},
    )
    found = diagnose(p, SEED_T4_NVML)
    d = next(d for d in found if d.code == "vllm_libcudart")
    assert "does not match" in d.message and "torch_cpu_build" not in codes(found)


def test_torch_missing_under_vllm_installs_the_pinned_torch() -> None:
    missing_torch = {"dist_version": None, "imported": False, "version": None, "cuda": None,
                     "cuda_available": False, "device_count": 0, "arch_list": [], "devices": [],
                     "fp16_matmul": None}  # fmt: skip
    report = probe(torch=missing_torch, vllm={"torch_requirement": "==2.13.0"})
    found = {d.code: d for d in diagnose(report, SEED_T4_NVML, "/usr/bin/python3.13")}
    assert found["torch_missing"].remedy.startswith(
        "/usr/bin/python3.13 -m pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu130"
    )


def test_capability_missing_from_arch_list() -> None:
    p = probe({"arch_list": ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]})
    d = next(d for d in diagnose(p, SEED_T4_NVML) if d.code == "arch_missing")
    assert d.severity == "fail"
    assert "sm_75" in d.message and "sm_75" in d.remedy
    ptx = probe({"arch_list": ["sm_80", "compute_70"]})
    assert codes(diagnose(ptx, SEED_T4_NVML))["arch_missing"] == "warn"


def test_cudnn_missing() -> None:
    p = probe(
        {
            "imported": False,
            "version": None,
            "cuda": None,
            "cuda_available": False,
            "devices": [],
            "arch_list": [],
            "fp16_matmul": None,
            "dist_version": "2.11.0+cu130",
            "import_error": "ImportError: libcudnn.so.9: cannot open shared object file: "
            "No such file or directory",
        },
    )
    found = codes(diagnose(p, SEED_T4_NVML))
    assert found["cudnn_missing"] == "fail"
    assert "torch_import_failed" not in found


def test_driver_too_old_for_torch() -> None:
    old = SEED_T4_NVML.model_copy(update={"cuda_driver_version": "12.4"})
    p = probe({"cuda_available": False, "device_count": 0, "devices": [], "fp16_matmul": None})
    d = next(d for d in diagnose(p, old) if d.code == "cuda_unavailable")
    assert d.severity == "fail"
    assert "CUDA 12.4" in d.message
    assert "whl/cu126" in d.remedy


def test_wrong_fp16_matmul_fails() -> None:
    p = probe({"fp16_matmul": {"ok": False, "max_abs_err": 7.5, "error": None}})
    assert codes(diagnose(p, SEED_T4_NVML))["fp16_matmul_wrong"] == "fail"


def test_no_driver_no_probe_is_a_verdict() -> None:
    report = build_report("py", None, NO_DRIVER)
    assert report.verdict == "fail"
    assert report.summary.startswith("no NVIDIA GPU visible")


def test_throttle_reasons_are_named() -> None:
    assert throttle_names(0x4) == ["sw_power_cap"]
    assert throttle_names(0x1 | 0x40) == ["gpu_idle", "hw_thermal_slowdown"]
    assert throttle_names(0) == []


def test_t4_report_renders_for_people() -> None:
    from mcp_server.cli_host import render_gpu

    report = build_report("/usr/bin/python3.13", ProbeRun(report=probe(), seconds=12), SEED_T4_NVML)
    text = render_gpu(report)
    assert "Tesla T4, capability 7.5" in text
    assert "throttle: sw_power_cap" in text
    assert "vLLM flags          --dtype float16" in text
    assert "[WARN] turing_shared_memory" in text
    assert text.rstrip().endswith(
        "verdict: warn: Tesla T4 sm_75 ready (needs: no_native_bf16, turing_shared_memory)"
    )
