"""Evaluation: one or two OpenAI-compatible servers answer the same questions (BFCL simple, a
user's JSONL, the recall test), scored and paired question by question (see run.py)."""

from bench.eval.models import EvalRequest, EvalResult, ServerSpec
from bench.eval.run import evaluate

__all__ = ["EvalRequest", "EvalResult", "ServerSpec", "evaluate"]
