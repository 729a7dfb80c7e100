"""A bounded fuzz of the live engine server: a few hundred requests built by hypothesis over the
request models' fields (sampling values from the ordinary to the absurd, stop strings, messages
with tool calls and tool results, tools, prompts as text and as token ids, odd Unicode including
lone surrogates, raw bytes), each sent with httpx to `gpurig engine serve` on loopback.

What must hold for every one: no 5xx, an answer within the timeout (no hang), an error in
OpenAI's shape for every refusal, and a stream that ends with [DONE] and carries no server error.
The server caps every generation at 4 tokens (--max-tokens-limit), so the run stays short; the
examples are derandomised, so CI sees the same few hundred requests every time.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import ServerProcess

from engine.checkpoint_maker import make_checkpoint

pytestmark = pytest.mark.slow
MODEL = "tiny-fuzz"
TIMEOUT = 30.0

ODD = [
    "", "\x00", "\ud800", "\udfff", "\ud83d\ude00", "\ufeff", "\u202e", "\uffff", "<bos>",
    "<|tool_call>", "<tool_call|>", "<turn|>", "<|turn>model\n", "<|channel>", '<|"|>', "{",
    "}", "\\", "\n", "🙂" * 40, "a" * 5000, "call:f{x:1}", "null",
]  # fmt: skip
text = st.one_of(
    st.text(max_size=30),
    st.text(st.characters(codec=None, categories=None), max_size=8),  # surrogates too
    st.sampled_from(ODD),
)
anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)
    ),  # fmt: skip
    max_leaves=8,
)
deep = st.integers(1, 1200).map(lambda n: '{"a": ' * n + "1" + "}" * n)


UNICODE_OK = [o for o in ODD if not any(0xD800 <= ord(c) <= 0xDFFF for c in o)]
clean = st.one_of(st.text(max_size=30), st.sampled_from(UNICODE_OK))


def families(wild: bool) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(chat, completion) requests. Tame ones hold only legal values, extreme ones included
    (temperature 1e-40, top_k 2**64, 5,000 tokens asked), so most reach the engine; wild ones
    put any JSON anywhere, so most are refused: both must end without a 5xx."""

    def field(good: st.SearchStrategy, bad: st.SearchStrategy = anything) -> st.SearchStrategy:
        return st.one_of(st.none(), good, bad) if wild else st.one_of(st.none(), st.none(), good)

    words = text if wild else clean
    sampling = {
        "temperature": field(
            st.one_of(
                st.floats(0, 2), st.sampled_from([1e-40, 1e-38, 5e-324, 1e-5, 0.0, 2.0, -0.0])
            )
        ),
        "top_p": field(st.floats(0, 1, exclude_min=True)),
        "top_k": field(st.integers(1, 2**64)),
        "seed": field(st.integers(-(2**63), 2**64 - 1)),
        "max_tokens": field(st.integers(1, 5000)),
        "stop": field(st.one_of(words, st.lists(words, max_size=16))),
        "stream": field(st.booleans()),
        "ignore_eos": field(st.booleans()),
        "logit_bias": field(
            st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=4)
        ),
        "n": field(st.just(1)),
        "model": field(st.just(MODEL), st.sampled_from(["other", ""])),
    }
    if wild:
        sampling |= {
            "logprobs": field(st.booleans()),
            "presence_penalty": field(st.floats(-2, 2)),
            "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
        }
    call = st.fixed_dictionaries(
        {
            "id": field(st.sampled_from(["c1", "c2"])),
            "type": st.sampled_from(["function", "function", "other"] if wild else ["function"]),
            "function": st.fixed_dictionaries(
                {
                    "name": words,
                    "arguments": st.one_of(
                        words, deep, st.dictionaries(words, anything, max_size=3)
                    ),
                }
            ),
        }
    )
    parts = st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"] if wild else ["text"]), "text": words}
        ),
        max_size=3,
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(
                ["system", "developer", "user", "assistant", "tool"] + (["x"] if wild else [])
            ),
            "content": st.one_of(words, deep, parts, st.none()),
            "tool_calls": field(st.lists(call, max_size=2)),
            "tool_call_id": field(st.sampled_from(["c1", "c2", "zz"])),
            "reasoning_content": field(words),
            "name": field(words),
        }
    )
    tool = st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "function", "web"] if wild else ["function"]),
            "function": st.fixed_dictionaries(
                {
                    "name": st.text(min_size=1, max_size=10),
                    "description": field(words),
                    "parameters": field(st.dictionaries(words, anything, max_size=3)),
                }
            ),
        }
    )
    chat = st.fixed_dictionaries(
        {
            **sampling,
            "messages": st.one_of(
                st.lists(message, min_size=1, max_size=4), *([anything] if wild else [])
            ),
            "tools": field(st.lists(tool, max_size=3)),
            "tool_choice": field(
                st.one_of(
                    st.sampled_from(["none", "auto", "required"]),
                    st.fixed_dictionaries(
                        {
                            "type": st.just("function"),
                            "function": st.fixed_dictionaries({"name": words}),
                        }
                    ),
                )
            ),
            "max_completion_tokens": field(st.integers(1, 100)),
            "chat_template_kwargs": field(
                st.fixed_dictionaries({"enable_thinking": st.booleans()})
            ),
        }
    )
    completion = st.fixed_dictionaries(
        {
            **sampling,
            "prompt": st.one_of(
                words,
                st.lists(
                    st.integers(-3 if wild else 0, 600 if wild else 511), min_size=1, max_size=30
                ),
                st.lists(words, min_size=1, max_size=2 if wild else 1),
                st.lists(
                    st.lists(st.integers(0, 511), min_size=1, max_size=10),
                    min_size=1,
                    max_size=2 if wild else 1,
                ),
                st.lists(st.integers(0, 511), min_size=4090, max_size=4100),
                *([anything] if wild else []),
            ),
            "echo": field(st.booleans()),
        }
    )
    return chat, completion


