"""Each front-door parameter is declared once, in the request model (issue 51, item 4).

For bring_up, start_vllm_server, run_sweep and evaluate: the MCP tool's inputSchema, as a real
in-memory client session lists it, holds exactly the model's fields with the same types,
defaults, limits and descriptions (the plumbing's hardening aside); the CLI parser's flags map
one-to-one onto those fields (every field reachable from the command line or listed as MCP-only
with a reason; no flag without a field but the declared presentation ones); and a bad value is
refused in plain words at both doors, naming the argument (MCP) or the flag (CLI, exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from pydantic import BaseModel

from bench.eval.models import EvalArguments
from bench.sweep.models import SweepRequest
from mcp_server import (
    cli_eval,
    cli_serve,
    cli_sweep,
    cli_up,
    mcp_eval,
    mcp_serve,
    mcp_sweep,
    mcp_up,
)
from mcp_server.mcp_base import GpurigMCP
from mcp_server.mcp_errors import harden_schema
from mcp_server.request_flags import Door, Flag, add_flags, build, door_flags, option_strings
from tools.bring_up_models import BringUpRequest
from tools.errors import InvalidInputError
from tools.serving.models import StartRequest

# tool -> (its request model, the CLI door, the (sub)command path of its parser)
TOOLS: dict[str, tuple[type[BaseModel], Door, tuple[str, ...]]] = {
    "bring_up": (BringUpRequest, cli_up.UP, ("up",)),
    "start_vllm_server": (StartRequest, cli_serve.START, ("serve", "start")),
    "run_sweep": (SweepRequest, cli_sweep.SWEEP, ("sweep", "run")),
    "evaluate": (EvalArguments, cli_eval.EVAL, ("eval",)),
}


def _server() -> GpurigMCP:
    server = GpurigMCP("front-door-test")
    for module in (mcp_up, mcp_serve, mcp_sweep, mcp_eval):
        module.register(server)
    return server


async def _session(calls: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """The tools as listed, and the error text of each call in `calls`."""
    async with Client(_server()) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        errors = {}
        for name, arguments in calls.items():
            result = await client.call_tool(name, arguments)
            assert result.is_error, (name, result)
            errors[name] = " ".join(getattr(b, "text", "") for b in result.content)
    return listed, errors


BAD_CALLS = {
    "bring_up": {"model": "ckpt", "port": 0},
    "start_vllm_server": {"model": "ckpt", "gpu_memory_utilization": 1.5},
    "run_sweep": {"targets": [{"label": "a", "base_url": "http://x/v1"}], "repeats": 0},
    "evaluate": {"a": "http://127.0.0.1:1", "concurrency": 0},
}


@pytest.fixture(scope="module")
def session() -> tuple[dict[str, Any], dict[str, str]]:
    return asyncio.run(asyncio.wait_for(_session(BAD_CALLS), timeout=60))


def _parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    """The (sub)parser of one command, registered as `gpurig` registers it."""
    root = argparse.ArgumentParser(prog="gpurig")
    sub = root.add_subparsers()
    for module in (cli_up, cli_serve, cli_sweep, cli_eval):
        module.register(sub)
    parser = sub.choices[path[0]]
    for name in path[1:]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("tool", list(TOOLS))
def test_the_mcp_schema_is_the_models(tool: str, session) -> None:
    model, _door, _path = TOOLS[tool]
    listed, _errors = session
    schema = listed[tool].input_schema
    expected = harden_schema(copy.deepcopy(model.model_json_schema()))
    assert list(schema["properties"]) == list(model.model_fields)  # flat, in the model's order
    assert schema["properties"] == expected["properties"]  # types, defaults, limits, words
    assert sorted(schema.get("required", [])) == sorted(expected.get("required", []))
    assert schema.get("$defs", {}) == expected.get("$defs", {})
    assert schema["additionalProperties"] is False


def test_the_schemas_carry_the_declared_limits(session) -> None:
    """A few limits read straight from the wire: a regression in the generation shows here."""
    listed, _ = session
    up = listed["bring_up"].input_schema["properties"]
    assert (
        up["port"]["minimum"] == 1
        and up["port"]["maximum"] == 65535
        and up["port"]["default"] == 8000
    )
    assert up["model"]["minLength"] == 1 and "model" in listed["bring_up"].input_schema["required"]
    assert up["sweep_prompts"] == {**up["sweep_prompts"], "minimum": 1, "maximum": 256}
    start = listed["start_vllm_server"].input_schema["properties"]
    assert start["gpu_layers"]["anyOf"][0]["minimum"] == 0
    assert start["wait"]["default"] is True
    sweep = listed["run_sweep"].input_schema["properties"]
    assert sweep["input_lens"]["default"] == [512, 4096]
    assert sweep["search"]["anyOf"][0]["$ref"] == "#/$defs/SearchSpec"
    ev = listed["evaluate"].input_schema["properties"]
    assert ev["a_name"]["anyOf"][0]["maxLength"] == 64 and ev["concurrency"]["maximum"] == 256


@pytest.mark.parametrize("tool", list(TOOLS))
def test_the_cli_flags_map_onto_the_fields(tool: str) -> None:
    model, door, path = TOOLS[tool]
    by_field = door_flags(door)
    # every field reachable from the command line, or MCP-only with a reason
    assert set(by_field) | set(door.mcp_only) == set(model.model_fields)
    assert all(why.strip() for why in door.mcp_only.values())
    assert not set(door.flags) - set(model.model_fields)  # no override for a field that is gone
    # no flag without a field, but the declared presentation ones
    parser = _parser(path)
    declared = {f for flags in by_field.values() for f in flags}
    assert option_strings(parser) == declared | set(door.cli_only)
    # one-to-one: a flag sets one field, but a declared spread (eval's URL_A [URL_B] -> a, b)
    spread = {f for n in by_field if door.spread_of(n) and door.spread_of(n)[0] != n
              for f in by_field[n]}  # fmt: skip
    seen = [f for n, flags in by_field.items() for f in flags if not (
        f in spread and door.spread_of(n) and door.spread_of(n)[0] != n)]  # fmt: skip
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_the_cli_defaults_are_the_models(tool: str) -> None:
    """Nothing but the positional model (or URL) given: the request is the model's defaults."""
    model, door, path = TOOLS[tool]
    argv = {"bring_up": ["ckpt"], "start_vllm_server": ["ckpt"], "run_sweep": [],
            "evaluate": ["http://x:1"]}[tool]  # fmt: skip
    args = _parser(path).parse_args(argv)
    given = {"bring_up": {"model": "ckpt"}, "start_vllm_server": {"model": "ckpt"},
             "run_sweep": {"targets": []}, "evaluate": {"a": "http://x:1"}}[tool]  # fmt: skip
    assert build(door, args) == model(**given)


