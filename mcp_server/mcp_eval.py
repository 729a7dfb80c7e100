"""MCP tool `evaluate`: a thin wrapper around bench.eval.evaluate (`gpurig eval` calls the same
function). It runs in a worker thread, since a suite takes minutes to hours, and every finished
question becomes a progress notification when the client sent a progress token. Its arguments
are EvalArguments' fields, flat (mcp_server/request_params.py).
"""

from __future__ import annotations

import contextlib

import anyio
import anyio.from_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

from bench.eval.models import EvalArguments, EvalResult
from mcp_server.request_params import flat_arguments

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
    @flat_arguments(EvalArguments)
    async def evaluate_tool(ctx: Context, arguments: EvalArguments) -> EvalResult:
        """The answers of one or two OpenAI-compatible servers to the same questions, scored
        and paired question by question.

        Suites: bfcl (BFCL v4 by bfcl_category: simple_python, multiple, parallel,
        parallel_multiple, irrelevance or a live_ one; the functions as tools, the calls scored
        by name and arguments against the shipped possible answers as BFCL's AST checker does,
        parallel order-free, irrelevance right only without a call; the bfcl-eval wheel is
        fetched once into ~/.cache/gpurig/bfcl), jsonl (your file; exact match, or the last number for
        GSM8K's '#### N'), recall (numbered records with six-digit codes filling recall_tokens
        tokens, asking for the record a quarter of the way in). Every question goes to
        /v1/chat/completions of each server (its own chat template), temperature 0 and a seed
        by default. Returns per server right/answered with a 95% Wilson interval and, with two
        servers, the paired table (both right, only a, only b, both wrong), McNemar's exact
        p-value and the ids that differ; wrong answers by bucket (wrong_tool, call_count,
        missing_parameter, unexpected_parameter, parameter_type, parameter_value, no_call,
        unparsed, spurious_call, wrong_answer, error) per server and paired (a fails while b
        is right, and the reverse). Writes answers.jsonl (one line per question: each
        server's answer and verdict), results.json and REPORT.md to out_dir; a killed run
        continues with resume. Refused with what to do: a server that is down, a missing or
        malformed file (the line is named), no BFCL wheel.
        """
        request = arguments.request()

        def progress(done: int, total: int, message: str) -> None:
            # a no-op without a progress token; a client that went away must not stop the run
            with contextlib.suppress(Exception):
                anyio.from_thread.run(ctx.report_progress, float(done), float(total), message)

        from bench.eval.run import evaluate

        return await anyio.to_thread.run_sync(lambda: evaluate(request, progress))
