"""README's table of exit codes is what the CLI returns: each documented code is produced by the
table's own example (run as written, in an empty directory), and 130 by a real Ctrl-C (SIGINT)
in the middle of a generation."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

README = Path(__file__).resolve().parent.parent / "README.md"


def documented_codes() -> dict[int, str]:
    """{code: example} from the `| code | meaning | example |` table under `### Exit codes`."""
    section = README.read_text().split("### Exit codes", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| (\d+) \| [^|]+ \| (.+) \|$", section, flags=re.M)
    return {int(code): example.strip() for code, example in rows}


def test_readme_documents_the_four_codes() -> None:
    assert sorted(documented_codes()) == [0, 1, 2, 130]


@pytest.mark.parametrize("code", [0, 1, 2])
def test_each_documented_example_exits_with_its_code(code: int, tmp_path: Path, gpurig_bin) -> None:
    example = documented_codes()[code]
    command = re.fullmatch(r"`(gpurig [^`]+)`.*", example)
    assert command, f"the example for {code} should be a `gpurig ...` command: {example}"
    argv = command.group(1).split()
    done = subprocess.run(
        [gpurig_bin, *argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GPURIG_HOME": str(tmp_path / "state")},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    if code == 2:
        assert "what to do:" in done.stderr


def test_ctrl_c_exits_130_without_a_traceback(tmp_path: Path, gpurig_bin) -> None:
    example = documented_codes()[130]
    assert "Ctrl-C during `gpurig engine generate`" in example
    from engine.checkpoint_maker import make_checkpoint

    make_checkpoint(tmp_path / "tiny", preset="tiny")
    proc = subprocess.Popen(
        [gpurig_bin, "engine", "generate", "--model", str(tmp_path / "tiny"),
         "--prompt", "hi", "--max-tokens", "4000", "--threads", "1", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        got = b""
        while not got and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                got = os.read(proc.stdout.fileno(), 4096)  # the reply is streaming: mid-generation
        assert got, "the generation never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode(errors="replace")
    assert b"Traceback" not in err and b"interrupted" in err
