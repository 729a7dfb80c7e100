"""An evaluation killed for real resumes: `gpurig eval` (python -m mcp_server.cli) runs as a
child process against a real engine server, gets SIGKILL once some answers are stored, and
`--resume DIR` then asks only the questions the kill lost; the answers, totals and paired table
equal those of a run that was never interrupted. (A torn last line is test_eval_e2e's case.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_support import REPO, ServerProcess

from bench.eval.store import RunStore
from engine.checkpoint_maker import make_checkpoint

pytestmark = pytest.mark.slow

N = 40
KILL_AFTER = 3  # whole lines on disk when the kill is sent
# what must be the same in a resumed run and an uninterrupted one (not the timings)
SAME = ("text", "tool_calls", "error", "right", "why", "bucket", "token_ids")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("eval-resume")
    make_checkpoint(root / "tiny", preset="tiny", seed=0)
    proc = ServerProcess(root / "tiny")
    yield proc
    proc.stop()


@pytest.fixture
def questions(tmp_path: Path) -> Path:
    path = tmp_path / "questions.jsonl"
    rows = [{"id": f"q{i:02d}", "prompt": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"}
            for i in range(N)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(*args: str) -> list[str]:
    return [sys.executable, "-m", "mcp_server.cli", "eval", *args, "--json"]


def _answers(out: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    return {
        r["id"]: {name: {k: a.get(k) for k in SAME} for name, a in r["answers"].items()}
        for r in rows
    }


def test_a_killed_eval_resumes_and_equals_an_uninterrupted_run(server, questions, tmp_path):
    common = [server.base, server.base, "--path", str(questions), "--max-tokens", "24",
              "--concurrency", "1"]  # fmt: skip
    killed = tmp_path / "killed"
    child = subprocess.Popen(
        _eval(*common, "--out-dir", str(killed)), cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    store = RunStore(killed)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if store.answers_path.exists() and len(store.load_rows()) >= KILL_AFTER:
                break
            time.sleep(0.01)
        assert child.poll() is None, f"the run ended before the kill: {child.stderr.read()!r}"
        os.kill(child.pid, signal.SIGKILL)  # the eval's own process, nothing else
    finally:
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    before = [r.id for r in store.load_rows()]
    assert KILL_AFTER <= len(before) < N, len(before)
    assert not store.results_path.exists()  # it never got to the end

    resumed = subprocess.run(_eval("--resume", str(killed)), cwd=REPO, capture_output=True,
                             text=True, timeout=600, check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["asked_now"] == N - len(before) and result["questions"] == N

    whole = subprocess.run(_eval(*common, "--out-dir", str(tmp_path / "whole")), cwd=REPO,
                           capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    reference = json.loads(whole.stdout)
    assert result["totals"] == reference["totals"]
    assert result["paired"] == reference["paired"]
    after = _answers(killed)
    assert len(after) == N  # no question asked twice: one line each
    assert after == _answers(tmp_path / "whole")
    assert [r.id for r in store.load_rows()][: len(before)] == before  # kept, not re-asked
