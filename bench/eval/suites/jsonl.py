"""A user's question file: one JSON object per line, {id, prompt or messages, answer}.

GSM8K's test split in this shape (answer the solution ending `#### N`) is scored by the last
number; other answers by exact match unless `scoring` says otherwise. Every bad line is refused
by its number before a single question is asked: a run should not die at question 900.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.eval.models import Question
from bench.eval.score_text import looks_numeric
from tools.errors import InvalidInputError, NotFoundError

REMEDY = 'each line: {"id": "q1", "prompt": "...", "answer": "..."} (or "messages": [...])'


def _question(obj: Any, where: str) -> tuple[str, list[dict[str, Any]], Any]:
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{where}: not a JSON object", REMEDY)
    if "answer" not in obj:
        raise InvalidInputError(f"{where}: no 'answer'", REMEDY)
    qid = obj.get("id")
    if not isinstance(qid, str | int) or isinstance(qid, bool) or str(qid) == "":
        raise InvalidInputError(f"{where}: 'id' must be a non-empty string or number", REMEDY)
    if isinstance(obj.get("messages"), list) and obj["messages"]:
        messages = obj["messages"]
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidInputError(f"{where}: each message needs a 'role'", REMEDY)
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise InvalidInputError(f"{where}: give 'prompt' (text) or 'messages' (a list)", REMEDY)
    return str(qid), messages, obj["answer"]


def load(path: str, scoring: str | None = None) -> list[Question]:
    """The file's questions in order; `scoring` None: last number where the answer is numeric
    (a number, or text holding `#### N`), else exact match, per question."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise NotFoundError(f"no question file at {file}", "pass a JSONL file of questions")
    out: list[Question] = []
    seen: dict[str, int] = {}
    with file.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{file}:{number}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise InvalidInputError(f"{where}: not JSON ({exc.msg})", REMEDY) from None
            qid, messages, answer = _question(obj, where)
            if qid in seen:
                raise InvalidInputError(
                    f"{where}: id {qid!r} is already on line {seen[qid]}",
                    "give each line its own id",
                )
            seen[qid] = number
            how = scoring or ("last_number" if looks_numeric(answer) else "exact")
            out.append(Question(id=qid, messages=messages, answer=answer, scoring=how))
    if not out:
        raise InvalidInputError(f"{file} holds no questions", REMEDY)
    return out
