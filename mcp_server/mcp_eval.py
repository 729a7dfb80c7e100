"""MCP tool `evaluate`: a thin wrapper around bench.eval.evaluate (`gpurig eval` calls the same
function). It runs in a worker thread, since a suite takes minutes to hours, and every finished
question becomes a progress notification when the client sent a progress token.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Literal

import anyio
import anyio.from_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from bench.eval.models import EvalResult, build_request

# it writes its run directory and asks servers, but changes nothing about them
WRITES_RESULTS = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)


def register(mcp: MCPServer) -> None:
    @mcp.tool(
        name="evaluate",
        title="Score two servers question by question",
        annotations=WRITES_RESULTS,
    )
    async def evaluate_tool(
        ctx: Context,
        a: Annotated[str | None, Field(description="the first server; none with resume")] = None,
        b: Annotated[str | None, Field(description="a second server to pair with a")] = None,
        a_name: Annotated[str | None, Field(max_length=64, description="label of a")] = None,
        b_name: Annotated[str | None, Field(max_length=64, description="label of b")] = None,
        a_model: Annotated[str | None, Field(description="a's model; default listed")] = None,
        b_model: Annotated[str | None, Field(description="b's model; default listed")] = None,
        suite: Literal["bfcl", "jsonl", "recall"] = "jsonl",
        path: Annotated[
            str | None, Field(description="jsonl: a file of {id, prompt or messages, answer}")
        ] = None,
        scoring: Annotated[
            Literal["exact", "last_number"] | None,
            Field(description="jsonl; default last_number for '#### N' or numeric answers"),
        ] = None,
        bfcl_category: Literal["simple_python", "live_simple"] = "simple_python",
        recall_tokens: Annotated[int, Field(ge=64, le=1_000_000)] = 1024,
        limit: Annotated[int | None, Field(ge=1, description="the first N questions")] = None,
        max_tokens: Annotated[int, Field(ge=1, le=65536)] = 256,
        temperature: Annotated[float, Field(ge=0, le=2, description="0: greedy")] = 0.0,
        seed: Annotated[int, Field(ge=0, lt=2**31)] = 0,
        concurrency: Annotated[int, Field(ge=1, le=256)] = 4,
        timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0,
        out_dir: Annotated[
            str | None, Field(description="default: GPURIG_HOME/evals/<run id>")
        ] = None,
        resume: Annotated[
            str | None, Field(description="a run's directory or id to continue")
        ] = None,
    ) -> EvalResult:
        """The answers of one or two OpenAI-compatible servers to the same questions, scored
        and paired question by question.

        Suites: bfcl (BFCL v4 simple: one function as a tool, the call scored by name and
        arguments against the shipped possible answers; the bfcl-eval wheel is fetched once
        into ~/.cache/gpurig/bfcl), jsonl (your file; exact match, or the last number for
        GSM8K's '#### N'), recall (numbered records with six-digit codes filling recall_tokens
        tokens, asking for the record a quarter of the way in). Every question goes to
        /v1/chat/completions of each server (its own chat template), temperature 0 and a seed
        by default. Returns per server right/answered with a 95% Wilson interval and, with two
        servers, the paired table (both right, only a, only b, both wrong), McNemar's exact
        p-value and the ids that differ. Writes answers.jsonl (one line per question: each
        server's answer and verdict), results.json and REPORT.md to out_dir; a killed run
        continues with resume. Refused with what to do: a server that is down, a missing or
        malformed file (the line is named), no BFCL wheel.
        """
        servers = [
            {"base_url": url, "name": name, "model": model}
            for url, name, model in ((a, a_name, a_model), (b, b_name, b_model))
            if url
        ]
        request = build_request(
            servers=servers,
            suite=suite,
            path=path,
            scoring=scoring,
            bfcl_category=bfcl_category,
            recall_tokens=recall_tokens,
            limit=limit,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            concurrency=concurrency,
            timeout_s=timeout_s,
            out_dir=out_dir,
            resume=resume,
        )

        def progress(done: int, total: int, message: str) -> None:
            # a no-op without a progress token; a client that went away must not stop the run
            with contextlib.suppress(Exception):
                anyio.from_thread.run(ctx.report_progress, float(done), float(total), message)

        from bench.eval.run import evaluate

        return await anyio.to_thread.run_sync(lambda: evaluate(request, progress))