def test_the_cli_presentation_turns_into_the_fields() -> None:
    args = _parser(("up",)).parse_args(
        ["ckpt", "-tp", "2", "--python", "/usr/bin/python3", "--timeout", "5", "--no-patch",
         "--no-builtin-checks", "--check", "2+2?=>4", "--env", "A=1", "--extra-args", "--seed 0"]
    )  # fmt: skip
    request = build(cli_up.UP, args)
    assert request.tensor_parallel_size == 2 and request.python_bin == "/usr/bin/python3"
    assert request.timeout_s == 5 and not request.apply_patch and not request.builtin_checks
    assert [c.model_dump() for c in request.checks] == [{"prompt": "2+2?", "expect": "4"}]
    assert request.env == {"A": "1"} and request.extra_args == ["--seed", "0"]
    args = _parser(("sweep", "run")).parse_args(
        ["--target", "a=http://x/v1", "--slo", "ttft_p99_ms=500", "--search", "rate",
         "--search-max", "64", "--prefix-len", "16", "--detach", "--out", "/tmp/s"]
    )  # fmt: skip
    sweep = build(cli_sweep.SWEEP, args).arguments()
    assert sweep["search"] == {"axis": "rate", "max": 64.0} and sweep["workload"] == {
        "prefix_len": 16
    }
    assert (
        sweep["wait"] is False
        and sweep["out_dir"] == "/tmp/s"
        and sweep["slo"] == {"ttft_p99_ms": 500.0}
    )
    args = _parser(("eval",)).parse_args(["http://x:1", "http://y:2", "--name-b", "bb",
                                          "--suite", "recall"])  # fmt: skip
    request = build(cli_eval.EVAL, args).request()
    assert [s.base_url for s in request.servers] == ["http://x:1/v1", "http://y:2/v1"]
    assert request.servers[1].name == "bb" and request.suite == "recall"


