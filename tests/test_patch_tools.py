"""apply / verify / revert / diff through the serving interpreter, the CLI and a real MCP client.

The vLLM here is the real 0.33.0 (and 0.22.0) file from the wheel, laid out in a throwaway venv's
site-packages (or a PYTHONUSERBASE user site) with its dist-info, so the lookup runs in another
interpreter exactly as for a full install. tests/test_patch_wheels.py does the same with the
complete wheels from PyPI.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import anyio
import pytest
from patch_support import SPEC, STOCK_0_22_0, STOCK_0_33_0, install_fake_wheel, user_site

from mcp_server.cli import main
from mcp_server.wording import render_for
from patches.engine import record_hash
from tools.errors import InvalidInputError, NotFoundError, RefusedError
from tools.turing import (
    apply_turing_patch,
    patch_diff,
    require_turing_patch,
    revert_turing_patch,
    verify_turing_patch,
)
from tools.vllm_locate import _run_probe, locate_installed_file


@pytest.fixture(autouse=True)
def gpurig_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "gpurig-home"
    monkeypatch.setenv("GPURIG_HOME", str(home))
    monkeypatch.delenv("GPURIG_PYTHON", raising=False)
    return home


def _venv(root: Path) -> tuple[str, Path]:
    venv.create(root, with_pip=False, symlinks=True)
    python = root / "bin" / "python"
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return str(python), Path(out.stdout.strip())


@pytest.fixture
def vllm_033(tmp_path: Path) -> tuple[str, Path]:
    python, site_dir = _venv(tmp_path / "venv")
    path, digest, size = STOCK_0_33_0
    target = install_fake_wheel(site_dir, "0.33.0", path, digest, size)
    target.chmod(0o640)
    return python, target


def test_locate_in_a_venv(vllm_033) -> None:
    python, target = vllm_033
    found = locate_installed_file(SPEC.target, "vllm", python)
    assert found.version == "0.33.0"
    assert Path(found.path) == target
    assert found.record_sha256 == STOCK_0_33_0[1] and found.record_size == STOCK_0_33_0[2]
    assert found.dist_info.endswith("vllm-0.33.0.dist-info")
    assert found.python_executable == python


def test_locate_through_gpurig_python(vllm_033, monkeypatch) -> None:
    python, target = vllm_033
    monkeypatch.setenv("GPURIG_PYTHON", python)
    assert Path(locate_installed_file(SPEC.target).path) == target


@pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site disabled for this interpreter")
def test_locate_in_a_pythonuserbase_user_site(tmp_path, monkeypatch) -> None:
    userbase = tmp_path / "pyuser"
    path, digest, size = STOCK_0_33_0
    target = install_fake_wheel(user_site(userbase), "0.33.0", path, digest, size)
    monkeypatch.setenv("PYTHONUSERBASE", str(userbase))
    report = apply_turing_patch(sys.executable)
    assert Path(report.path) == target
    assert (report.state_before, report.state_after) == ("stock", "patched")
    assert revert_turing_patch(sys.executable).state_after == "stock"


def test_no_vllm_is_a_clear_not_found(tmp_path) -> None:
    python, _ = _venv(tmp_path / "empty")
    with pytest.raises(NotFoundError) as err:
        verify_turing_patch(python)
    assert "vllm is not installed" in err.value.message
    assert "pip install vllm" in err.value.remedy


@pytest.mark.parametrize(
    ("python", "error", "text"),
    [
        ("/nonexistent/bin/python", NotFoundError, "interpreter /nonexistent/bin/python does not"),
        ("no-such-python-xyz", NotFoundError, "no interpreter named 'no-such-python-xyz' on PATH"),
        ("{tmp}/notes.txt", InvalidInputError, "notes.txt is not executable"),
        ("{tmp}", InvalidInputError, "is a directory, not a Python interpreter"),
        ("", InvalidInputError, "path is empty"),  # not a silent fallback to another Python
        ("/bin/true", InvalidInputError, "a program named 'true', not a Python interpreter"),
    ],
)
def test_bad_python_is_a_clear_error(python, error, text, tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not a program\n")
    with pytest.raises(error, match=text):
        verify_turing_patch(python.format(tmp=tmp_path))


def test_lookup_does_not_read_the_callers_stdin(tmp_path) -> None:
    """Under `gpurig mcp` (stdio) our stdin is the MCP wire: the serving interpreter must not
    inherit it. A stand-in interpreter reports whether it saw an open stdin or end-of-file."""
    seen = tmp_path / "stdin-was"
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/bash\n"
        f"if read -r -t 1 _line; then echo data > {seen}; elif [ $? -gt 128 ]; then "
        f"echo open > {seen}; else echo eof > {seen}; fi\n"
        'echo \'{"found": false, "executable": "x", "python_version": "3.13.5"}\'\n'
    )
    fake.chmod(0o755)
    read_end, write_end = os.pipe()  # an open stdin with nothing to read, like an idle wire
    saved = os.dup(0)
    try:
        os.dup2(read_end, 0)
        # the stand-in is a script, which resolve_python refuses: ask the lookup directly
        assert _run_probe(str(fake), "vllm", SPEC.target)["found"] is False
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    assert seen.read_text().strip() == "eof"


def test_verify_creates_nothing_and_a_bad_home_is_a_clear_error(
    vllm_033, gpurig_home, tmp_path, monkeypatch
) -> None:
    python, target = vllm_033
    assert verify_turing_patch(python).state_after == "stock"
    assert not gpurig_home.exists()  # a read-only tool leaves no state directory behind
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPURIG_HOME", str(blocker / "home"))
    stock = target.read_bytes()
    with pytest.raises(InvalidInputError, match="cannot create the state directory") as err:
        apply_turing_patch(python)
    assert "GPURIG_HOME" in err.value.remedy
    assert target.read_bytes() == stock


def test_record_without_the_file_is_not_found(tmp_path) -> None:
    python, site_dir = _venv(tmp_path / "venv")
    path, digest, size = STOCK_0_33_0
    install_fake_wheel(site_dir, "0.33.0", path, digest, size)
    record = site_dir / "vllm-0.33.0.dist-info" / "RECORD"
    record.write_text(
        "".join(ln for ln in record.read_text().splitlines(True) if SPEC.target not in ln)
    )
    with pytest.raises(NotFoundError, match="does not list"):
        verify_turing_patch(python)


def test_shadowing_source_tree_is_refused(vllm_033, tmp_path, monkeypatch) -> None:
    python, _ = vllm_033
    checkout = tmp_path / "checkout"
    (checkout / "vllm").mkdir(parents=True)
    (checkout / "vllm" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(checkout))
    with pytest.raises(NotFoundError, match="loads from"):
        verify_turing_patch(python)


def test_apply_verify_revert_cycle(vllm_033, gpurig_home) -> None:
    python, target = vllm_033
    stock = target.read_bytes()

    v = verify_turing_patch(python)
    assert (v.state_after, v.clamp_present, v.occurrences) == ("stock", False, 0)

    dry = apply_turing_patch(python, dry_run=True)
    assert (dry.changed, dry.dry_run, dry.state_after) == (True, True, "patched")
    assert (dry.clamp_present, dry.verdict) == (False, "CLAMP ABSENT")  # the file on disk
    assert target.read_bytes() == stock

    a = apply_turing_patch(python)
    assert (a.state_before, a.state_after, a.changed, a.occurrences) == (
        "stock",
        "patched",
        True,
        1,
    )
    assert a.verdict == "CLAMP PRESENT"
    patched = target.read_bytes()
    compile(patched, str(target), "exec")
    assert target.stat().st_mode & 0o777 == 0o640  # mode kept
    assert not list(target.parent.glob(".*.tmp"))  # no temp file left behind
    backup = Path(a.backup)
    assert backup.is_relative_to(gpurig_home) and backup.read_bytes() == stock

    again = apply_turing_patch(python)
    assert (again.changed, again.state_before, again.occurrences) == (False, "patched", 1)
    assert target.read_bytes() == patched

    assert require_turing_patch(python, (7, 5)).state_after == "patched"

    d = patch_diff(python)
    assert d.state == "patched" and "+    # >>> gpurig patch turing-smem-clamp v1" in d.diff

    r = revert_turing_patch(python)
    assert (r.state_before, r.state_after, r.changed) == ("patched", "stock", True)
    assert target.read_bytes() == stock
    assert record_hash(target.read_bytes()) == STOCK_0_33_0[1]
    assert target.stat().st_mode & 0o777 == 0o640

    assert revert_turing_patch(python).changed is False


def test_file_changed_by_someone_else_is_refused(vllm_033) -> None:
    python, target = vllm_033
    edited = target.read_bytes().replace(b"def _get_tile_size(", b"def _get_tile_size( ", 1)
    target.write_bytes(edited)
    with pytest.raises(RefusedError, match="changed by someone else") as err:
        apply_turing_patch(python)
    assert "--force-reinstall --no-deps vllm==0.33.0" in err.value.remedy
    assert target.read_bytes() == edited
    with pytest.raises(RefusedError, match="did not make"):
        revert_turing_patch(python)
    assert target.read_bytes() == edited
    assert verify_turing_patch(python).state_after == "modified"


def test_patched_then_edited_is_modified_and_refused(vllm_033) -> None:
    python, target = vllm_033
    apply_turing_patch(python)
    edited = target.read_bytes().replace(b"- 4096", b"- 1024", 1)
    target.write_bytes(edited)
    v = verify_turing_patch(python)
    assert (v.state_after, v.clamp_present, v.occurrences) == ("modified", False, 1)
    with pytest.raises(RefusedError):
        apply_turing_patch(python)
    with pytest.raises(RefusedError, match="stock bytes are kept"):
        revert_turing_patch(python)
    assert target.read_bytes() == edited
    with pytest.raises(RefusedError, match="is modified"):
        require_turing_patch(python, (7, 5))


def test_unknown_layout_0_22_0_is_refused_byte_identical(tmp_path) -> None:
    python, site_dir = _venv(tmp_path / "venv")
    path, digest, size = STOCK_0_22_0
    target = install_fake_wheel(site_dir, "0.22.0", path, digest, size)
    before = target.read_bytes()
    assert verify_turing_patch(python).state_after == "stock"
    with pytest.raises(RefusedError, match="layout not recognised") as err:
        apply_turing_patch(python)
    assert "launch_kwargs" in err.value.message
    assert target.read_bytes() == before
    assert not (Path(os.environ["GPURIG_HOME"]) / "backups").exists()


def test_require_turing_patch(vllm_033) -> None:
    python, _ = vllm_033
    for capability in [(8, 0), (9, 0), (12, 0), None]:
        assert require_turing_patch(python, capability) is None
    with pytest.raises(RefusedError, match="capability 7.5 needs the Turing clamp") as err:
        require_turing_patch(python, (7, 5))
    assert "gpurig patch apply" in err.value.remedy


# --- CLI ------------------------------------------------------------------------------------


def test_cli_cycle(vllm_033, capsys) -> None:
    python, target = vllm_033
    assert main(["patch", "verify", "--python", python]) == 1
    out = capsys.readouterr().out
    assert "CLAMP ABSENT" in out and "OCCURRENCES 0" in out
    assert main(["patch", "apply", "--python", python]) == 0
    out = capsys.readouterr().out
    assert "CLAMP PRESENT\nOCCURRENCES 1" in out and str(target) in out and "0.33.0" in out
    assert main(["patch", "verify", "--python", python, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state_after"] == "patched" and report["occurrences"] == 1
    assert report["verdict"] == "CLAMP PRESENT"
    assert main(["patch", "diff", "--python", python, "--upstream"]) == 0
    diff = capsys.readouterr().out
    assert diff.startswith(f"--- a/{SPEC.target}\n+++ b/{SPEC.target}\n") and "gpurig" not in diff
    assert main(["patch", "revert", "--python", python]) == 0
    assert record_hash(target.read_bytes()) == STOCK_0_33_0[1]


def test_cli_errors_exit_2_with_remedy(capsys) -> None:
    assert main(["patch", "verify", "--python", "/nonexistent/python"]) == 2
    err = capsys.readouterr().err
    assert "gpurig: error: the serving interpreter /nonexistent/python does not exist" in err
    assert "gpurig: what to do:" in err
    assert main(["patch", "diff", "--file", str(STOCK_0_22_0[0])]) == 2


def test_diff_without_vllm_points_at_file(tmp_path, capsys) -> None:
    python, _ = _venv(tmp_path / "empty")
    assert main(["patch", "diff", "--python", python]) == 2
    err = capsys.readouterr().err
    assert "vllm is not installed" in err and "gpurig patch diff --file" in err


def test_cli_diff_of_a_file(capsys) -> None:
    assert main(["patch", "diff", "--file", str(STOCK_0_33_0[0]), "--upstream"]) == 0
    assert "+            launch_num_stages = 1" in capsys.readouterr().out


def test_console_script_runs(vllm_033, run_gpurig) -> None:
    python, _ = vllm_033
    proc = run_gpurig("patch", "verify", "--python", python)
    assert proc.returncode == 1 and "CLAMP ABSENT" in proc.stdout


# --- MCP ------------------------------------------------------------------------------------


def _mcp_server():
    from mcp_server import mcp_patch
    from mcp_server.mcp_base import GpurigMCP

    server = GpurigMCP("patch-test")
    mcp_patch.register(server)
    return server


def test_mcp_tools_listed_with_annotations_and_schemas() -> None:
    from mcp import Client

    async def run():
        async with Client(_mcp_server()) as client:
            return (await client.list_tools()).tools

    tools = {t.name: t for t in anyio.run(run)}
    assert set(tools) == {
        "apply_turing_patch",
        "verify_turing_patch",
        "revert_turing_patch",
        "turing_patch_diff",
    }
    assert tools["verify_turing_patch"].annotations.read_only_hint is True
    assert tools["apply_turing_patch"].annotations.idempotent_hint is True
    assert tools["revert_turing_patch"].annotations.destructive_hint is True
    assert tools["revert_turing_patch"].annotations.idempotent_hint is True  # stock: no-op
    for name in tools:  # the interpreter argument is described for an LLM caller
        python_bin = tools[name].input_schema["properties"]["python_bin"]
        assert "GPURIG_PYTHON" in python_bin["description"], name
    assert "state_after" in tools["verify_turing_patch"].output_schema["properties"]


def test_mcp_apply_verify_and_error(vllm_033) -> None:
    from mcp import Client

    python, target = vllm_033

    async def run():
        async with Client(_mcp_server()) as client:
            applied = await client.call_tool("apply_turing_patch", {"python_bin": python})
            verified = await client.call_tool("verify_turing_patch", {"python_bin": python})
            bad = await client.call_tool("verify_turing_patch", {"python_bin": "/nonexistent/py"})
            diff = await client.call_tool(
                "turing_patch_diff", {"file": str(STOCK_0_33_0[0]), "upstream": True}
            )
            return applied, verified, bad, diff

    applied, verified, bad, diff = anyio.run(run)
    assert not diff.is_error and diff.structured_content["vllm_version"] is None
    assert "+            launch_num_stages = 1" in diff.structured_content["diff"]
    assert not applied.is_error and applied.structured_content["state_after"] == "patched"
    assert verified.structured_content["clamp_present"] is True
    assert verified.structured_content["occurrences"] == 1
    assert bad.is_error
    assert "/nonexistent/py does not exist" in bad.content[0].text
    assert "What to do:" in bad.content[0].text
    assert b"gpurig patch turing-smem-clamp v1" in target.read_bytes()


def test_server_registers_the_patch_tools() -> None:
    from mcp_server.server import mcp

    async def names():
        return {t.name for t in await mcp.list_tools()}

    assert {"apply_turing_patch", "verify_turing_patch", "revert_turing_patch"} <= anyio.run(names)


@pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site disabled for this interpreter")
def test_second_install_is_reported_as_shadowed(tmp_path, monkeypatch) -> None:
    """Two vLLMs on sys.path: the one `import vllm` loads is patched, the other is named."""
    path, digest, size = STOCK_0_33_0
    first = tmp_path / "on-pythonpath"
    target = install_fake_wheel(first, "0.33.0", path, digest, size)
    userbase = tmp_path / "pyuser"
    install_fake_wheel(user_site(userbase), "0.33.0", path, digest, size)
    monkeypatch.setenv("PYTHONPATH", str(first))
    monkeypatch.setenv("PYTHONUSERBASE", str(userbase))
    report = verify_turing_patch(sys.executable)
    assert Path(report.path) == target
    assert len(report.shadowed) == 1 and str(user_site(userbase)) in report.shadowed[0]


def _doctor_turing_line(python: str, gpu_report=None):
    from tools.doctor import DoctorContext, check_turing_patch

    ctx = DoctorContext(python_bin=python)
    if gpu_report is not None:  # the GPU part replayed from a real host (no GPU here)
        ctx._cache["gpu"] = gpu_report
    return check_turing_patch(ctx)


def _seed_t4_report(python: str):
    from test_gpu_probe import SEED_T4_NVML, probe

    from tools.gpu import ProbeRun, build_report

    return build_report(python, ProbeRun(report=probe(), seconds=1.0), SEED_T4_NVML)


def test_doctor_turing_line_follows_the_gpu_and_the_file(vllm_033) -> None:
    python, _ = vllm_033
    # No GPU here: the clamp cannot be judged needed, the stock file is fine.
    line = _doctor_turing_line(python)
    assert line.status == "ok" and "stock" in line.detail and "no GPU" in line.detail
    # The seed's T4 (capability 7.5) with a stock file: a failure that says what to run.
    t4 = _seed_t4_report(python)
    line = _doctor_turing_line(python, t4)
    assert line.status == "fail" and "7.5" in line.detail
    assert render_for("cli", line.remedy) == "gpurig patch apply"
    assert render_for("mcp", line.remedy) == "call apply_turing_patch"
    apply_turing_patch(python)
    line = _doctor_turing_line(python, t4)
    assert line.status == "ok" and "patched" in line.detail
    # Edited after patching: apply alone would be refused, so the remedy reinstalls first.
    _, target = vllm_033
    target.write_bytes(target.read_bytes().replace(b"- 4096", b"- 1024", 1))
    line = _doctor_turing_line(python, t4)
    assert line.status == "fail" and "modified" in line.detail
    assert render_for("cli", line.remedy) == (
        f"{python} -m pip install --force-reinstall --no-deps vllm==0.33.0 && gpurig patch apply"
    )


def test_doctor_turing_line_skips_without_vllm(tmp_path) -> None:
    python, _ = _venv(tmp_path / "bare")
    line = _doctor_turing_line(python)
    assert line.status == "skip"
