"""POST /reset_prefix_cache: the engine server's answer to vLLM's endpoint of that name, which
benchmarks call between runs so a repeat does not find the last one's prompts in the cache.

The engine keeps no KV blocks across requests: a sequence's blocks go back to the pool when it
ends (engine/block_manager.py), and nothing else holds a prompt's work for the next request. So
there is nothing to empty, and the endpoint says so, in vLLM's shape (`{"success": true}`) with
what it reset (nothing) and why; a client (bench/sweep/cache_reset.py) reports it as such.
Refused (409) while requests are running, as vLLM's reset fails while blocks are held: the
caller waits for its cell to end first.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server.errors import ApiError
from engine.server.state import ServerState

NOTHING_HELD = (
    "the engine keeps no KV cache across requests (a sequence's blocks are freed when it "
    "ends), so no prompt's work was held for later requests: nothing to reset"
)


class PrefixCacheReset(BaseModel):
    """The endpoint's answer: vLLM's `success`, plus what was reset and why no more."""

    success: bool
    prefix_cache: bool = Field(description="whether the engine keeps a cross-request cache")
    reset: list[str] = Field(default_factory=list, description="the caches emptied")
    message: str


async def reset_prefix_cache(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.engine.has_work:
        raise ApiError(
            409,
            "Requests are running; reset the prefix cache once they have ended.",
            code="busy",
        )
    answer = PrefixCacheReset(success=True, prefix_cache=False, message=NOTHING_HELD)
    return JSONResponse(answer.model_dump())
