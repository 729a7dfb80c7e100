"""BFCL's AST categories (simple, multiple, parallel, parallel_multiple, irrelevance and their
live_ twins), read from the `bfcl-eval` wheel as PyPI ships it.

Why the wheel and not BFCL's code: the package's dependencies are heavy (and its checker wants
them), the questions and possible answers are plain JSON lines under `bfcl_eval/data/`. The
wheel is fetched once without its dependencies into a cache outside the clone and read with
zipfile; the checker is ours (bench/eval/score_bfcl.py).

The functions are given to the servers as OpenAI `tools`: BFCL's own type names become JSON
Schema's (`dict` -> object, `float` -> number, `tuple` -> array, `any` -> string) and a dotted
name (`math.factorial`) is sent as `math_factorial`, OpenAI's name pattern having no dots; the
reply's name is mapped back before scoring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from bench.eval.models import BfclCategory, Question
from engine import env
from tools.errors import NotFoundError

BFCL_VERSION = "2026.3.23"
WHEEL = f"bfcl_eval-{BFCL_VERSION}-py3-none-any.whl"
JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def cache_dir() -> Path:
    """Where the wheel is kept: GPURIG_BFCL_CACHE, else $XDG_CACHE_HOME/gpurig/bfcl (default
    ~/.cache/gpurig/bfcl, beside the project's other downloads)."""
    given = env.read("GPURIG_BFCL_CACHE")
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gpurig" / "bfcl"


def download_command(where: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
            f"bfcl-eval=={BFCL_VERSION}", "-d", str(where)]  # fmt: skip


def wheel_path(download: bool = True) -> Path:
    """The cached wheel, downloaded (pip, no dependencies) when missing and `download`."""
    where = cache_dir()
    wheel = where / WHEEL
    if wheel.is_file() or not download:
        return wheel
    where.mkdir(parents=True, exist_ok=True)
    shown = " ".join(download_command(where)[2:])
    try:
        done = subprocess.run(
            download_command(where), capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NotFoundError(
            f"could not fetch the bfcl-eval {BFCL_VERSION} wheel: {exc}",
            f"run `python3 -m {shown}` where PyPI is reachable",
        ) from None
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise NotFoundError(
            f"could not fetch the bfcl-eval {BFCL_VERSION} wheel: {tail[0]}",
            f"run `python3 -m {shown}` where PyPI is reachable (or copy {WHEEL} there)",
        )
    return wheel


def read_lines(wheel: Path, member: str) -> list[dict[str, Any]]:
    """The JSON objects of one data file of the wheel (BFCL writes one object per line)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            text = z.read(member).decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise NotFoundError(
            f"{wheel} has no readable {member}: {exc}",
            f"delete {wheel} so it is fetched again",
        ) from None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def openai_name(name: str) -> str:
    return name.replace(".", "_")


def json_schema(spec: Any) -> Any:
    """A BFCL parameter schema in JSON Schema's words, recursively."""
    if isinstance(spec, list):
        return [json_schema(s) for s in spec]
    if not isinstance(spec, dict):
        return spec
    out = {}
    for key, value in spec.items():
        if key == "type" and isinstance(value, str):
            out[key] = JSON_TYPES.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: json_schema(v) for k, v in value.items()}
        elif key == "items":
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def as_tool(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": openai_name(function["name"]),
            "description": function.get("description", ""),
            "parameters": json_schema(function.get("parameters") or {"type": "dict"}),
        },
    }


def has_answers(category: str) -> bool:
    """Irrelevance has no possible answers: the right reply is no call at all."""
    return "irrelevance" not in category


def load(category: BfclCategory, wheel: Path | None = None) -> list[Question]:
    """The category's questions, each with its functions as tools and its possible answers."""
    wheel = wheel or wheel_path()
    questions = read_lines(wheel, f"bfcl_eval/data/BFCL_v4_{category}.json")
    answers: dict[str, Any] = {}
    if has_answers(category):
        member = f"bfcl_eval/data/possible_answer/BFCL_v4_{category}.json"
        answers = {a["id"]: a["ground_truth"] for a in read_lines(wheel, member)}
    out = []
    for q in questions:
        functions = q["function"]
        out.append(
            Question(
                id=q["id"],
                messages=q["question"][0],
                tools=[as_tool(f) for f in functions],
                answer=answers.get(q["id"]),
                scoring="bfcl",
                function=functions[0] if len(functions) == 1 else None,
                functions=functions,
                category=category,
            )
        )
    return out