TAME, WILD = families(wild=False), families(wild=True)
request = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), TAME[0]),
    st.tuples(st.just("/v1/completions"), TAME[1]),
    st.tuples(st.just("/v1/chat/completions"), WILD[0]),
    st.tuples(st.just("/v1/completions"), WILD[1]),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), anything),
)  # fmt: skip


def _body(fields: object) -> bytes:
    if isinstance(fields, dict):
        fields = {k: v for k, v in fields.items() if v is not None or k == "content"}
    # ensure_ascii writes lone surrogates as \ud800 escapes, as a JavaScript client would
    return json.dumps(fields, ensure_ascii=True).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / MODEL
    make_checkpoint(path, preset="tiny", seed=0)
    proc = ServerProcess(path, "--max-tokens-limit", "4")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        yield client


def _check(resp: httpx.Response, body: bytes, streamed: list[str] | None) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:300], body[:300])
    if resp.status_code >= 400:
        err = json.loads(resp.text)
        assert set(err) == {"error"} and err["error"]["message"], resp.text[:300]
        assert "Traceback" not in err["error"]["message"]
    elif streamed is not None:
        assert streamed and streamed[-1] == "data: [DONE]", (streamed[-3:], body[:300])
        for line in streamed[:-1]:
            payload = json.loads(line[6:])
            assert "error" not in payload, (payload, body[:300])


def _send(http: httpx.Client, path: str, body: bytes) -> None:
    started = time.monotonic()
    headers = {"content-type": "application/json"}
    with http.stream("POST", path, content=body, headers=headers) as resp:
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            streamed = [line for line in resp.iter_lines() if line]
            _check(resp, body, streamed)
        else:
            resp.read()
            _check(resp, body, None)
    assert time.monotonic() - started < TIMEOUT


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],  # fmt: skip
)
@given(request)
def test_fuzzed_requests_never_get_a_5xx_or_hang(http, req):
    path, fields = req
    _send(http, path, _body(fields))


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=200), st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bytes_are_refused_cleanly(http, raw, path):
    _send(http, path, raw)


