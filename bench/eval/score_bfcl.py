"""Scoring a function call against BFCL's possible answers (the simple categories: one function,
one call), by its name and arguments, the way BFCL's AST checker judges them.

The rules, as BFCL's ground truth is written:
- exactly one call, to the function's own name;
- every required parameter present, no parameter the schema or the answer does not know;
- each value of the schema's type (`integer` is an int and not a bool; a `float` may be an int;
  `array`/`tuple` items of their item type; `any` takes anything); a value of the type the
  answer's own options have passes too (a string option for a number stands for a variable);
- each value among the answer's options: strings and list items compared case-insensitively
  without spaces and `,./-_*^` ("April 1, 2024" = "april 1 2024"), dicts key by key;
- a parameter left out only where its options include "" (optional).
"""

from __future__ import annotations

import re
from typing import Any

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


class Verdict(BaseModel):
    right: bool
    why: str


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


def check_call(
    function: dict[str, Any], calls: list[dict[str, Any]], ground_truth: list[dict[str, Any]]
) -> Verdict:
    """The verdict on `calls` ([{name, arguments}]) for one BFCL simple question: `function` is
    the question's function (BFCL schema), `ground_truth` its `[{name: {param: [options]}}]`."""
    if not calls:
        return Verdict(right=False, why="no function call")
    if len(calls) != len(ground_truth):
        return Verdict(right=False, why=f"{len(calls)} calls where {len(ground_truth)} expected")
    ((expected_name, options),) = ground_truth[0].items()
    call = calls[0]
    if call.get("name") != expected_name:
        return Verdict(right=False, why=f"called {call.get('name')!r}, not {expected_name!r}")
    args = call.get("arguments")
    if not isinstance(args, dict):
        return Verdict(right=False, why=f"arguments are not an object: {args!r}")
    params = function.get("parameters") or {}
    properties: dict[str, Any] = params.get("properties") or {}
    for name in params.get("required") or []:
        if name not in args:
            return Verdict(right=False, why=f"missing required argument {name!r}")
    for name, value in args.items():
        if name not in properties or name not in options:
            return Verdict(right=False, why=f"unexpected argument {name!r}")
        spec = properties[name]
        problem = _type_problem(name, value, spec, options[name])
        if problem:
            return Verdict(right=False, why=problem)
        if spec.get("type") == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not _value_matches(value, options[name]):
            return Verdict(right=False, why=f"{name}={value!r} is none of {options[name]!r}")
    for name, opts in options.items():
        if name not in args and "" not in opts:
            return Verdict(right=False, why=f"missing argument {name!r} (not optional)")
    return Verdict(right=True, why="name and arguments match")
