"""The serving interpreter (python_bin, --python, GPURIG_PYTHON): what is refused, by its file
alone and before anything runs, and what a probe under a misbehaving one reports.

A fuzzer found that any executable was run as python_bin (a shell script ran; /bin/sh read
gpu_probe.py as a script) and `gpurig doctor --python /bin/ls` exited 1 (README promises 2).
tools/interpreter.py decides from the file: regular, ELF, named like python/pypy.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

from tools import gpu
from tools.errors import InvalidInputError, NotFoundError
from tools.gpu import NvmlReport, build_report, verify_gpu_arch
from tools.interpreter import looks_like_interpreter_name


def codes(diagnoses) -> dict[str, str]:
    return {d.code: d.severity for d in diagnoses}


# --- bad interpreters --------------------------------------------------------------------------


def test_nonexistent_interpreter(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError) as err:
        verify_gpu_arch(python_bin=str(tmp_path / "no" / "python3"))
    assert "does not exist" in err.value.message
    assert err.value.remedy
    with pytest.raises(NotFoundError):
        verify_gpu_arch(python_bin="no-such-python-anywhere")


def test_empty_python_bin_is_refused_not_defaulted(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--python "$UNSET"` must not quietly probe another interpreter; an empty GPURIG_PYTHON
    is unset, though."""
    with pytest.raises(InvalidInputError, match="path is empty"):
        verify_gpu_arch(python_bin="")
    monkeypatch.setenv("GPURIG_PYTHON", "")
    assert gpu.resolve_python(None) == str(Path(sys.executable).absolute())


def test_directory_and_non_executable(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="directory"):
        verify_gpu_arch(python_bin=str(tmp_path))
    plain = tmp_path / "python3"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(InvalidInputError, match="not executable"):
        verify_gpu_arch(python_bin=str(plain))


def test_not_a_python_is_refused_without_running_it(tmp_path: Path) -> None:
    """A script, /bin/sh, /bin/ls, an ELF not named like Python: refused by the file alone."""
    ran = tmp_path / "ran"
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\necho 'I am a shell script' > {ran}\n")
    fake.chmod(0o755)
    with pytest.raises(InvalidInputError, match="is a script") as err:
        verify_gpu_arch(python_bin=str(fake))
    assert "not a Python interpreter" in err.value.message and err.value.remedy
    for program in ("/bin/sh", "/bin/ls"):
        with pytest.raises(InvalidInputError, match="not a Python interpreter"):
            verify_gpu_arch(python_bin=program)
    binary = tmp_path / "garbage"
    binary.write_bytes(b"\x7fELF\x00garbage")
    binary.chmod(0o755)
    with pytest.raises(InvalidInputError, match="named 'garbage'"):
        verify_gpu_arch(python_bin=str(binary))
    not_elf = tmp_path / "python3.12"
    not_elf.write_bytes(b"MZ\x00\x00 a program of another kind")
    not_elf.chmod(0o755)
    with pytest.raises(InvalidInputError, match="no ELF header"):
        verify_gpu_arch(python_bin=str(not_elf))
    link = tmp_path / "python"  # a link named python to a program that is not
    link.symlink_to("/bin/ls")
    with pytest.raises(InvalidInputError, match="a link to"):
        verify_gpu_arch(python_bin=str(link))
    assert not ran.exists()


def test_real_interpreters_are_accepted(bare_venv: Path) -> None:
    """A venv's bin/python (a link to the base interpreter) and sys.executable itself."""
    assert gpu.resolve_python(str(bare_venv)) == str(bare_venv)
    assert gpu.resolve_python(sys.executable) == str(Path(sys.executable).absolute())
    for name in ("python", "python3", "python3.12", "python3.13t", "pypy3", "pypy3.10"):
        assert looks_like_interpreter_name(name), name
    for name in ("sh", "ls", "python3-config", "python3.12-config", "ipython3", "mypython"):
        assert not looks_like_interpreter_name(name), name


def test_not_a_python_waits_for_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that fails raises only after the NVML thread is done: a CLI exiting while that
    thread is inside pynvml crashed at shutdown (`gpurig gpu --python /bin/ls`: SIGSEGV).
    /bin/ls is refused by its file now; a copy named python3 passes that check and fails when
    run."""
    impostor = tmp_path / "python3"
    shutil.copy("/bin/ls", impostor)
    finished: list[bool] = []

    def slow_nvml() -> NvmlReport:
        time.sleep(0.5)
        finished.append(True)
        return NvmlReport(available=False, error="stand-in")

    monkeypatch.setattr(gpu, "read_nvml", slow_nvml)
    with pytest.raises(InvalidInputError, match="not a Python"):
        verify_gpu_arch(python_bin=str(impostor))
    assert finished == [True]


def test_cli_not_a_python_exits_2_cleanly(run_gpurig) -> None:
    for _ in range(2):
        out = run_gpurig("gpu", "--python", "/bin/ls", "--json")
        assert out.returncode == 2, out.stderr
        assert "not a Python" in out.stderr and out.stdout == ""
        assert "--python" in out.stderr and "Traceback" not in out.stderr
    out = run_gpurig("doctor", "--python", "/bin/ls")  # README: 2 for bad input
    assert out.returncode == 2, out.stderr
    assert "not a Python interpreter" in out.stderr and "Traceback" not in out.stderr


def _stand_in(path: Path, script: str) -> str:
    """A shell script standing in for a misbehaving Python. resolve_python refuses scripts, so
    these tests hand it to run_probe directly (which takes an already resolved interpreter)."""
    path.write_text(script)
    path.chmod(0o755)
    return str(path)


def test_probe_timeout_is_a_verdict(tmp_path: Path) -> None:
    hang = _stand_in(tmp_path / "python3", "#!/bin/sh\nsleep 60\n")
    started = time.monotonic()
    run = gpu.run_probe(hang, timeout_s=1)
    report = build_report(hang, run, NvmlReport(available=False))
    assert time.monotonic() - started < 10
    assert report.verdict == "fail"
    assert codes(report.diagnoses)["probe_timeout"] == "fail"


def test_probe_that_dies_is_a_verdict(tmp_path: Path) -> None:
    """A Python that starts the probe and then segfaults (a broken torch does this)."""
    dies = _stand_in(
        tmp_path / "python3", "#!/bin/sh\necho 'GPURIG_PROBE_START {}'\nkill -SEGV $$\n"
    )
    report = build_report(dies, gpu.run_probe(dies), NvmlReport(available=False))
    crash = next(d for d in report.diagnoses if d.code == "probe_crashed")
    assert "SIGSEGV" in crash.message
