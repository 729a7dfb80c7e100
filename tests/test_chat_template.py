"""gpurig's Gemma 4 chat template, rendered through engine.chat.render: the exact prompt text
for turns, tools, tool calls and results, and the thinking switch; transformers renders it the
same way; and a reply the model writes in that format parses back into the same call."""

from __future__ import annotations

import json

import pytest

from engine.chat.render import (
    ChatTemplateError,
    bundled_template,
    normalize_messages,
    read_template,
    render_chat,
)
from engine.chat.tool_calls import parse_reply

Q = '<|"|>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def render(messages, tools=None, **kw):
    return render_chat(bundled_template(), messages, tools, **kw)


def test_plain_user_turn_thinking_off():
    assert render([{"role": "user", "content": "Hi"}]) == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_system_and_history_thinking_on():
    out = render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "More"}]},
        ],
        enable_thinking=True,
    )
    assert out == (
        "<bos><|turn>system\n<|think|>Be brief.<turn|>\n"
        "<|turn>user\nHi<turn|>\n<|turn>model\nHello.<turn|>\n"
        "<|turn>user\nMore<turn|>\n<|turn>model\n"
    )


def test_no_generation_prompt():
    out = render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert out == "<bos><|turn>user\nHi<turn|>\n"


def test_tool_declarations_in_the_system_turn():
    out = render([{"role": "user", "content": "Weather?"}], [WEATHER_TOOL])
    assert out.startswith(
        "<bos><|turn>system\n<|tool>declaration:get_weather{"
        f"description:{Q}Current weather for a city{Q},"
        f"parameters:{{type:{Q}object{Q},properties:{{city:{{type:{Q}string{Q}}}}},"
        f"required:[{Q}city{Q}]}}}}<tool|><turn|>\n<|turn>user\nWeather?<turn|>\n"
    )


def test_tool_call_and_result_stay_in_the_model_turn():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.dumps(
                            {
                                "city": "Paris",
                                "days": 2,
                                "metric": True,
                                "extra": None,
                                "l": [1, "a"],
                            }
                        ),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    ]
    out = render(messages, [WEATHER_TOOL])
    assert out.endswith(
        "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2,metric:true,extra:null,"
        f"l:[1,{Q}a{Q}]}}<tool_call|>"
        f"<|tool_response>response:get_weather{{temp_c:21,sky:{Q}clear{Q}}}<tool_response|>"
    )
    # the model continues the same turn: no second "<|turn>model" is opened
    assert out.count("<|turn>model") == 1


def test_plain_text_tool_result_and_final_answer():
    messages = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "now", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c9", "content": "12:00"},
        {"role": "assistant", "content": "It is noon."},
        {"role": "user", "content": "Thanks"},
    ]
    out = render(messages)
    assert (
        "<|turn>model\n<|tool_call>call:now{}<tool_call|>"
        f"<|tool_response>response:now{{value:{Q}12:00{Q}}}<tool_response|>"
        "It is noon.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
    ) in out


def test_call_rendered_by_the_template_parses_back():
    args = {"q": 'say "hi"\nnow', "n": [1, 2.5, {"deep": False}], "z": None}
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "f", "arguments": json.dumps(args)},
                }
            ],
        },
    ]
    out = render(messages, add_generation_prompt=False)
    model_text = out[out.index("<|tool_call>") : out.index("<tool_call|>") + len("<tool_call|>")]
    reply = parse_reply(model_text)
    assert reply.tool_calls[0].name == "f"
    assert json.loads(reply.tool_calls[0].arguments) == args


def test_normalize_messages_fills_tool_names_and_parses_arguments():
    msgs = normalize_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "k",
                        "type": "function",
                        "function": {"name": "g", "arguments": '{"a":1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "k", "content": "not json"},
        ]
    )
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[1]["name"] == "g" and msgs[1]["content"] == "not json"


def test_read_template_prefers_jinja_then_tokenizer_config(tmp_path):
    assert read_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    assert read_template(tmp_path) is None  # as if it named none: the bundled one serves
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ]
            }
        )
    )
    assert read_template(tmp_path) == "D"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert read_template(tmp_path) == "P"  # a processor's save comes before the tokenizer's
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_template(tmp_path) == "J"


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="nope"):
        render_chat("{{ raise_exception('nope') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{% for %}", [])


def test_transformers_renders_the_template_identically():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, "x"))
    )
    tok.chat_template = bundled_template()
    messages = normalize_messages(
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": '{"t": 3}'},
        ]
    )
    for thinking in (False, True):
        ours = render(messages, [WEATHER_TOOL], enable_thinking=thinking)
        theirs = tok.apply_chat_template(
            messages,
            tools=[WEATHER_TOOL],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
            bos_token="<bos>",
        )
        assert theirs == ours


# The tool-result dispatch of Google's published Gemma 4 template, in our own words: a string
# is the result, a list holds text parts. (A mapping would be iterated as a list and fail.)
TOOL_BODY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if m.content is string -%}tool:{{ m.content }}"
    "{%- elif m.content is sequence -%}{%- for p in m.content -%}{{ p.get('text') }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}{{ tc.function.name }}{{ tc.function.arguments | dictsort }}"
    "{%- endfor -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}|"
    "{%- endfor -%}"
)


def test_a_checkpoint_template_gets_tool_results_as_sent():
    """A JSON tool result reaches the checkpoint's template as the string the client sent (as
    transformers and vLLM pass it), while our own template still sees the parsed object."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 3}'},
    ]
    out = render_chat(TOOL_BODY_TEMPLATE, messages)
    assert out == "Weather?|get_weather[('city', 'Oslo')]|tool:{\"t\": 3}|"
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    as_vllm_sends = json.loads(json.dumps(messages))
    as_vllm_sends[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    theirs, _ = render_jinja_template(
        conversations=[as_vllm_sends], chat_template=TOOL_BODY_TEMPLATE
    )
    assert theirs[0] == out
    assert "response:get_weather{t:3}<tool_response|>" in render(messages)
