"""The server answers its first requests in-process before it takes clients
(engine/server/first_requests.py): the app's real lifespan and endpoints on a tiny CPU engine,
and `gpurig engine serve` saying so in its log."""

from __future__ import annotations

import pytest
from server_support import ServerProcess
from starlette.testclient import TestClient

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.server import create_app
from engine.server.limits import ServerOptions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("first_requests") / "tiny"
    make_checkpoint(path, preset="tiny", seed=3)
    return path


@pytest.fixture
def eng(checkpoint):
    """One engine per app: an app's shutdown closes its engine."""
    e = engine.load(checkpoint, device="cpu", max_context=256)
    yield e
    e.close()


def _metrics(client, headers=None) -> dict:
    return client.get("/metrics", params={"format": "json"}, headers=headers).json()


@pytest.mark.parametrize("api_key", [None, "s3cret"])
def test_first_requests_run_at_startup_and_leave_no_trace(eng, api_key):
    lines: list[str] = []
    app = create_app(eng, model_name="m", options=ServerOptions(api_key=api_key),
                     first_requests=True, say=lines.append)  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with TestClient(app) as client:  # runs the lifespan: the first requests happen here
        assert len(lines) == 1 and lines[0].startswith("answered its first requests in-process")
        m = _metrics(client, headers)
        assert m["requests_total"] == 0 and m["generations_total"] == 0, m
        assert m["prompt_tokens_total"] == 0 and m["completion_tokens_total"] == 0
        assert m["decode_steps_total"] == 0 and eng.stats().steps == 0  # the engine's too
        r = client.post("/v1/completions", headers=headers,
                        json={"model": "m", "prompt": "Hi", "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200, r.text
        after = _metrics(client, headers)
        assert after["generations_total"] == 1 and after["completion_tokens_total"] == 3


def test_off_by_default_in_process(eng):
    """create_app alone (tests, embedders) does not run them: no line, no steps."""
    lines: list[str] = []
    app = create_app(eng, model_name="m", say=lines.append)
    with TestClient(app):
        assert lines == []


def test_a_max_tokens_limit_of_one_still_lets_them_run(eng):
    """They ask for what the server's limit allows."""
    lines: list[str] = []
    app = create_app(eng, model_name="m", options=ServerOptions(max_tokens_limit=1),
                     first_requests=True, say=lines.append)  # fmt: skip
    with TestClient(app) as client:
        assert lines and lines[0].startswith("answered"), lines
        assert client.get("/health").status_code == 200


def test_engine_serve_reports_them(checkpoint):
    server = ServerProcess(checkpoint, "--max-context", "256")
    try:
        m = server.metrics()  # (the /health polls of the start are counted: real requests)
        assert m["generations_total"] == 0
        assert not [r for r in m["requests"] if r["endpoint"].startswith("/v1/")], m["requests"]
        log = server.log.read_text()
        assert "gpurig engine: answered its first requests in-process in" in log, log
    finally:
        server.stop()


def test_an_app_that_raises_is_reported_not_fatal():
    """Whatever goes wrong in them, the server still starts: the line says what happened."""
    import asyncio
    from types import SimpleNamespace

    from engine.server.first_requests import answer_first_requests

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    state = SimpleNamespace(
        options=ServerOptions(), limits=SimpleNamespace(max_tokens=None), model_name="m",
        engine=SimpleNamespace(has_work=False, reset_stats=lambda: True),
        metrics=SimpleNamespace(reset=lambda: None),
        encode=lambda text, special, param: [2, 10],
    )  # fmt: skip
    line = asyncio.run(answer_first_requests(broken, state))
    assert "not all answered" in line and "RuntimeError: boom" in line
