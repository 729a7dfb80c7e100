"""Evaluation: one or two OpenAI-compatible servers answer the same questions (BFCL simple, a
user's JSONL, the recall test), scored and paired question by question (see run.py).

`evaluate` is imported on first use: `gpurig`'s parser builds its eval flags from models.py,
and every `gpurig` start would otherwise pay for the HTTP client."""

from typing import TYPE_CHECKING, Any

from bench.eval.models import EvalRequest, EvalResult, ServerSpec

if TYPE_CHECKING:
    from bench.eval.run import evaluate

__all__ = ["EvalRequest", "EvalResult", "ServerSpec", "evaluate"]


def __getattr__(name: str) -> Any:
    if name == "evaluate":
        from bench.eval.run import evaluate

        return evaluate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
