"""The shared MCP plumbing (mcp_server/mcp_base.py, mcp_errors.py) and the front-door words
(tools/errors.py), on a small server of its own: what any area's new tool module gets for free.

The tools here are registered exactly as an area's `register(mcp)` does, with the plain SDK
decorator and no error handling of their own; a real MCP client calls them (in-process
transport: the stdio one is covered by test_mcp_hardening.py).
"""

from __future__ import annotations

from typing import Annotated

import anyio
import pytest
from mcp import Client
from pydantic import BaseModel, Field

from mcp_server.mcp_base import GpurigMCP, default_title
from mcp_server.mcp_errors import DEFAULT_MAX_CHARS, describe, excerpt
from mcp_server.output import print_result, report_error
from mcp_server.wording import cli_flag, render_for
from tools.errors import InvalidInputError, arg, either


class Advice(BaseModel):
    remedy: str
    items: list[str]


def _server() -> GpurigMCP:
    mcp = GpurigMCP("plumbing-test")

    @mcp.tool()
    def size_check(
        need_gib: Annotated[float, Field(gt=0)], python_bin: str | None = None
    ) -> Advice:
        """Raises a GpurigError with placeholders, caught by nobody but the plumbing."""
        if need_gib > 100:
            raise InvalidInputError(
                f"{arg('need_gib')} {need_gib} is more than this host has",
                remedy=f"pass a smaller {arg('need_gib')}, or "
                + either(cli="run `gpurig host`", mcp="call check_host_capacity"),
            )
        return Advice(remedy=f"retry with {arg('python_bin')}", items=[f"see {arg('need_gib')}"])

    @mcp.tool(title="A long prompt")
    def long_text(prompt: Annotated[str, Field(max_length=100_000)]) -> Advice:
        """Declares its own bound: longer than the default is fine here."""
        return Advice(remedy="", items=[str(len(prompt))])

    return mcp


def _call(mcp: GpurigMCP, name: str, args: dict):
    async def run():
        async with Client(mcp) as client:
            return await client.call_tool(name, args), (await client.list_tools()).tools

    return anyio.run(run)


def test_gpurig_errors_and_results_speak_mcp_words() -> None:
    mcp = _server()
    result, tools = _call(mcp, "size_check", {"need_gib": 500})
    text = result.content[0].text
    assert result.is_error
    assert text == (
        "size_check: need_gib 500.0 is more than this host has. What to do: pass a smaller "
        "need_gib, or call check_host_capacity"
    )
    result, _ = _call(mcp, "size_check", {"need_gib": 5})
    assert not result.is_error
    assert result.structured_content == {
        "remedy": "retry with python_bin",
        "items": ["see need_gib"],
    }
    assert "{arg:" not in result.content[0].text
    titles = {t.name: t.title for t in tools}
    assert titles == {"size_check": "Size check", "long_text": "A long prompt"}


def test_declared_bounds_win_over_the_defaults() -> None:
    mcp = _server()
    result, tools = _call(mcp, "long_text", {"prompt": "x" * 50_000})
    assert not result.is_error and result.structured_content["items"] == ["50000"]
    schema = next(t for t in tools if t.name == "long_text").input_schema
    assert schema["properties"]["prompt"]["maxLength"] == 100_000
    result, _ = _call(mcp, "long_text", {"prompt": "x" * 100_001})
    assert result.is_error and "at most 100,000 are accepted" in result.content[0].text
    result, _ = _call(
        mcp, "size_check", {"need_gib": 1, "python_bin": "y" * (DEFAULT_MAX_CHARS + 1)}
    )
    assert result.is_error and "4,097 characters long" in result.content[0].text


def test_missing_and_nested_errors_in_plain_words() -> None:
    mcp = _server()
    result, _ = _call(mcp, "size_check", {})
    text = result.content[0].text
    assert result.is_error and text.startswith("size_check: argument need_gib: is required.")
    assert "Accepted: a number greater than 0" in text
    result, _ = _call(mcp, "size_check", {"need_gib": 0, "python_bin": 7})
    text = result.content[0].text
    assert "argument need_gib (given: 0): should be greater than 0" in text
    assert "argument python_bin (given: 7): should be a valid string" in text
    assert "pydantic" not in text


