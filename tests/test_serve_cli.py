"""`gpurig serve ...` as a user runs it: a failed start names its cause (exit 1), status lists
it (table and --json), and a refusal or a stop with nothing running exits 2 with what to do."""

from __future__ import annotations

import json

from serve_support import free_port


def test_failed_start_then_status_and_logs(run_gpurig, tmp_path):
    env = {"GPURIG_HOME": str(tmp_path / "home")}
    empty = tmp_path / "empty"
    empty.mkdir()
    port = str(free_port())
    proc = run_gpurig("serve", "start", str(empty), "--backend", "engine", "--port", port,
                      "--name", "bad", env=env)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "FAILED: the engine refused to start [engine_refused] (exit code 2)" in proc.stdout
    assert "config.json" in proc.stdout and "what to do:" in proc.stdout
    proc = run_gpurig("serve", "status", env=env)
    assert proc.returncode == 0
    assert "bad" in proc.stdout and "dead" in proc.stdout and "engine_refused" in proc.stdout
    report = json.loads(run_gpurig("serve", "status", "--json", env=env).stdout)
    (server,) = report["servers"]
    assert server["state"] == "dead" and server["failure"]["cause"] == "engine_refused"
    assert server["ended"] == "exit code 2"
    logs = run_gpurig("serve", "logs", "bad", "--grep", "what to do", env=env)
    assert logs.returncode == 0 and logs.stdout.startswith("gpurig: what to do:")


def test_refusals_exit_2_with_the_fix(run_gpurig, tmp_path):
    env = {"GPURIG_HOME": str(tmp_path / "home")}
    proc = run_gpurig("serve", "stop", env=env)
    assert proc.returncode == 2 and "no server is running" in proc.stderr
    assert "gpurig serve start" in proc.stderr
    proc = run_gpurig("serve", "start", str(tmp_path / "nope"), "--backend", "engine", env=env)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run_gpurig("serve", "spot-check", "--check", "no arrow", env=env)
    assert proc.returncode == 2 and "PROMPT=>EXPECT" in proc.stderr
    proc = run_gpurig("serve", "start", "m", "--env", "NOEQUALS", env=env)
    assert proc.returncode == 2 and "NAME=VALUE" in proc.stderr
