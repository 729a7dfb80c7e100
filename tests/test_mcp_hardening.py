"""The MCP front door under bad input, through a real client over stdio against `gpurig mcp`.

What a fuzzer found (issue 12): pydantic's raw text with a link to errors.pydantic.dev, unknown
arguments silently ignored, a 20 MB path answered with a 126 MB error after 133 s, an empty
serverInfo version, no tool titles, empty prompts/resources advertised, /dev/zero read until
MemoryError, a shell script run as python_bin. Every tool of every area is checked, whichever
module registered it: the plumbing is shared (mcp_server/mcp_base.py).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import time
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

RAW_PYDANTIC = ("errors.pydantic.dev", "input_value=", "type=", "validation error for")


def _text(result) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


def _plain(text: str) -> None:
    for raw in RAW_PYDANTIC:
        assert raw not in text, text


async def _session(gpurig_bin: str, tmp_path: Path) -> None:
    env = {**os.environ, "GPURIG_HOME": str(tmp_path / "home")}
    env.pop("GPURIG_PYTHON", None)
    params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=env)
    async with Client(params, read_timeout_seconds=120) as client:
        # serverInfo and capabilities, as the client's initialize saw them
        assert client.server_info.name == "gpurig"
        assert client.server_info.version == importlib.metadata.version("gpurig")
        caps = client.server_capabilities
        assert caps.tools is not None
        assert caps.prompts is None  # no prompts: not advertised (the SDK would, empty)
        assert caps.resources is not None  # the server logs (mcp_resources.py)

        tools = (await client.list_tools()).tools
        assert len(tools) >= 7
        for tool in tools:  # every area's tools get the shared plumbing
            assert (tool.title or "").strip(), tool.name
            assert tool.input_schema.get("additionalProperties") is False, tool.name
            for name, prop in tool.input_schema.get("properties", {}).items():
                for branch in prop.get("anyOf", [prop]):
                    if branch.get("type") == "string" and "enum" not in branch:
                        assert branch.get("maxLength"), (tool.name, name)
                    if branch.get("type") == "array":
                        assert branch.get("maxItems"), (tool.name, name)

        # a wrong type: which argument, what was given, what is accepted
        bad = await client.call_tool("check_host_capacity", {"need_gib": "lots"})
        text = _text(bad)
        assert bad.is_error and "argument need_gib" in text and '"lots"' in text
        assert "Accepted: a number greater than 0" in text
        _plain(text)
        bad = await client.call_tool("check_host_capacity", {"need_gib": -1})
        assert bad.is_error and "greater than 0" in _text(bad) and "given: -1" in _text(bad)
        _plain(_text(bad))
        bad = await client.call_tool("verify_gpu_arch", {"timeout_s": [1, 2]})
        assert bad.is_error and "argument timeout_s" in _text(bad)
        _plain(_text(bad))

        # unknown arguments are refused, named, and the accepted ones listed
        bad = await client.call_tool("doctor", {"need_gb": 10, "python": "/usr/bin/python3"})
        text = _text(bad)
        assert bad.is_error and '"need_gb"' in text and '"python"' in text
        assert "Accepted arguments: python_bin, need_gib" in text

        # a 20 MB path: refused at once, with a short reply
        started = time.monotonic()
        bad = await client.call_tool("turing_patch_diff", {"file": "/" + "a" * 20_000_000})
        took = time.monotonic() - started
        assert bad.is_error and "argument file is 20,000,001 characters long" in _text(bad)
        assert len(_text(bad)) < 600, len(_text(bad))
        assert took < 10, took
        bad = await client.call_tool("check_host_capacity", {"paths": ["/"] * 65})
        assert bad.is_error and "65 items; at most 64" in _text(bad)
        bad = await client.call_tool("turing_patch_diff", {"file": "/tmp/a\x00b"})
        assert bad.is_error and "argument file holds a NUL character" in _text(bad)

        # files that are not vLLM's file, and interpreters that are not Python
        bad = await client.call_tool("turing_patch_diff", {"file": "/dev/zero"})
        assert bad.is_error and "file '/dev/zero' is not a regular file" in _text(bad)
        for program in ("/bin/sh", "/bin/ls"):
            bad = await client.call_tool("verify_gpu_arch", {"python_bin": program})
            text = _text(bad)
            assert bad.is_error and "not a Python interpreter" in text, text
            assert "What to do: pass a Python interpreter as python_bin" in text  # MCP's words
            assert "--python" not in text
        script = tmp_path / "python3"
        ran = tmp_path / "ran"
        script.write_text(f"#!/bin/sh\ntouch {ran}\n")
        script.chmod(0o755)
        bad = await client.call_tool("verify_turing_patch", {"python_bin": str(script)})
        assert bad.is_error and "is a script" in _text(bad) and not ran.exists()

        # resources: the logs of servers gpurig started, bounded, read from the state dir
        logs = tmp_path / "home" / "servers"
        logs.mkdir(parents=True)
        (logs / "demo.log").write_text("".join(f"line {i}\n" for i in range(1000)))
        listed = await client.list_resources()
        assert [str(r.uri) for r in listed.resources] == ["gpurig://servers"]
        assert all(r.title for r in listed.resources)
        templates = await client.list_resource_templates()
        assert [t.uri_template for t in templates.resource_templates] == [
            "gpurig://servers/{name}/log"
        ]
        index = await client.read_resource("gpurig://servers")
        rows = json.loads(index.contents[0].text)["servers"]
        assert [r["name"] for r in rows] == ["demo"] and rows[0]["log"].endswith("/demo/log")
        log = (await client.read_resource("gpurig://servers/demo/log")).contents[0].text
        assert "line 999\n" in log and "line 599\n" not in log and "line 600\n" in log
        for uri, text in [
            ("gpurig://servers/nope/log", "no log for a server named 'nope'"),
            ("gpurig://servers/..%2F..%2Fetc%2Fpasswd/log", ""),
        ]:
            with pytest.raises(MCPError) as err:
                await client.read_resource(uri)
            assert text in str(err.value)

        # ... and the server keeps serving
        ok = await client.call_tool("check_host_capacity", {"need_gib": 1})
        assert not ok.is_error, _text(ok)


def test_bad_input_over_stdio(gpurig_bin: str, tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(_session(gpurig_bin, tmp_path), timeout=180))
