"""The Gemma 4 reply parser on real-format strings: calls, thinking, malformed input, and the
streaming parser agreeing with the one-shot parser however the text is chunked."""

from __future__ import annotations

import json
import random

import pytest

from engine.chat.tool_calls import (
    StreamingReplyParser,
    ToolCallSyntaxError,
    parse_call,
    parse_reply,
    parse_value,
)

Q = '<|"|>'


def call(body: str) -> str:
    return f"<|tool_call>{body}<tool_call|>"


def args_of(text: str) -> list[tuple[str, object]]:
    reply = parse_reply(text)
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def test_simple_call_is_openai_shaped():
    reply = parse_reply(call(f"call:get_weather{{city:{Q}Paris{Q}}}"))
    assert reply.content is None
    assert len(reply.tool_calls) == 1
    tc = reply.tool_calls[0].to_openai()
    assert tc["type"] == "function"
    assert tc["id"].startswith("call_") and len(tc["id"]) > 10
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}


def test_nested_objects_arrays_numbers_booleans_null():
    body = (
        f"call:plan{{trip:{{from:{Q}Oslo{Q},to:{Q}Rome{Q},legs:[1,2,3]}},"
        f"budget:1250.5,neg:-3,exp:1e3,ok:true,late:false,note:null,"
        f"tags:[{Q}a{Q},{Q}b{Q},[]],empty:{{}}}}"
    )
    assert args_of(call(body)) == [
        (
            "plan",
            {
                "trip": {"from": "Oslo", "to": "Rome", "legs": [1, 2, 3]},
                "budget": 1250.5,
                "neg": -3,
                "exp": 1000.0,
                "ok": True,
                "late": False,
                "note": None,
                "tags": ["a", "b", []],
                "empty": {},
            },
        )
    ]


def test_strings_keep_quotes_braces_commas_and_newlines():
    text = 'He said "hi", {not: an object}\nline two\t[x]'
    out = args_of(call(f"call:note{{text:{Q}{text}{Q}}}"))
    assert out == [("note", {"text": text})]
    # and the JSON string the client gets escapes them correctly
    raw = parse_reply(call(f"call:note{{text:{Q}{text}{Q}}}")).tool_calls[0].arguments
    assert '\\"hi\\"' in raw and "\\n" in raw


def test_unicode_survives_unescaped():
    reply = parse_reply(call(f"call:say{{w:{Q}Grüße 東京{Q}}}"))
    assert "Grüße 東京" in reply.tool_calls[0].arguments


