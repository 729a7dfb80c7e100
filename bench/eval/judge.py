"""The verdict on one server's answer to one question, with the bucket a wrong answer falls in:
BFCL's checker for the question's category (score_bfcl.py), text scoring for the rest.

Two things happen before BFCL's checker sees the calls. The names the server was given were
OpenAI-safe (`math.factorial` sent as `math_factorial`, suites/bfcl.py): they are mapped back.
And a reply with no tool_calls is told apart: plain text is `no_call` (the model chose not to
call), while text that holds a call in Gemma 4's notation or as JSON is `unparsed` (the model
called, the server's tool parser did not turn it into tool_calls): the bucket that says a
serving stack's parser, not the model, lost the point.
"""

from __future__ import annotations

import re
from typing import Any

from bench.eval.models import Answer, Question
from bench.eval.score_bfcl import (
    Verdict,
    check_irrelevance,
    check_multiple,
    check_parallel,
)
from bench.eval.score_text import score_exact, score_last_number
from bench.eval.suites.bfcl import openai_name

# a call left in the text: Gemma 4's markers or `call:NAME{`, or a JSON object naming a function
CALL_IN_TEXT = re.compile(
    r"<\|tool_call>|\bcall:[A-Za-z_][\w.\-]*\{|\{\s*\"(?:name|function)\"\s*:|<tool_call>"
)


def checker_kind(category: str | None) -> str:
    """BFCL's dispatch (ast_checker): irrelevance, parallel (order-free), else one call."""
    category = category or "simple_python"
    if "irrelevance" in category:
        return "irrelevance"
    return "parallel" if "parallel" in category else "multiple"


def _real_names(q: Question, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    functions = q.functions or ([q.function] if q.function else [])
    real = {openai_name(f.get("name", "")): f.get("name", "") for f in functions}
    return [{**c, "name": real.get(str(c.get("name")), c.get("name"))} for c in calls]


def judge_bfcl(q: Question, answer: Answer) -> Verdict:
    calls = _real_names(q, answer.tool_calls)
    kind = checker_kind(q.category)
    if kind == "irrelevance":
        if any(not isinstance(c.get("arguments"), dict) for c in calls):
            # BFCL decodes the whole reply or nothing: one undecodable call means no call
            return Verdict(right=True, why="no decodable function call")
        return check_irrelevance(calls)
    if not calls and CALL_IN_TEXT.search(answer.text or ""):
        return Verdict(right=False, bucket="unparsed", why="a call in the text, not in tool_calls")
    functions = q.functions or ([q.function] if q.function else [])
    check = check_parallel if kind == "parallel" else check_multiple
    return check(functions, calls, q.answer)


def judge(q: Question, answer: Answer) -> Verdict:
    """(right, why, bucket) for one server's answer to one question."""
    if answer.error:
        return Verdict(right=False, why=answer.error, bucket="error")
    if q.scoring == "bfcl":
        return judge_bfcl(q, answer)
    scorer = score_last_number if q.scoring == "last_number" else score_exact
    right, why = scorer(answer.text, q.answer)
    return Verdict(right=right, why=why, bucket=None if right else "wrong_answer")
