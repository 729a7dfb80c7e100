"""compare_outputs (tools/compare.py) without vLLM: the comparison rules on made-up outputs, every
refusal (a down server, a non-OpenAI answer, a server without logprobs, mismatched vocabularies,
a missing reference checkpoint) against small fake servers, and the whole path against a real
`gpurig engine serve` compared with itself and with transformers (the `gpurig compare` CLI, its
table and --json, and the MCP tool over a real MCP session).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from mcp import Client, StdioServerParameters
from server_support import ServerProcess, free_port

from engine.checkpoint_maker import make_checkpoint
from tools.compare import CompareRequest, CompareResult, ServerTarget, compare_outputs, compare_pair
from tools.compare_client import CompareError
from tools.compare_types import Output
from tools.errors import InvalidInputError, NotFoundError

# ---- the rules -------------------------------------------------------------------------------


def _out(tokens, own, top):
    return Output(tokens, own, top)


def test_identical_outputs_have_no_difference():
    a = _out([5, 6, 7], [-1.0] * 3, [{5: -1.0}, {6: -1.0}, {7: -1.0}])
    assert compare_pair(a, a, 0.1) == (3, None)


def test_a_near_tie_is_told_from_a_real_difference():
    a = _out([5, 6, 9], [-1, -1, -2.00], [{5: -1}, {6: -1}, {9: -2.00, 8: -2.03}])
    b = _out([5, 6, 8], [-1, -1, -2.01], [{5: -1}, {6: -1}, {8: -2.01, 9: -2.05}])
    agreed, diff = compare_pair(a, b, 0.1)
    assert agreed == 2 and diff.position == 2 and diff.near_tie
    assert diff.a.token == 9 and diff.a.other_logprob == -2.03
    assert diff.a.margin == pytest.approx(0.03) and diff.b.margin == pytest.approx(0.04)
    # b rates a's token far below its own: a real difference, whatever a thinks
    b.top[2] = {8: -0.5, 9: -3.0}
    b.logprobs[2] = -0.5
    assert not compare_pair(a, b, 0.1)[1].near_tie
    # a's token not even among b's top: only a lower bound on b's margin
    b.top[2] = {8: -0.5, 3: -0.9}
    diff = compare_pair(a, b, 0.1)[1]
    assert diff.b.other_logprob is None and diff.b.margin is None
    assert diff.b.margin_at_least == pytest.approx(0.4) and not diff.near_tie


# ---- fake servers for the refusals ------------------------------------------------------------


class _Fake(BaseHTTPRequestHandler):
    routes: dict = {}

    def _answer(self):
        status, body = self.server.routes.get(self.path, (404, {"error": {"message": "nope"}}))
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._answer()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    servers = []

    def make(routes):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
        httpd.routes = routes
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield make
    for s in servers:
        s.shutdown()


MODELS = (200, {"object": "list", "data": [{"id": "m"}]})


def _choice(**fields):
    return (200, {"choices": [{"index": 0, "text": "x", **fields}]})


def _request(a, b, **kw):
    return CompareRequest(a=ServerTarget(base_url=a), b=ServerTarget(base_url=b), **kw)


def test_a_down_server_says_so(fake):
    up = fake({"/v1/models": MODELS})
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CompareError, match="cannot reach server b") as info:
        compare_outputs(_request(up, down, prompts=[[1, 2]]))
    assert "running" in info.value.remedy


def test_a_non_openai_answer_says_so(fake):
    html = fake({"/v1/models": (200, b"<html>hello</html>")})
    with pytest.raises(CompareError, match="did not answer /v1/models with JSON"):
        compare_outputs(_request(html, html, prompts=[[1, 2]]))
    empty = fake({"/v1/models": (200, {"data": []})})
    with pytest.raises(CompareError, match="lists no models"):
        compare_outputs(_request(empty, empty, prompts=[[1, 2]]))
    no_choices = fake({"/v1/models": MODELS, "/v1/completions": (200, {"id": "x"})})
    with pytest.raises(CompareError, match="has no choices"):
        compare_outputs(_request(no_choices, no_choices, prompts=[[1, 2]]))


def test_a_server_without_logprobs_or_token_ids_says_so(fake):
    ids = _choice(prompt_token_ids=[2, 3], token_ids=[4], logprobs=None)
    silent = fake({"/v1/models": MODELS, "/v1/completions": ids})
    with pytest.raises(CompareError, match="returned no logprobs"):
        compare_outputs(_request(silent, silent, prompts=[[1, 2]]))
    refusing = fake(
        {"/v1/models": MODELS,
         "/v1/completions": (400, {"error": {"message": "logprobs is not supported"}})}
    )  # fmt: skip
    with pytest.raises(CompareError, match="cannot return log-probabilities"):
        compare_outputs(_request(refusing, refusing, prompts=[[1, 2]]))
    no_ids = fake({"/v1/models": MODELS, "/v1/completions": _choice()})
    with pytest.raises(CompareError, match="does not return prompt_token_ids"):
        compare_outputs(_request(no_ids, no_ids))


def test_mismatched_vocabularies_are_refused(fake):
    lp = {"tokens": ["token_id:4"], "token_logprobs": [-1.0], "top_logprobs": [{}]}
    one = fake(
        {
            "/v1/models": MODELS,
            "/v1/completions": _choice(prompt_token_ids=[2, 3], token_ids=[4], logprobs=lp),
        }
    )
    other = fake(
        {
            "/v1/models": MODELS,
            "/v1/completions": _choice(prompt_token_ids=[2, 9], token_ids=[4], logprobs=lp),
        }
    )
    # fmt: skip
    with pytest.raises(InvalidInputError, match="tokenise the same text differently"):
        compare_outputs(_request(one, other, prompts=[[1, 2]]))


def test_a_missing_reference_checkpoint_is_refused_before_any_server(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(NotFoundError, match="does not exist"):
        compare_outputs(_request(down, down, prompts=[[1]], reference=str(tmp_path / "none")))
    with pytest.raises(NotFoundError, match="holds no checkpoint"):
        compare_outputs(_request(down, down, prompts=[[1]], reference=str(tmp_path)))


def test_bad_prompts_are_refused():
    down = "http://127.0.0.1:9"
    with pytest.raises(InvalidInputError, match="not both"):
        compare_outputs(_request(down, down, prompts=[[1]], texts=["x"]))
    with pytest.raises(InvalidInputError, match="prompt 0"):
        compare_outputs(_request(down, down, prompts=[[]]))


# ---- the real engine server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "tiny"
    make_checkpoint(path, preset="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServerProcess(checkpoint)
    yield proc
    proc.stop()


def test_the_engine_against_itself_and_transformers(server, checkpoint):
    """Two clients of one engine server: identical; transformers on the same files agrees."""
    request = CompareRequest(
        a=ServerTarget(base_url=server.base, name="one"),
        b=ServerTarget(base_url=server.base + "/v1", name="two"),
        texts=["The capital of France is", "def f(x):"],
        max_tokens=12,
        reference=str(checkpoint),
    )
    result = compare_outputs(request)
    assert result.verdict == "ok" and result.identical == 2 and result.min_agreed == 12
    for p in result.prompts:
        assert p.reference is not None and p.reference.departs_first == "neither"
        assert p.reference.tokens == p.a_tokens


def test_cli_table_json_and_exit_codes(server, run_gpurig):
    done = run_gpurig("compare", server.base, server.base, "--prompt-ids", "2,10,20,30",
                      "--prompt-ids", "2,40,50", "--max-tokens", "6", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = CompareResult.model_validate_json(done.stdout)
    assert [p.agreed for p in result.prompts] == [6, 6] and result.verdict == "ok"
    table = run_gpurig("compare", server.base, server.base, "--text", "Hello", "--max-tokens", "4")
    assert table.returncode == 0, table.stderr
    assert "verdict: ok" in table.stdout and "identical" in table.stdout
    down = run_gpurig("compare", server.base, f"http://127.0.0.1:{free_port()}", "--max-tokens",
                      "2")  # fmt: skip
    assert down.returncode == 2 and "cannot reach server b" in down.stderr
    bad = run_gpurig("compare", server.base, server.base, "--top-logprobs", "50")
    assert bad.returncode == 2 and "top_logprobs" in bad.stderr


def test_mcp_compare_outputs_session(server, gpurig_bin):
    async def session():
        params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=dict(os.environ))
        async with Client(params, read_timeout_seconds=180) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "compare_outputs" in tools
            assert tools["compare_outputs"].annotations.read_only_hint is True
            result = await client.call_tool(
                "compare_outputs",
                {"a": server.base, "b": server.base + "/v1",
                 "prompts": [[2, 10, 20], [2, *range(10, 110)]], "max_tokens": 4},
            )  # fmt: skip
            assert not result.is_error, result.content
            out = CompareResult.model_validate(result.structured_content)
            assert out.verdict == "ok" and [p.agreed for p in out.prompts] == [4, 4]
            assert out.prompts[1].prompt_tokens == 101  # past MCP's default of 64 items
            refused = await client.call_tool(
                "compare_outputs",
                {"a": server.base, "b": f"http://127.0.0.1:{free_port()}", "prompts": [[2]]},
            )
            assert refused.is_error
            text = " ".join(getattr(b, "text", "") for b in refused.content)
            assert "cannot reach server b" in text

    asyncio.run(session())


def test_a_server_without_prompt_token_ids_still_compares_token_id_prompts(fake):
    lp = {"tokens": ["token_id:4", "token_id:5"], "token_logprobs": [-1.0, -0.5],
          "top_logprobs": [{"token_id:4": -1.0}, {"token_id:5": -0.5}]}  # fmt: skip
    older = fake({"/v1/models": MODELS, "/v1/completions": _choice(logprobs=lp)})
    result = compare_outputs(_request(older, older, prompts=[[1, 2]], max_tokens=2))
    assert result.verdict == "ok" and result.prompts[0].a_tokens == [4, 5]  # from token_id:N
    assert any("vocabularies not checked" in n for n in result.notes)
