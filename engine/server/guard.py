"""The ASGI layer around every request: the API key, the request counters, and the last line of
defence against a bug.

- With an API key set, /v1/* needs `Authorization: Bearer KEY` (compared in constant time);
  /health, /metrics and /openapi.json stay open, as vLLM's do, so probes need no secret.
- Whatever escapes a handler becomes a 500 in OpenAI's shape with `Connection: close` (Starlette
  would send plain text and re-raise, and uvicorn would then drop the keep-alive connection under
  the client's next request). If the reply had already started, the connection is closed, the
  only honest end for a half-written body.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from engine.server.errors import ApiError, server_error
from engine.server.metrics import Metrics

log = logging.getLogger(__name__)


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        code="invalid_api_key",
        headers={"www-authenticate": 'Bearer realm="gpurig"'},
    )


def check_api_key(headers: list[tuple[bytes, bytes]], api_key: str) -> ApiError | None:
    """None when the request carries the key; else the 401 to send."""
    value = next((v for k, v in headers if k.lower() == b"authorization"), None)
    if value is None:
        return _unauthorized(
            "You didn't provide an API key. This server needs one: send it as "
            "'Authorization: Bearer YOUR_KEY' (the openai client's api_key)."
        )
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(
        token.strip(), api_key.encode("utf-8")
    ):
        return _unauthorized(
            "Incorrect API key provided. Use the key the server was started with "
            "(--api-key or GPURIG_ENGINE_API_KEY)."
        )
    return None


class RequestGuard:
    """ASGI middleware: API key, per-endpoint counting for /metrics, and 500s that close."""

    def __init__(
        self, app: Any, metrics: Metrics, known_paths: set[str], api_key: str | None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths
        self.api_key = api_key

    def _endpoint(self, path: str) -> str:
        if path.startswith("/v1/models/"):  # one label for every id (bounded label values)
            return "/v1/models/{id}"
        return path if path in self.known_paths else "other"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = {"code": 500, "started": False}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        try:
            refusal = None
            if self.api_key and (path == "/v1" or path.startswith("/v1/")):
                refusal = check_api_key(scope.get("headers") or [], self.api_key)
            if refusal is not None:
                await refusal.response()(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            log.exception("unhandled error in a request", exc_info=exc)
            if status["started"]:
                raise  # half a reply was sent: the server closes the connection
            await server_error(exc).response()(scope, receive, send_wrapper)
        finally:
            self.metrics.record_request(self._endpoint(path), int(status["code"]))
