"""The server's pure parts: incremental detokenizing, stop strings, request schemas, metrics."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.detokenize import Detokenizer, StopMatcher
from engine.server.metrics import Metrics
from engine.server.schemas import ChatCompletionRequest, CompletionRequest
from engine.textgen import GenerationResult
from engine.tokenizer_synth import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def test_incremental_decoder_never_splits_a_character(tokenizer):
    text = 'Grüße aus 東京 🙂 <|"|> {"a": [1, 2]}\n<|tool_call>done'
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(tokenizer.encode("東", add_special_tokens=False).ids) == 3  # one token per byte
    decoder = Detokenizer(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_can_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("a<turn|>b", add_special_tokens=False).ids
    decoder = Detokenizer(tokenizer, skip_special_tokens=True)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == "ab"


def test_stop_matcher_holds_back_a_split_stop_string():
    m = StopMatcher(["END", "xyz"])
    assert m.push("hello E") == "hello "  # "E" might start "END"
    assert m.push("N") == ""
    assert m.push("Dafter") == ""
    assert m.hit == "END"
    assert m.flush() == ""


def test_stop_matcher_releases_false_alarms_and_picks_the_earliest():
    m = StopMatcher(["END"])
    assert m.push("EN") == ""
    assert m.push("x") == "ENx"
    m2 = StopMatcher(["b", "a"])
    assert m2.push("xxab") == "xx" and m2.hit == "a"
    m3 = StopMatcher([])
    assert m3.push("abc") == "abc" and m3.flush() == ""
    m4 = StopMatcher(["zz"])
    assert m4.push("az") == "a" and m4.flush() == "z"


def test_requests_ignore_unknown_fields_but_refuse_bad_values():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "user": "me",
            "logprobs": False,
        }
    )
    assert req.thinking() is False and req.stop_strings() == []
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"enable_thinking": True},
            "stop": "a",
        }
    )
    assert req.thinking() is True and req.stop_strings() == ["a"]
    for bad in (
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5},
        {"messages": [{"role": "user", "content": "x"}], "n": 2},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).max_tokens == 16
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": {"a": 1}})
    # strict numbers and flags: a bool is no token id or count, a string no number or flag
    for bad in (
        {"prompt": [1, True]},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "temperature": "0.5"},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "echo": 1},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    assert CompletionRequest.model_validate({"prompt": "x", "temperature": 1}).temperature == 1.0


def test_fields_the_server_cannot_honour_are_named_unless_neutral():
    base = {"messages": [{"role": "user", "content": "x"}]}
    neutral = {
        "logit_bias": {},
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "response_format": {"type": "text"},
        "n": 1,
    }
    assert ChatCompletionRequest.model_validate({**base, **neutral}).unsupported_field() is None
    for field, value in (
        ("prompt_logprobs", 1),  # logprobs / top_logprobs are served (test_server_logprobs.py)
        ("presence_penalty", 0.5),
        ("response_format", {"type": "json_object"}),
    ):
        req = ChatCompletionRequest.model_validate({**base, field: value})
        assert req.unsupported_field() == field
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": 3}).unsupported_field() == (
        "best_of"
    )


def test_metrics_prometheus_text_and_json():
    m = Metrics('od"d')
    m.record_request("/v1/completions", 200)
    m.record_request("/v1/completions", 200)
    m.record_request("/v1/completions", 422)
    result = GenerationResult(
        text="t",
        finish_reason="length",
        prompt_tokens=10,
        new_tokens=5,
        time_to_first_token_seconds=0.1,
        prefill_seconds=0.1,
        prefill_tokens_per_s=100.0,
        decode_seconds=0.4,
        decode_tokens=4,
        decode_tokens_per_s=10.0,
    )
    m.record_generation(result, queue_ms=3.0)
    snap = m.snapshot()
    assert snap["requests_total"] == 3 and snap["completion_tokens_total"] == 5
    assert snap["decode_tok_per_s_avg"] == pytest.approx(10.0)
    assert snap["prompt_tok_per_s_avg"] == pytest.approx(100.0)
    text = m.prometheus()
    assert (
        'gpurig_engine_requests_total{model="od\\"d",endpoint="/v1/completions",status="200"} 2'
        in text
    )
    assert 'gpurig_engine_completion_tokens_total{model="od\\"d"} 5' in text
    for line in text.splitlines():  # every sample line is "name{labels} number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_cli_module_is_light_and_refuses_bad_input(run_gpurig, tmp_path):
    import socket
    import subprocess
    import sys

    probe = "import sys, mcp_server.cli_engine_serve; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
        == "False"
    )

    missing = run_gpurig("engine", "serve", "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = run_gpurig("engine", "serve", "--model", str(tmp_path), "--port", str(port))
    assert taken.returncode == 2 and "cannot listen" in taken.stderr and "--port" in taken.stderr
    bad_ctx = run_gpurig("engine", "serve", "--model", str(tmp_path), "--max-ctx", "0")
    assert bad_ctx.returncode == 2 and "--max-context 0" in bad_ctx.stderr  # the alias works

    # a port whose last server just stopped (its connections in TIME_WAIT) is free again, as
    # uvicorn sees it: the run gets past the port check (and stops at the missing config.json)
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end waits in TIME_WAIT
        client.close()
    recent = run_gpurig("engine", "serve", "--model", str(tmp_path), "--port", str(port))
    assert recent.returncode == 2 and "cannot listen" not in recent.stderr
    assert "config.json" in recent.stderr


def test_the_checkpoint_template_decides_about_earlier_reasoning(tokenizer, tmp_path):
    """The chat prompt is what the checkpoint's template makes of the messages as sent:
    reasoning_content of an assistant turn included (Google's template re-shows it inside a
    tool-calling turn), content parts joined, nothing else added."""
    from types import SimpleNamespace

    from engine.interface import EngineFacts
    from engine.server.chat import chat_prompt
    from engine.server.state import ServerState

    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}/{{ m.reasoning_content }}|{% endfor %}"
    )
    facts = EngineFacts(tmp_path, "m", 64, tokenizer.get_vocab_size(), 2, (1,), template, "cpu")
    # what ServerState reads of its engine when it is made (rendering needs no more)
    served = SimpleNamespace(facts=facts, tokenizer=tokenizer, stats=lambda: None)
    state = ServerState(served, "m", ())  # type: ignore[arg-type]
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "c", "reasoning_content": "think"},
            ]
        }
    )
    ids, parse_calls, forced = chat_prompt(state, req)
    assert tokenizer.decode(ids, skip_special_tokens=False) == "user:ab/|assistant:c/think|"
    assert parse_calls is False and forced == ""


def test_sampling_defaults_follow_generation_config(tmp_path):
    import json

    from engine.server.state import sampling_defaults

    assert sampling_defaults(tmp_path) == {"temperature": 0.0}  # no file: greedy
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "top_k": 64, "top_p": 0.95}))
    assert sampling_defaults(tmp_path) == {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_k": None, "top_p": None}
