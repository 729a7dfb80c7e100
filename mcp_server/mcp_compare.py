"""MCP tool `compare_outputs`: a thin wrapper around tools/compare.py (the CLI's
`gpurig compare` calls the same function). It runs in a worker thread: the two servers (and
transformers, with a reference) take seconds to minutes, and the MCP server keeps answering.
"""

from __future__ import annotations

from typing import Annotated, Literal

import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from pydantic import Field

from mcp_server.annotations import READ_ONLY
from tools.compare import (
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    CompareRequest,
    CompareResult,
    ServerTarget,
    compare_outputs,
)

Url = Annotated[
    str,
    Field(min_length=1, description="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
]


def register(mcp: MCPServer) -> None:
    @mcp.tool(
        name="compare_outputs", title="Compare two servers token by token", annotations=READ_ONLY
    )
    async def compare_outputs_tool(
        a: Url,
        b: Url,
        a_name: Annotated[str | None, Field(max_length=64, description="label of a")] = None,
        b_name: Annotated[str | None, Field(max_length=64, description="label of b")] = None,
        a_model: Annotated[str | None, Field(description="a's model name; default listed")] = None,
        b_model: Annotated[str | None, Field(description="b's model name; default listed")] = None,
        prompts: Annotated[
            list[Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS)]] | None,
            Field(
                max_length=MAX_PROMPTS,
                description="token-id prompts; default: 8 built-in texts tokenised by a",
            ),
        ] = None,
        texts: Annotated[
            list[str] | None, Field(description="text prompts, tokenised by server a")
        ] = None,
        max_tokens: Annotated[int, Field(ge=1, le=1024)] = 32,
        top_logprobs: Annotated[int, Field(ge=1, le=20)] = 5,
        near_tie: Annotated[
            float, Field(gt=0, le=10, description="log-prob gap (nats) that counts as a tie")
        ] = 0.1,
        reference: Annotated[
            str | None,
            Field(
                description="a local checkpoint directory: transformers runs it in-process "
                "as the reference both servers should match"
            ),
        ] = None,
        reference_dtype: Literal["float32", "float64", "bfloat16"] = "float32",
        timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0,
    ) -> CompareResult:
        """Greedy token ids of the same prompts on two OpenAI-compatible servers (vLLM,
        `gpurig engine serve`), compared token by token.

        Each prompt goes to both servers' /v1/completions at temperature 0 with ignore_eos,
        logprobs and return_token_ids. Per prompt: `agreed` identical leading tokens and, at the
        first difference, both tokens with each side's log-probability of both and its margin
        (own minus other's). `verdict` per prompt: identical, near-tie (both margins within
        near_tie: rounding flips it, not a bug) or diverged; overall ok / warn (near-ties
        only) / fail. With `reference` transformers runs the prompts too and each prompt says
        which side departs from it first and the reference's own margin there. Refused with
        what to do: a server that is down, not OpenAI-compatible or without logprobs, servers
        whose tokenizers differ, a reference directory that does not exist. Takes seconds per
        prompt on a CPU.
        """
        request = CompareRequest(
            a=ServerTarget(base_url=a, name=a_name, model=a_model),
            b=ServerTarget(base_url=b, name=b_name, model=b_model),
            prompts=prompts,
            texts=texts,
            max_tokens=max_tokens,
            top_logprobs=top_logprobs,
            near_tie=near_tie,
            reference=reference,
            reference_dtype=reference_dtype,
            timeout_s=timeout_s,
        )
        return await anyio.to_thread.run_sync(compare_outputs, request)
