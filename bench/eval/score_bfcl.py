"""Scoring function calls against BFCL's possible answers, by name and arguments, the way BFCL's
AST checker (bfcl_eval/eval_checker/ast_eval/ast_checker.py) judges them, with each failure put
in a bucket (wrong tool, missing or unexpected parameter, parameter type, parameter value, call
count) so two servers can be compared on *how* they fail, not only how often.

The rules for one call, as BFCL's ground truth is written:
- the function's own name;
- every required parameter present, no parameter the schema or the answer does not know;
- each value of the schema's type (`integer` is an int and not a bool; a `float` may be an int;
  `array`/`tuple` items of their item type; `any` takes anything); a value of the type the
  answer's own options have passes too (a string option for a number stands for a variable);
- each value among the answer's options: strings and list items compared case-insensitively
  without spaces and `,./-_*^` ("April 1, 2024" = "april 1 2024"), dicts key by key;
- a parameter left out only where its options include "" (optional).
The categories (BFCL's `ast_checker` dispatch): simple and multiple want exactly one call, to
the expected function among those offered; parallel (and parallel_multiple) want every expected
call, in any order, each matched by a distinct call of the reply, and no other call.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel

TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "float": (float, int),
    "number": (float, int),
    "boolean": (bool,),
    "array": (list,),
    "tuple": (list,),
    "dict": (dict,),
    "object": (dict,),
}
IGNORED = re.compile(r"[ ,./\-_*^]")

Bucket = Literal[
    "wrong_tool",  # a function other than the expected one (or none of those offered)
    "call_count",  # more or fewer calls than expected
    "missing_parameter",  # a required (or non-optional) parameter left out
    "unexpected_parameter",  # a parameter the schema or the answer does not know
    "parameter_type",  # a value of the wrong type
    "parameter_value",  # the right type, none of the possible values
    "no_call",  # plain text where a call was expected
    "unparsed",  # a call the server did not turn into tool_calls, or arguments not JSON
    "spurious_call",  # irrelevance: a call where none of the functions fits
    "wrong_answer",  # text suites: the reply is not the answer
    "error",  # no answer at all: an HTTP error or a timeout
]
BUCKETS: tuple[str, ...] = Bucket.__args__  # type: ignore[attr-defined]


class Verdict(BaseModel):
    right: bool
    why: str
    bucket: Bucket | None = None


def _wrong(bucket: Bucket, why: str) -> Verdict:
    return Verdict(right=False, why=why, bucket=bucket)


RIGHT = Verdict(right=True, why="name and arguments match")


def standard(value: Any) -> Any:
    """A string as BFCL compares it; anything else as it is."""
    return IGNORED.sub("", value).lower().replace("'", '"') if isinstance(value, str) else value


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps True apart from 1 (Python's == does not)."""
    return isinstance(a, bool) == isinstance(b, bool) and standard(a) == standard(b)


def _of_type(value: Any, kind: str) -> bool:
    allowed = TYPES.get(kind)
    if allowed is None:  # any, or a type this checker does not know: no type to hold it to
        return True
    return isinstance(value, allowed) and (bool not in allowed) == (not isinstance(value, bool))


def _type_problem(name: str, value: Any, spec: dict[str, Any], options: list[Any]) -> str | None:
    kind = str(spec.get("type", "any"))
    if any(type(o) is type(value) for o in options if o != ""):
        return None  # of the answer's own type: a variable's name where a string is listed
    if not _of_type(value, kind):
        return f"{name}: {type(value).__name__} {value!r} where the schema says {kind}"
    item_kind = (spec.get("items") or {}).get("type")
    if kind in ("array", "tuple") and item_kind:
        bad = [v for v in value if not _of_type(v, str(item_kind))]
        if bad:
            return f"{name}: item {bad[0]!r} is not {item_kind}"
    return None


def _dict_matches(value: dict[str, Any], option: Any) -> bool:
    if not isinstance(option, dict):
        return False
    for key, v in value.items():
        if key not in option or not any(_same(v, o) for o in option[key]):
            return False
    return all(key in value or "" in opts for key, opts in option.items())


def _value_matches(value: Any, options: list[Any]) -> bool:
    for option in options:
        if option == "":
            continue
        if isinstance(value, dict):
            if _dict_matches(value, option):
                return True
        elif isinstance(value, list):
            if not isinstance(option, list) or len(option) != len(value):
                continue
            if all(
                _dict_matches(v, o) if isinstance(v, dict) else _same(v, o)
                for v, o in zip(value, option, strict=True)
            ):
                return True
        elif _same(value, option):
            return True
    return False


