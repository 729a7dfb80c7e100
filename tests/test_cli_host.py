"""`gpurig host`, `gpurig gpu`, `gpurig doctor` run as subprocesses: tables, --json, exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.gpu import GpuArchReport
from tools.host import HostCapacity

NO_GPU = not Path("/proc/driver/nvidia").exists()


def test_help_lists_the_commands(run_gpurig) -> None:
    out = run_gpurig("--help")
    assert out.returncode == 0
    for command in ("host", "gpu", "doctor", "mcp"):
        assert command in out.stdout
    # what keeps it quick, asserted as such (not by a clock): --help imports neither torch nor
    # the engine
    code = (
        "import sys\nfrom mcp_server.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'engine.runtime' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr.split()[-2:] == ["False", "False"], done.stderr


def test_mcp_bad_port_is_a_usage_error(run_gpurig) -> None:
    out = run_gpurig("mcp", "--transport", "streamable-http", "--port", "99999", timeout=30)
    assert out.returncode == 2
    assert "'99999' is not a TCP port (1-65535)" in out.stderr and "Traceback" not in out.stderr


def test_host_table(run_gpurig, tmp_path: Path) -> None:
    future = tmp_path / "later"
    out = run_gpurig("host", "--path", str(tmp_path), "--path", str(future))
    assert out.returncode == 0, out.stderr
    assert "free GiB" in out.stdout and "advice:" in out.stdout
    assert "does not exist yet" in out.stdout
    assert "verdict: ok" in out.stdout
    assert out.stdout.count(str(tmp_path)) >= 2


def test_host_table_keeps_one_decimal_and_names_a_missing_nvml(tmp_path: Path) -> None:
    from mcp_server.cli_host import render_host
    from tools.host import check_host_capacity

    report = check_host_capacity(paths=[str(tmp_path)])
    fs = report.filesystems[0].model_copy(update={"total_gib": 252.0, "free_gib": 72.9})
    report = report.model_copy(update={"filesystems": [fs], "nvidia_gpu_count": None})
    header, rule, row = render_host(report).splitlines()[:3]
    assert row.split()[3:5] == ["72.9", "252.0"]  # not "252": both columns read alike
    assert "NVML unavailable" in render_host(report)


def test_host_json(run_gpurig, tmp_path: Path) -> None:
    out = run_gpurig("host", "--json", "--path", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = HostCapacity.model_validate_json(out.stdout)
    assert report.paths[0].path == str(tmp_path)
    assert report.seconds < 10  # a hang guard (a stuck mount, a blocking probe), not a speed claim


def test_host_failing_verdict_exits_1(run_gpurig, tmp_path: Path) -> None:
    out = run_gpurig("host", "--path", str(tmp_path), "--need-gib", "90000")
    assert out.returncode == 1
    assert "[FAIL] disk_space" in out.stdout
    # 90000 GiB cannot be staged in RAM either, and no disk here holds such a swapfile: say so,
    # rather than print a fallocate that fails with "No space left on device"
    assert "[FAIL] memory_staging" in out.stdout
    assert "no measured disk filesystem has that much free space" in out.stdout.replace(
        "\n    ", " "
    )
    assert "fallocate" not in out.stdout


def test_host_bad_input_exits_2(run_gpurig) -> None:
    out = run_gpurig("host", "--need-gib", "-5")
    assert out.returncode == 2
    assert "gpurig: error: need_gib must be a positive number" in out.stderr
    assert "what to do" in out.stderr
    assert "Traceback" not in out.stderr


def test_gpu_json(run_gpurig) -> None:
    out = run_gpurig("gpu", "--json")
    report = GpuArchReport.model_validate_json(out.stdout)
    assert out.returncode == (1 if report.verdict == "fail" else 0)
    if NO_GPU:
        assert report.verdict == "fail"
        assert "no NVIDIA GPU visible" in report.summary


def test_gpu_missing_interpreter_exits_2(run_gpurig, tmp_path: Path) -> None:
    out = run_gpurig("gpu", "--python", str(tmp_path / "python3.13"))
    assert out.returncode == 2
    assert "does not exist" in out.stderr and "GPURIG_PYTHON" in out.stderr
    out = run_gpurig("gpu", env={"GPURIG_PYTHON": str(tmp_path / "python9")})
    assert out.returncode == 2 and "python9" in out.stderr


def test_gpu_table_under_a_venv_without_torch(run_gpurig, bare_venv: Path) -> None:
    out = run_gpurig("gpu", "--python", str(bare_venv))
    assert out.returncode == 1
    assert "torch_missing" in out.stdout
    assert f"{bare_venv} -m pip install torch" in out.stdout.replace("\n       ", " ")


def test_doctor_with_a_wrong_gpurig_python_exits_2(run_gpurig, tmp_path: Path) -> None:
    """The same as a wrong --python: one clear error naming where the path came from."""
    out = run_gpurig("doctor", env={"GPURIG_PYTHON": str(tmp_path / "python9")})
    assert out.returncode == 2, out.stdout
    assert f"{tmp_path / 'python9'} (GPURIG_PYTHON) does not exist" in out.stderr
    assert "what to do" in out.stderr and out.stdout == ""


@pytest.mark.skipif(not NO_GPU, reason="asserts this machine's no-GPU report")
def test_doctor_table(run_gpurig) -> None:
    out = run_gpurig("doctor")  # bounded by its probes' own timeouts (tests/test_interpreter.py)
    assert out.returncode == 1, out.stderr
    for line in ("filesystems", "host memory", "disk space", "driver", "torch", "readiness: fail"):
        assert line in out.stdout
    assert "no NVIDIA GPU visible" in out.stdout
    assert "what to do:" in out.stdout
