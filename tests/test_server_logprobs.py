"""Log-probabilities and token ids from the live server (`gpurig engine serve` on loopback, the
tiny checkpoint): OpenAI's shapes as vLLM sends them (checked against the real vLLM 0.32 CPU
build by hand, and by tests/test_compare_vllm.py through compare_outputs), streamed and not,
the limits refused with 400s, and the numbers: sorted, a distribution's (sum of probabilities at
most 1), the greedy token the top-1, equal to the in-process engine's, and raw (before
logit_bias), as vLLM's default logprobs_mode.
"""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from server_support import ServerProcess

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.sampling import SamplingParams

PROMPT = [2, 10, 20, 30, 40, 50, 60]
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs") / "tiny"
    make_checkpoint(path, preset="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServerProcess(checkpoint)
    yield proc
    proc.stop()


def _post(server, path, body, status=200):
    r = httpx.post(server.base + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _stream(server, path, body):
    with httpx.stream("POST", server.base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _check_top(entries: list[tuple[float, ...]]) -> None:
    values = list(entries)
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    assert all(v <= 0.0 for v in values)


def test_completions_logprobs_shape_and_numbers(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    choice = _post(server, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 8
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                 strict=True):  # fmt: skip
        assert 1 <= len(top) <= 4  # the sampled token and the top 3 (greedy: it is the top-1)
        _check_top(top.values())
        assert value == pytest.approx(max(top.values()), abs=1e-6)
        assert top[token] == pytest.approx(value, abs=1e-6)


def test_token_ids_names_and_logprobs_0(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip
    choice = _post(server, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None  # not asked
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    plain = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape_and_numbers(server):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 4, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    reply = _post(server, "/v1/chat/completions", body)
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == reply["usage"]["completion_tokens"] == 6
    assert reply["prompt_token_ids"] and reply["prompt_token_ids"][0] == 2
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode("utf-8", errors="replace"))
        top = item["top_logprobs"]
        assert len(top) == 4 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        _check_top([t["logprob"] for t in top])
        assert item["logprob"] == pytest.approx(top[0]["logprob"], abs=1e-6)  # greedy: top-1
        assert item["token"] == top[0]["token"]
    no_top = _post(server, "/v1/chat/completions", {**body, "top_logprobs": 0})
    assert all(i["top_logprobs"] == [] for i in no_top["choices"][0]["logprobs"]["content"])
    off = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert off["choices"][0]["logprobs"] is None and off["prompt_token_ids"] is None


def test_streams_carry_the_same_logprobs(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    whole = _post(server, "/v1/completions", body)["choices"][0]
    chunks = _stream(server, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    tokens, ids, offsets = [], [], []
    for c in chunks:
        choice = c["choices"][0] if c["choices"] else None
        if choice is None:
            continue
        ids += choice["token_ids"]
        if choice["logprobs"]:
            tokens += choice["logprobs"]["tokens"]
            offsets += choice["logprobs"]["text_offset"]
            assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
    assert ids == whole["token_ids"] and tokens == whole["logprobs"]["tokens"]
    assert offsets == whole["logprobs"]["text_offset"]

    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    whole = _post(server, "/v1/chat/completions", chat)
    chunks = _stream(server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    content = [i for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for i in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert content == whole["choices"][0]["logprobs"]["content"]
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert ids == whole["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)  # fmt: skip
def test_limits_are_refused_with_400(server, path, body, param):
    err = _post(server, path, body, status=400)["error"]
    assert err["param"] == param, err
    if "21" in json.dumps(body):
        assert "20" in err["message"]


def test_wrong_types_are_422(server):
    _post(server, "/v1/completions", {"prompt": PROMPT, "logprobs": True}, status=422)
    _post(server, "/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, status=422)


def test_logprobs_are_raw_before_logit_bias(server):
    """logit_bias moves the pick, not the reported numbers (vLLM's raw_logprobs)."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 2}
    plain = _post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    forced = _post(server, "/v1/completions", {**body, "logit_bias": {"77": 100.0},
                                               "return_token_ids": True})  # fmt: skip
    choice = forced["choices"][0]
    assert choice["token_ids"] == [77]
    top = choice["logprobs"]["top_logprobs"][0]
    assert choice["logprobs"]["token_logprobs"][0] < max(top.values())  # not the top-1 raw
    assert max(top.values()) == pytest.approx(plain["token_logprobs"][0], abs=1e-6)


def test_concurrent_requests_with_and_without_logprobs(server, checkpoint):
    """A batch mixing rows that ask (with different k) and rows that do not: each gets what it
    asked for, equal to the in-process single-sequence engine's numbers."""
    bodies = [
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True,
         "return_tokens_as_token_ids": True},
        {"prompt": PROMPT[:4], "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"prompt": PROMPT[:5], "max_tokens": 6, "temperature": 0, "logprobs": 1,
         "ignore_eos": True, "return_tokens_as_token_ids": True},
    ]  # fmt: skip
    out: dict[int, dict] = {}

    def run(i):
        out[i] = _post(server, "/v1/completions", bodies[i])["choices"][0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[1]["logprobs"] is None
    eng = engine.load(checkpoint, device="cpu", max_context=256)  # one sequence: generate.py
    for i in (0, 2):
        k = bodies[i]["logprobs"]
        gen = eng.stream(bodies[i]["prompt"], SamplingParams(max_tokens=6, stop_ids=(), logprobs=k))
        list(gen)
        lp = out[i]["logprobs"]
        assert [e.logprob for e in gen.logprobs] == pytest.approx(lp["token_logprobs"], abs=1e-4)
        for e, top in zip(gen.logprobs, lp["top_logprobs"], strict=True):
            assert len(e.top) == len(top) == k  # ids as names: several ids may decode to "\ufffd"
            assert [f"token_id:{t}" for t, _ in e.top] == list(top)
            assert [v for _, v in e.top] == pytest.approx(list(top.values()), abs=1e-4)


def test_step_logprobs_rows_and_vllm_order():
    """Any subset of a step's rows, each its own k; the sampled token first, then the top k
    without it (vLLM's per-step order), so a sampled token outside the top k makes k + 1."""
    import torch

    from engine.logprobs import StepLogprobs

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    ids = torch.tensor([0, 3, 1])  # row 1 sampled the least likely, row 2 the second
    out = StepLogprobs.compute(logits, ids, [1, 2], [2, 2]).to_host(ids.tolist())
    ref = torch.log_softmax(logits[0], -1).tolist()
    assert out[1].token == 3 and out[1].logprob == pytest.approx(ref[3])
    assert [t for t, _ in out[1].top] == [3, 0, 1]  # sampled, then the top 2
    assert [t for t, _ in out[2].top] == [1, 0]  # sampled is in the top 2: not repeated
    only = StepLogprobs.compute(logits, ids, [0, 2], [0, 1]).to_host(ids.tolist())
    assert only[0].top == ((0, pytest.approx(ref[0])),) and set(only) == {0, 2}