# Byte-level damage to valid bodies: what a broken client, a proxy or a wrong codec sends. The
# UTF-8 encodings of surrogates (ED A0 80 .. ED BF BF) and overlong forms (C0 AF, E0 80 AF, F0 80
# 80 AF) are what `json.loads(bytes)` would let through ("surrogatepass") or mis-decode.
SURROGATE_BYTES = [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80"]
OVERLONG = [b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xc0\x80"]
EVIL = [*SURROGATE_BYTES, *OVERLONG, b"\xff", b"\xfe", b"\x80", b"\xf8\x88\x80\x80\x80"]
CODECS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"]


def _valid_body(fields: object) -> bytes:
    if isinstance(fields, dict):
        fields = {k: v for k, v in fields.items() if v is not None or k == "content"}
    # raw UTF-8 in the body (not \u escapes), lone surrogates excepted: they have no UTF-8
    text = json.dumps(fields, ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace")


@st.composite
def damaged(draw) -> tuple[str, bytes]:
    """A valid tame request with one kind of byte damage."""
    path, fields = draw(
        st.one_of(
            st.tuples(st.just("/v1/chat/completions"), TAME[0]),
            st.tuples(st.just("/v1/completions"), TAME[1]),
        )
    )
    body = _valid_body(fields)
    kind = draw(st.sampled_from(["evil", "evil", "evil", "random", "cut", "codec", "bom"]))
    if kind == "codec":  # the whole body in another encoding
        return path, body.decode("utf-8").encode(draw(st.sampled_from(CODECS)))
    if kind == "bom":  # a UTF-8 BOM before the body, or a UTF-16 one before UTF-8
        return path, draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"])) + body
    if kind == "cut":
        return path, body[: draw(st.integers(0, max(0, len(body) - 1)))]
    junk = (
        draw(st.sampled_from(EVIL)) if kind == "evil" else draw(st.binary(min_size=1, max_size=6))
    )
    strings = _count_strings(fields)
    if not strings or draw(st.integers(0, 5)) == 0:  # anywhere: after one of the quote marks
        quotes = [i + 1 for i, b in enumerate(body) if b == 0x22] or [len(body)]
        at = draw(st.sampled_from(quotes))
        return path, body[:at] + junk + body[at:]
    # inside one of its keys or string values (a text prompt, a message, a stop string, ...)
    marked = _mark(fields, draw(st.integers(0, strings - 1)))
    return path, _valid_body(marked).replace(MARK.encode(), junk, 1)


MARK = "\u2063GPURIG-MARK\u2063"


def _count_strings(value: object) -> int:
    if isinstance(value, dict):
        return sum(1 + _count_strings(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_strings(v) for v in value)
    return int(isinstance(value, str))


def _mark(value: object, target: int) -> object:
    """`value` with MARK put before its target-th string (keys and values, in walk order)."""
    seen = -1

    def walk(v: object) -> object:
        nonlocal seen
        if isinstance(v, dict):
            out = {}
            for k, inner in v.items():
                seen += 1
                key = MARK + k if seen == target else k
                out[key] = walk(inner)
            return out
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            seen += 1
            return MARK + v if seen == target else v
        return v

    return walk(value)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(damaged())
def test_byte_damaged_bodies_never_get_a_5xx_or_hang(http, req):
    path, body = req
    _send(http, path, body)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["value", "key"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("evil", SURROGATE_BYTES + OVERLONG, ids=lambda b: b.hex())
def test_raw_invalid_utf8_is_a_400_naming_the_bytes(http, path, where, stream, evil):
    """The reported case: `{"prompt": "hi\xed\xa0\x80", "stream": true}` answered 500
    (UnicodeEncodeError in the tokenizer); raw bytes that are not UTF-8 are refused up front."""
    content = b'"hi' + evil + b'"'
    if path == "/v1/completions":
        text = b'"prompt": ' + (content if where == "value" else b'"hi"')
    else:
        text = (
            b'"messages": [{"role": "user", "content": '
            + (content if where == "value" else b'"hi"')
            + b"}]"
        )
    extra = b', "x' + evil + b'": 1' if where == "key" else b""
    body = (
        b"{" + text + b', "max_tokens": 4, "stream": ' + str(stream).lower().encode() + extra + b"}"
    )
    resp = http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert err["code"] == "invalid_encoding" and "not valid UTF-8" in err["message"], err
    assert evil[:1].hex() in err["message"]


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_body_in_another_encoding_is_a_400(http, codec):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode(codec)
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_encoding"


def test_a_utf8_bom_is_skipped(http):
    body = b"\xef\xbb\xbf" + json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text[:300]


def test_the_server_is_idle_and_healthy_afterwards(server, http):
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["queue_waiting"] == 0
    snap = server.metrics()
    assert not any(r["status"] >= 500 for r in snap["requests"]), snap["requests"]
    assert snap["generations_total"] > 10  # the fuzz reached the engine, not only validation
