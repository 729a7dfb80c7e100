"""`gpurig engine serve`'s options, on a live server and at the command line: the API key (from
GPURIG_ENGINE_API_KEY here), the server-side max_tokens cap, the thread count, --max-ctx as an
alias of --max-context, /openapi.json, and bind addresses that cannot work.
"""

from __future__ import annotations

import json
import socket

import httpx
import jsonschema
import openai
import pytest
from openapi_spec_validator import validate as validate_openapi
from server_support import ServerProcess, free_port

from engine.checkpoint_maker import make_checkpoint
from engine.server.app import ROUTES

MODEL = "tiny-opts"
KEY = "sekrit-key-123"
CAP = 24
USER = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / MODEL
    make_checkpoint(path, preset="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServerProcess(
        checkpoint,
        "--max-ctx", "2048", "--threads", "1", "--max-tokens-limit", str(CAP),
        env={"GPURIG_ENGINE_API_KEY": KEY},
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_the_api_key_guards_v1_and_only_v1(server, client):
    url = server.base + "/v1/models"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                    {"authorization": f"Bearer {KEY}x"}):  # fmt: skip
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401, headers
        err = _error(r)
        assert err["code"] == "invalid_api_key" and "Bearer" in r.headers["www-authenticate"]
        assert KEY not in r.text
    r = httpx.post(server.base + "/v1/completions", json={"prompt": [2], "max_tokens": 1})
    assert r.status_code == 401  # refused before the body is read or anything generated
    assert server.metrics()["generations_total"] == 0  # nothing reached the engine
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="nope", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [MODEL]
    for open_path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(server.base + open_path).status_code == 200


def test_max_tokens_is_capped_and_the_reply_says_so(client):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=[2, 40], max_tokens=500, extra_body={"ignore_eos": True}
    )
    resp = raw.parse()
    assert resp.usage.completion_tokens == CAP and resp.choices[0].finish_reason == "length"
    assert raw.headers["x-gpurig-max-tokens-capped"] == str(CAP)
    assert resp.model_extra["max_tokens_capped"] == CAP
    raw = client.completions.with_raw_response.create(  # under the cap: untouched
        model=MODEL, prompt=[2, 40], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert raw.parse().usage.completion_tokens == 5
    assert "x-gpurig-max-tokens-capped" not in raw.headers
    assert "max_tokens_capped" not in raw.parse().model_extra
    # chat without max_tokens would run to the context: the cap applies, streamed too
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, extra_body={"ignore_eos": True}
    )
    assert raw.parse().usage.completion_tokens == CAP
    assert raw.parse().choices[0].finish_reason == "length"
    assert raw.headers["x-gpurig-max-tokens-capped"] == str(CAP)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, extra_body={"ignore_eos": True}
        )
    )
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == CAP
    assert last.model_extra["max_tokens_capped"] == CAP
    # asking more than the context is still the context error, as OpenAI says it
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5000)
    assert "maximum context length is 2048" in exc.value.message


def test_the_start_line_reports_the_settings(server):
    health = httpx.get(server.base + "/health").json()
    assert health["max_context"] == 2048  # --max-ctx, the alias, took effect
    log = server.log.read_text()
    assert "context 2048" in log and "1 CPU threads" in log
    # the KV pool's line, in vLLM's words, and the batch size the server chose
    assert "KV cache size:" in log and "Maximum concurrency for 2,048 tokens per request" in log
    assert "max_num_seqs 16" in log
    assert f"max_tokens limit {CAP}" in log and "API key on" in log
    assert KEY not in log
    assert "WARNING" not in log  # loopback: no exposure warning