def test_several_calls_in_one_reply_with_text_around():
    text = (
        "Let me check both.\n"
        + call(f"call:get_weather{{city:{Q}Paris{Q}}}")
        + call(f"call:get_time{{tz:{Q}Europe/Paris{Q},h24:true}}")
    )
    reply = parse_reply(text)
    assert reply.content == "Let me check both."
    assert [c.name for c in reply.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(reply.tool_calls[1].arguments) == {"tz": "Europe/Paris", "h24": True}
    assert reply.tool_calls[0].id != reply.tool_calls[1].id


def test_whitespace_between_tokens_is_tolerated():
    assert args_of(call(f"call:f{{ a : 1 , b : [ 2 , {Q}x{Q} ] }}")) == [
        ("f", {"a": 1, "b": [2, "x"]})
    ]


@pytest.mark.parametrize(
    "bad",
    [
        f"call:f{{city:{Q}Paris}}",  # unterminated string
        "call:f{a:1",  # unbalanced
        "f{a:1}",  # no call: prefix
        "call:{a:1}",  # no name
        "call:f(a=1)",  # not an object
        "call:f{a:1}} extra",  # trailing text
        "call:f{:1}",  # empty key
        "",
    ],
)
def test_malformed_call_comes_back_as_text(bad):
    text = "before " + call(bad) + " after"
    reply = parse_reply(text)
    assert reply.tool_calls == []
    assert reply.content == text  # exactly what the model wrote


def test_malformed_and_good_calls_mixed():
    text = call("call:broken{a:") + call("call:ok{a:1}")
    reply = parse_reply(text)
    assert [c.name for c in reply.tool_calls] == ["ok"]
    assert reply.content == call("call:broken{a:")


def test_unterminated_call_at_end_is_text():
    text = "x " + "<|tool_call>call:f{a:"
    reply = parse_reply(text)
    assert reply.tool_calls == [] and reply.content == text


def test_parse_call_errors_are_typed():
    with pytest.raises(ToolCallSyntaxError):
        parse_call("call:f{a:[1,2}")
    assert parse_value("[true,false,null]") == [True, False, None]


def test_thinking_goes_to_reasoning_not_content():
    text = "<|channel>thought\nThe user wants weather.\nUse the tool.<channel|>It is sunny."
    reply = parse_reply(text)
    assert reply.reasoning_content == "The user wants weather.\nUse the tool."
    assert reply.content == "It is sunny."
    assert "thought" not in reply.content and "<|channel>" not in reply.content


def test_empty_thinking_and_thinking_before_a_call():
    reply = parse_reply("<|channel>thought\n<channel|>Hello")
    assert reply.reasoning_content is None and reply.content == "Hello"
    reply = parse_reply("<|channel>thought\nneed data<channel|>" + call("call:f{q:2}"))
    assert reply.reasoning_content == "need data"
    assert reply.content is None and reply.tool_calls[0].name == "f"


def test_unterminated_thinking_is_all_reasoning():
    reply = parse_reply("<|channel>thought\nstill thinking when cut off")
    assert reply.content is None
    assert reply.reasoning_content == "still thinking when cut off"


def test_plain_text_untouched():
    assert parse_reply('Just text, {a:1} <|"|> odd').content == 'Just text, {a:1} <|"|> odd'


def _stream(text: str, cuts: list[int]):
    parser = StreamingReplyParser()
    events = []
    prev = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    events += parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    calls = [(e.call.name, json.loads(e.call.arguments)) for e in events if e.kind == "tool_call"]
    return content or None, reasoning or None, calls


STREAM_CASES = [
    "plain text with < and <| and <tool_call| bits",
    "<|channel>thought\nhmm, think\n<channel|>Answer here.",
    "Sure." + call(f"call:get_weather{{city:{Q}Pa}}ris{Q},n:[1,{{x:null}}]}}") + call("call:g{}"),
    "a " + call("call:broken{") + " b",
    "<|channel>thought\ncut off <|tool_call> inside",
    "ends with a bare marker <|tool_call>",
]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streaming_parser_matches_one_shot_for_any_chunking(text):
    whole = parse_reply(text)
    expected = (
        whole.content,
        whole.reasoning_content,
        [(c.name, json.loads(c.arguments)) for c in whole.tool_calls],
    )
    rng = random.Random(7)
    chunkings = [[], list(range(1, len(text)))]  # one piece, one character at a time
    for _ in range(30):
        chunkings.append(sorted(rng.sample(range(1, len(text)), k=min(5, len(text) - 1))))
    for cuts in chunkings:
        got = _stream(text, cuts)
        # streamed content may keep inner whitespace the one-shot parser strips around calls
        assert (got[0] or "").strip() == (expected[0] or "").strip(), cuts
        assert got[1:] == expected[1:], cuts


def test_calls_left_as_text_when_no_tools_were_offered():
    text = "<|channel>thought\nx<channel|>" + call("call:f{a:1}")
    reply = parse_reply(text, parse_calls=False)
    assert reply.tool_calls == [] and reply.content == call("call:f{a:1}")
    parser = StreamingReplyParser(parse_calls=False)
    events = parser.feed(text) + parser.finish()
    assert "".join(e.text for e in events if e.kind == "content") == call("call:f{a:1}")
    assert not [e for e in events if e.kind == "tool_call"]
