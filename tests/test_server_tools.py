"""A tool-call round trip through the live server with the official `openai` client.

The checkpoint is real (tiny, W4A16) but scripted (tests/server_support.py): its greedy decode
writes a Gemma 4 tool call after the generation prompt, and a final answer right after a tool
response. So the model really emits `<|tool_call>call:get_weather{...}<tool_call|>`, the server
really parses it into `tool_calls`, and the answer only comes back if the template rendered the
client's tool result so that the prompt ends in `<tool_response|>`.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_support import ServerProcess, make_scripted_checkpoint

from engine.chat.render import encode_prompt, read_template, render_chat
from engine.tokenizer_synth import build_tokenizer

MODEL = "scripted"
CALL_ARGS = {"city": "Paris", "days": 2, "metric": True}
ANSWER = "It is 21 C and clear in Paris."
THOUGHT = "The user wants the weather."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    }
]
USER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted") / MODEL
    newline = build_tokenizer(512).encode("\n").ids[0]
    make_scripted_checkpoint(
        path,
        [
            # after "<channel|>" (the end of a thinking-off generation prompt): the call
            [101, 48, "call:get_weather{city:", 52, 'Paris<|"|>,days:2,metric:true}', 49, 50],
            # after "<tool_response|>": the answer, then "<turn|>"
            [51, ANSWER, 106],
            # after "<|turn>model\n" (thinking on): a thought, then the same call
            [newline, 100, "thought\n" + THOUGHT, 101],
        ],
    )
    return path


@pytest.fixture(scope="module")
def client(checkpoint):
    server = ServerProcess(checkpoint)
    yield openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)
    server.stop()


def test_tool_call_round_trip(client, checkpoint):
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=32)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS
    assert first.usage.completion_tokens == 5  # <|tool_call> name-part <|"|> rest <tool_call|>

    messages = [
        *USER,
        choice.message.model_dump(exclude_none=True),  # the assistant turn, as clients send it back
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temp_c": 21, "sky": "clear"}),
        },
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=32
    )
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    # the prompt the server built is exactly the template's rendering of the conversation
    tokenizer = build_tokenizer(512)
    prompt = render_chat(read_template(checkpoint), messages, TOOLS)
    assert prompt.endswith(
        '<|tool_response>response:get_weather{temp_c:21,sky:<|"|>clear<|"|>}<tool_response|>'
    )
    assert second.usage.prompt_tokens == len(encode_prompt(tokenizer, prompt))


def test_streamed_tool_call(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=TOOLS,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == CALL_ARGS
    assert not "".join(d.content or "" for d in deltas)  # no marker text leaks into content
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == 5


def test_thinking_goes_to_reasoning_content(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        max_tokens=32,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = resp.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == CALL_ARGS
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        max_tokens=32,
        stream=True,
        extra_body={"enable_thinking": True},
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert not "".join(d.content or "" for d in deltas)


def test_without_tools_the_call_text_is_plain_content(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=32
    )
    message = resp.choices[0].message
    assert not message.tool_calls and resp.choices[0].finish_reason == "stop"
    assert message.content.startswith("<|tool_call>call:get_weather{")


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_or_named_tool_choice_starts_the_reply_inside_a_call(client, choice):
    """The prompt is made to end with `<|tool_call>` (one more prompt token, one fewer made),
    and the reply parser is fed that marker first, so the call still comes back whole."""
    free = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=32)
    forced = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=32
    )
    assert forced.usage.prompt_tokens == free.usage.prompt_tokens + 1
    assert forced.usage.completion_tokens == free.usage.completion_tokens - 1
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.content is None
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGS
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=32, stream=True
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [json.loads(c.function.arguments) for c in calls] == [CALL_ARGS]
    assert not "".join(d.content or "" for d in deltas)
    with pytest.raises(openai.BadRequestError):  # nothing to call
        client.chat.completions.create(model=MODEL, messages=USER, tool_choice="required")