def test_openapi_describes_every_route_and_validates_requests(server, client):
    spec = httpx.get(server.base + "/openapi.json").json()
    validate_openapi(spec)  # raises on a malformed document
    assert spec["openapi"].startswith("3.")
    routes = {
        (r.path.replace(":path", ""), m.lower()) for r in ROUTES for m in r.methods - {"HEAD"}
    }
    listed = {(p, m) for p, item in spec["paths"].items() for m in item}
    assert listed == routes
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/health"]["get"]

    def validator(name: str) -> jsonschema.Validator:
        root = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
        return jsonschema.Draft202012Validator(root)

    chat = validator("ChatCompletionRequest")
    good = {
        "model": MODEL,
        "messages": [*USER, {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "temperature": 0.5, "max_tokens": 3, "stop": ["\n\n"], "stream": False,
    }  # fmt: skip
    chat.validate(good)
    for bad in ({**good, "temperature": "hot"}, {**good, "messages": []},
                {**good, "max_tokens": 0}, {"messages": [{"role": "robot", "content": "x"}]}):  # fmt: skip
        assert not chat.is_valid(bad), bad
    completion = validator("CompletionRequest")
    for prompt in ("text", [1, 2, 3], ["text"], [[1, 2]]):
        completion.validate({"prompt": prompt, "max_tokens": 2})
    assert not completion.is_valid({"prompt": 5})
    assert not completion.is_valid({"max_tokens": 2})
    # and what the schema accepts, the server serves
    r = httpx.post(server.base + "/v1/chat/completions", json=good,
                   headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 200, r.text
    validator("ChatCompletion").validate(r.json())


def test_bind_addresses_that_cannot_work_say_why(run_gpurig, tmp_path):
    def serve(*args: str, env: dict[str, str] | None = None):
        return run_gpurig("engine", "serve", "--model", str(tmp_path), *args, env=env)

    for host, words in (
        ("999.1.1.1", "not a valid IPv4 address"),
        ("no-such-host.invalid", "cannot resolve"),
        ("192.0.2.1", "not an address of this machine"),  # TEST-NET-1: never local
    ):
        r = serve("--host", host, "--port", str(free_port()))
        assert r.returncode == 2, r.stderr
        assert words in r.stderr and "free port" not in r.stderr
        assert "Traceback" not in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = serve("--port", str(busy.getsockname()[1]))
    assert r.returncode == 2 and "in use" in r.stderr and "--port" in r.stderr
    r = serve("--port", "80")
    assert r.returncode == 2 and ("1024" in r.stderr or "config.json" in r.stderr)  # root may bind


def test_bad_values_are_refused_before_loading(run_gpurig, tmp_path):
    for args, words in (
        (["--threads", "0"], "--threads 0"),
        (["--max-tokens-limit", "-1"], "--max-tokens-limit -1"),
        (["--max-body-mib", "0"], "--max-body-mib"),
        (["--max-context", "0"], "--max-context 0"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-seqs", "65"], "use 1-64 or auto"),
        (["--max-num-seqs", "many"], "not a whole number"),
        (["--kv-cache-mib", "0"], "--kv-cache-mib"),
        (["--prefill-budget", "-5"], "--prefill-budget"),
    ):
        r = run_gpurig("engine", "serve", "--model", str(tmp_path), *args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)


def test_a_pool_too_small_for_the_sequences_is_refused_in_the_cli_words(run_gpurig, checkpoint):
    r = run_gpurig("engine", "serve", "--model", str(checkpoint), "--device", "cpu",
                   "--kv-cache-mib", "1", "--max-num-seqs", "64", "--port", str(free_port()))  # fmt: skip
    assert r.returncode == 2
    assert "does not hold 64 sequences" in r.stderr
    assert "--max-num-seqs" in r.stderr and "--kv-cache-mib" in r.stderr


def test_listening_beyond_loopback_warns(run_gpurig, tmp_path):
    """The warning comes before loading (here the load then fails: no config.json)."""
    port = str(free_port())
    r = run_gpurig("engine", "serve", "--model", str(tmp_path), "--host", "0.0.0.0",
                   "--port", port, env={"GPURIG_ENGINE_API_KEY": ""})  # fmt: skip
    assert "WARNING" in r.stderr and "WITHOUT an API key" in r.stderr and "--api-key" in r.stderr
    assert f"ssh -L {port}:127.0.0.1:{port}" in r.stderr
    assert "config.json" in r.stderr and r.returncode == 2
    r = run_gpurig("engine", "serve", "--model", str(tmp_path), "--host", "0.0.0.0",
                   "--port", port, "--api-key", "k")  # fmt: skip
    assert "WARNING" not in r.stderr and "reachable beyond this machine" in r.stderr
    r = run_gpurig("engine", "serve", "--model", str(tmp_path), "--port", port)
    assert "beyond this machine" not in r.stderr


def test_openapi_without_a_key_has_no_security(checkpoint):
    """The document is built from the models, not per server: check one made in-process."""
    import engine
    from engine.server import create_app

    app = create_app(engine.load(checkpoint, device="cpu"), model_name="m")
    spec = app.state.openapi
    validate_openapi(spec)
    assert "securitySchemes" not in spec["components"]
    assert json.dumps(spec)  # plain JSON


def test_the_cli_defaults_are_the_servers():
    from engine import serve_options, threads
    from engine.server import limits
    from mcp_server.cli import build_parser

    defaults = vars(build_parser().parse_args(["engine", "serve", "--model", "m"]))
    assert defaults["max_tokens_limit"] == limits.DEFAULT_MAX_TOKENS_LIMIT
    assert defaults["max_body_mib"] * 1024 * 1024 == limits.DEFAULT_MAX_BODY_BYTES
    assert defaults["port"] == serve_options.DEFAULT_PORT
    assert 1 <= threads.serve_default() <= threads.MAX_DEFAULT_THREADS
