"""`gpurig mcp` driven by the real MCP Inspector CLI (from npm), as README tells users to run it.

`npx -y @modelcontextprotocol/inspector --cli $(which gpurig) mcp --method tools/list`, then a
tools/call that works and one with a bad argument. Skipped without npx; marked network: the
first run downloads the Inspector from npm (about a minute), later runs use npx's cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.network

NPX = shutil.which("npx")


def _inspector(gpurig_bin: str, *args: str) -> dict:
    out = subprocess.run(
        [NPX, "-y", "@modelcontextprotocol/inspector", "--cli", gpurig_bin, "mcp", *args],
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "npm_config_update_notifier": "false"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    start = out.stdout.find("{")  # the Inspector prints the JSON result on stdout
    assert start >= 0, out.stdout[-2000:]
    return json.loads(out.stdout[start:])


@pytest.mark.skipif(NPX is None, reason="npx (Node.js) is not installed")
def test_inspector_cli_lists_and_calls(gpurig_bin: str) -> None:
    listed = _inspector(gpurig_bin, "--method", "tools/list")
    tools = {t["name"]: t for t in listed["tools"]}
    assert {"doctor", "check_host_capacity", "verify_gpu_arch", "apply_turing_patch"} <= set(tools)
    assert all(t.get("title") for t in tools.values())

    called = _inspector(
        gpurig_bin,
        "--method",
        "tools/call",
        "--tool-name",
        "check_host_capacity",
        "--tool-arg",
        "need_gib=1",
        "--tool-arg",
        'paths=["/"]',
    )
    assert not called.get("isError"), called
    assert called["structuredContent"]["paths"][0]["real_path"] == "/"

    refused = _inspector(
        gpurig_bin,
        "--method",
        "tools/call",
        "--tool-name",
        "check_host_capacity",
        "--tool-arg",
        "need_gib=lots",
    )
    assert refused["isError"] is True
    text = refused["content"][0]["text"]
    assert "argument need_gib" in text and "Accepted: a number" in text
    assert "pydantic" not in text