def check_one(function: dict[str, Any], call: dict[str, Any], truth: dict[str, Any]) -> Verdict:
    """One call ({name, arguments}) against one expected call `{name: {param: [options]}}` of
    `function` (its BFCL schema): BFCL's simple_function_checker."""
    ((expected_name, options),) = truth.items()
    if call.get("name") != expected_name:
        return _wrong("wrong_tool", f"called {call.get('name')!r}, not {expected_name!r}")
    args = call.get("arguments")
    if not isinstance(args, dict):
        return _wrong("unparsed", f"arguments are not an object: {args!r}")
    params = function.get("parameters") or {}
    properties: dict[str, Any] = params.get("properties") or {}
    for name in params.get("required") or []:
        if name not in args:
            return _wrong("missing_parameter", f"missing required argument {name!r}")
    for name, value in args.items():
        if name not in properties or name not in options:
            return _wrong("unexpected_parameter", f"unexpected argument {name!r}")
        spec = properties[name]
        problem = _type_problem(name, value, spec, options[name])
        if problem:
            return _wrong("parameter_type", problem)
        if spec.get("type") == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not _value_matches(value, options[name]):
            return _wrong("parameter_value", f"{name}={value!r} is none of {options[name]!r}")
    for name, opts in options.items():
        if name not in args and "" not in opts:
            return _wrong("missing_parameter", f"missing argument {name!r} (not optional)")
    return RIGHT


def _count(calls: list[dict[str, Any]], expected: int) -> Verdict | None:
    if not calls:
        return _wrong("no_call", "no function call")
    if len(calls) != expected:
        return _wrong("call_count", f"{len(calls)} calls where {expected} expected")
    return None


def _described(functions: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next((f for f in functions if f.get("name") == name), {})


def check_call(
    function: dict[str, Any], calls: list[dict[str, Any]], ground_truth: list[dict[str, Any]]
) -> Verdict:
    """The verdict on `calls` ([{name, arguments}]) for one BFCL simple question: `function` is
    the question's function (BFCL schema), `ground_truth` its `[{name: {param: [options]}}]`."""
    return check_multiple([function], calls, ground_truth)


def check_multiple(
    functions: list[dict[str, Any]], calls: list[dict[str, Any]], ground_truth: list[dict[str, Any]]
) -> Verdict:
    """BFCL multiple (and simple): several functions offered, exactly one call expected, to the
    one the ground truth names."""
    wrong = _count(calls, len(ground_truth))
    if wrong:
        return wrong
    (expected,) = ground_truth[:1]
    return check_one(_described(functions, next(iter(expected))), calls[0], expected)


def check_parallel(
    functions: list[dict[str, Any]], calls: list[dict[str, Any]], ground_truth: list[dict[str, Any]]
) -> Verdict:
    """BFCL parallel and parallel_multiple: as many calls as expected, each expected call matched
    by a distinct call of the reply, in any order (BFCL's greedy first-match: expected calls in
    their order, each taking the first unmatched call that passes). An expected call nothing
    matches is explained by the first call of its name that failed it; a call to a function not
    expected (as many times) is a wrong tool."""
    wrong = _count(calls, len(ground_truth))
    if wrong:
        return wrong
    expected_names = Counter(next(iter(e)) for e in ground_truth)
    stray = Counter(str(c.get("name")) for c in calls) - expected_names
    if stray:  # BFCL says only "cannot find a match"; the bucket says why
        return _wrong("wrong_tool", f"called {', '.join(sorted(stray))}, not expected")
    used: set[int] = set()
    for k, expected in enumerate(ground_truth):
        name = next(iter(expected))
        function = _described(functions, name)
        misses: list[Verdict] = []
        for i, call in enumerate(calls):
            if i in used:
                continue
            verdict = check_one(function, call, expected)
            if verdict.right:
                used.add(i)
                break
            misses.append(verdict)
        else:
            named = [v for v in misses if v.bucket != "wrong_tool"]
            if named:
                return _wrong(named[0].bucket or "parameter_value", f"call {k + 1}: {named[0].why}")
            return _wrong("wrong_tool", f"call {k + 1}: no call to {name!r} left to match")
    return Verdict(right=True, why=f"all {len(ground_truth)} calls match")


def check_irrelevance(calls: list[dict[str, Any]]) -> Verdict:
    """BFCL irrelevance: none of the offered functions fits the question, so any call is wrong
    (BFCL counts a reply it cannot decode into calls as no call: right)."""
    if calls:
        names = ", ".join(str(c.get("name")) for c in calls)
        return _wrong("spurious_call", f"called {names} where no function fits")
    return Verdict(right=True, why="no function call, as none fits")