@pytest.mark.parametrize(
    ("path", "argv", "words"),
    [
        (("up",), ["ckpt", "--port", "0"], "--port: Input should be greater than or equal to 1"),
        (("serve", "start"), ["ckpt", "--gpu-layers", "-1"], "--gpu-layers: Input should be"),
        (("sweep", "run"), ["--target", "a=http://x/v1", "--search-max", "0"], "--search-max:"),
        (("sweep", "run"), ["--target", "a=ftp://x/v1"], "must start with http"),
        (("eval",), ["http://x:1", "--name-a", "no spaces"], "--name-a: String should match"),
    ],
)
def test_the_cli_refuses_naming_the_flag(path, argv, words) -> None:
    door = {("up",): cli_up.UP, ("serve", "start"): cli_serve.START,
            ("sweep", "run"): cli_sweep.SWEEP, ("eval",): cli_eval.EVAL}[path]  # fmt: skip
    with pytest.raises(InvalidInputError) as err:
        build(door, _parser(path).parse_args(argv))
    assert words in err.value.message and err.value.remedy


def test_the_mcp_tools_refuse_in_plain_words(session) -> None:
    _listed, errors = session
    assert "argument port (given: 0)" in errors["bring_up"]
    assert "Accepted: a whole number at least 1, at most 65535" in errors["bring_up"]
    assert "argument gpu_memory_utilization (given: 1.5)" in errors["start_vllm_server"]
    assert "argument repeats (given: 0)" in errors["run_sweep"]
    assert "argument concurrency (given: 0)" in errors["evaluate"]
    for text in errors.values():
        assert "errors.pydantic.dev" not in text and "input_value" not in text


def test_the_generator_refuses_what_it_cannot_show() -> None:
    """A field whose annotation the rule cannot turn into a flag is refused when the parser is
    built (not when a user runs the command), and so is an on-by-default switch with no --no-."""

    class Odd(BaseModel):
        mapping: dict[str, int] = {}

    class On(BaseModel):
        fast: bool = True

    with pytest.raises(TypeError, match="mapping"):
        add_flags(argparse.ArgumentParser(), Door(Odd))
    with pytest.raises(TypeError, match="fast"):
        add_flags(argparse.ArgumentParser(), Door(On))
    parser = argparse.ArgumentParser()
    add_flags(parser, Door(On, flags={"fast": Flag(names=("--slow",), invert=True)}))
    assert parser.parse_args(["--slow"]).fast is False


def test_the_model_validators_still_run_at_the_mcp_door(tmp_path: Path) -> None:
    """The SDK validates the fields; the request built from them runs the model's own checks
    (a dataset workload with shared prefixes), refused in words naming the argument."""

    async def call() -> str:
        async with Client(_server()) as client:
            result = await client.call_tool(
                "run_sweep",
                {"targets": [{"label": "a", "base_url": "http://x/v1"}],
                 "workload": {"dataset": str(tmp_path / "none.jsonl")}},
            )  # fmt: skip
            assert result.is_error
            return " ".join(getattr(b, "text", "") for b in result.content)

    text = asyncio.run(asyncio.wait_for(call(), timeout=30))
    assert "argument workload" in text and "is not a file" in text