def test_front_door_words() -> None:
    text = f"pass {arg('need_gib')} or {arg('python_bin')}; " + either(
        cli="gpurig patch apply", mcp="apply_turing_patch"
    )
    assert render_for("cli", text) == "pass --need-gib or --python; gpurig patch apply"
    assert render_for("mcp", text) == "pass need_gib or python_bin; apply_turing_patch"
    assert render_for("cli", "a {literal} brace and ${HOME}") == "a {literal} brace and ${HOME}"
    assert cli_flag("timeout_s") == "--timeout" and cli_flag("max_tokens") == "--max-tokens"
    with pytest.raises(ValueError):
        either(cli="a|b", mcp="c")
    with pytest.raises(ValueError):
        arg("need-gib")
    err = InvalidInputError(f"bad {arg('need_gib')}", remedy=f"pass {arg('need_gib')} 10")
    assert str(err) == "bad need_gib -> pass need_gib 10"  # neutral: no front door's words


def test_cli_prints_flags(capsys: pytest.CaptureFixture[str]) -> None:
    err = InvalidInputError(f"bad {arg('need_gib')}", remedy=f"pass {arg('python_bin')}")
    assert report_error(err) == 2
    assert (
        capsys.readouterr().err
        == "gpurig: error: bad --need-gib\ngpurig: what to do: pass --python\n"
    )
    advice = Advice(remedy=f"retry with {arg('python_bin')}", items=[])
    print_result(advice, True, str)
    assert '"remedy": "retry with --python"' in capsys.readouterr().out


def test_descriptions_and_excerpts_stay_short() -> None:
    schema = {"properties": {}}
    node = {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 10}, {"type": "null"}]}
    assert describe(schema, node) == "a number greater than 0, at most 10 or null"
    node = {"type": "array", "items": {"type": "string", "maxLength": 9}, "maxItems": 3}
    assert describe(schema, node) == "a list (at most 3 items) of: a string of at most 9 characters"
    assert (
        describe(schema, {"enum": ["vllm", "engine"], "type": "string"})
        == 'one of "vllm", "engine"'
    )
    assert len(excerpt("z" * 10_000_000)) < 100
    assert len(excerpt([["q" * 1000] * 1000] * 1000)) < 100
    assert default_title("verify_gpu_arch") == "Verify GPU arch"


def test_cli_names_flags_and_mcp_names_arguments(run_gpurig) -> None:
    """The same tool error through both front doors (issue 12: each speaks its own words)."""
    out = run_gpurig("doctor", "--need-gib", "-1")
    assert out.returncode == 2
    assert "error: --need-gib must be a positive number of GiB" in out.stderr
    assert "need_gib" not in out.stderr
    out = run_gpurig("gpu", "--python", "/x" * 3000)  # too long: exit 2, no traceback
    assert out.returncode == 2 and "the path given as --python is 6,000 characters" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr) < 600


def test_a_list_given_as_a_json_string_is_bounded_too() -> None:
    """Some clients send a list argument as a JSON string, which the SDK parses: same bounds."""
    mcp = GpurigMCP("json-string-test")

    @mcp.tool()
    def count(paths: list[str]) -> Advice:
        """Counts."""
        return Advice(remedy="", items=[str(len(paths))])

    result, _ = _call(mcp, "count", {"paths": '["a", "b"]'})
    assert not result.is_error and result.structured_content["items"] == ["2"]
    result, _ = _call(mcp, "count", {"paths": "[" + ", ".join(['"a"'] * 65) + "]"})
    assert result.is_error and "65 items; at most 64" in result.content[0].text


def test_a_tool_error_quoting_its_input_is_clipped() -> None:
    mcp = GpurigMCP("clip-test")

    @mcp.tool()
    def echo(text: Annotated[str, Field(max_length=50_000)]) -> Advice:
        """Quotes its whole input in the error, as a careless tool might."""
        raise InvalidInputError(f"cannot use {text}", remedy=f"not {text}")

    result, _ = _call(mcp, "echo", {"text": "w" * 40_000})
    text = result.content[0].text
    assert result.is_error and len(text) < 2100 and "characters left out" in text
    assert "What to do: not www" in text
