"""BFCL beyond simple, without servers: the multiple, parallel, parallel_multiple and irrelevance
questions as the bfcl-eval wheel ships them (and their live_ twins), every possible answer
passing the checker, calls broken one way at a time landing in their bucket, and the buckets
counted per server and paired in the result and REPORT.md."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bench.eval import buckets, report
from bench.eval.judge import judge
from bench.eval.models import Answer, EvalResult, Question, Row, ServerSpec
from bench.eval.suites import bfcl
from tools.errors import NotFoundError

WITH_ANSWERS = [
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
]
# possible answers no call can meet, BFCL's checker included: a required parameter whose only
# option is "" (507), an answer's parameter the schema lacks (862), the wrong parameter's name
# (964: `question` where the function takes `statement`)
UNPASSABLE = {
    "live_multiple": [
        "live_multiple_507-149-4",
        "live_multiple_862-181-3",
        "live_multiple_964-207-0",
    ]
}
SIZES = {"multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}


def _load(category: str) -> list[Question]:
    try:
        return bfcl.load(category)  # type: ignore[arg-type]
    except NotFoundError as exc:
        pytest.skip(f"no bfcl-eval wheel: {exc.message}")


def _first(options: list) -> Any:
    return next((o for o in options if o != ""), "")


def _concrete(option: Any) -> Any:
    """One value an option stands for: a dict of options (BFCL's dict_checker compares each key
    against its list, one level deep) becomes a dict of first options."""
    if isinstance(option, dict):
        return {k: _first(v) for k, v in option.items() if _first(v) != ""}
    if isinstance(option, list) and option and all(isinstance(o, dict) for o in option):
        return [_concrete(o) for o in option]
    return option


def right_calls(q: Question) -> list[dict]:
    """What a right model says, as the server's tool_calls: each expected call with its first
    options, under the OpenAI-safe name it was offered as (an optional parameter the answer
    lists but the schema lacks, as parallel_multiple_12's has, left out)."""
    out = []
    for expected in q.answer:
        ((name, options),) = expected.items()
        function = next(f for f in q.functions if f["name"] == name)
        known = function["parameters"].get("properties") or {}
        args = {
            k: _concrete(_first(v))
            for k, v in options.items()
            if _first(v) != "" and (k in known or "" not in v)
        }
        out.append({"name": bfcl.openai_name(name), "arguments": args})
    return out


def verdict(q: Question, calls: list[dict], text: str | None = None):
    return judge(q, Answer(right=False, tool_calls=calls, text=text))


@pytest.mark.parametrize("category", WITH_ANSWERS)
def test_every_shipped_possible_answer_passes(category: str) -> None:
    questions = _load(category)
    assert len(questions) == SIZES.get(category, len(questions)) and questions
    assert all(q.functions and len(q.tools or []) == len(q.functions) for q in questions)
    wrong = [q.id for q in questions if not verdict(q, right_calls(q)).right]
    assert wrong == UNPASSABLE.get(category, [])
    if "parallel" in category:  # order-free: the same calls reversed still pass...
        several = [q for q in questions if len(q.answer) > 1]
        assert several
        reordered = {q.id for q in several if not verdict(q, right_calls(q)[::-1]).right}
        # ...except where one call fits two expected ones (parallel_178: company_name
        # [Microsoft, Apple] in its first): BFCL matches greedily, in the answer's order
        assert reordered <= {q.id for q in several if _ambiguous(q)}


def _ambiguous(q: Question) -> bool:
    from bench.eval.score_bfcl import check_one

    calls = [{**c, "name": e and next(iter(e))} for c, e in zip(right_calls(q), q.answer, strict=True)]  # fmt: skip
    return any(
        sum(check_one(next(f for f in q.functions if f["name"] == next(iter(e))), c, e).right
            for e in q.answer) > 1
        for c in calls
    )  # fmt: skip


def _changed_value(call: dict) -> dict | None:
    for key, value in call["arguments"].items():
        if isinstance(value, int) and not isinstance(value, bool):
            return {**call, "arguments": {**call["arguments"], key: value + 1000}}
    return None


def test_parallel_calls_broken_one_way_land_in_their_bucket() -> None:
    questions = [q for q in _load("parallel") if len(q.answer) > 1]
    counts = {"call_count": 0, "parameter_value": 0, "missing_parameter": 0, "wrong_tool": 0}
    for q in questions:
        calls = right_calls(q)
        v = verdict(q, calls[:-1])
        assert (v.right, v.bucket) == (False, "call_count"), q.id
        counts["call_count"] += 1
        bad = _changed_value(calls[-1])
        if bad is not None:
            v = verdict(q, [*calls[:-1], bad])
            assert (v.right, v.bucket) == (False, "parameter_value"), (q.id, v)
            counts["parameter_value"] += 1
        required = (q.functions[0]["parameters"].get("required") or [])[:1]
        if required and required[0] in calls[0]["arguments"]:
            args = {k: v for k, v in calls[0]["arguments"].items() if k != required[0]}
            v = verdict(q, [{**calls[0], "arguments": args}, *calls[1:]])
            assert (v.right, v.bucket) == (False, "missing_parameter"), (q.id, v)
            counts["missing_parameter"] += 1
        v = verdict(q, [{**calls[0], "name": "not_offered"}, *calls[1:]])
        assert (v.right, v.bucket) == (False, "wrong_tool"), (q.id, v)
        counts["wrong_tool"] += 1
    assert min(counts.values()) > 50, counts


def test_multiple_calling_another_offered_function_is_a_wrong_tool() -> None:
    changed = 0
    for q in _load("multiple"):
        (call,) = right_calls(q)
        others = [f for f in q.functions if bfcl.openai_name(f["name"]) != call["name"]]
        if not others:
            continue
        v = verdict(q, [{**call, "name": bfcl.openai_name(others[0]["name"])}])
        assert (v.right, v.bucket) == (False, "wrong_tool"), q.id
        changed += 1
        v = verdict(q, [call, call])
        assert (v.right, v.bucket) == (False, "call_count"), q.id
    assert changed > 150


def test_multiple_parameter_type_and_unexpected_parameter() -> None:
    q = _load("multiple")[0]  # triangle_properties.get(side1: integer, ...)
    (call,) = right_calls(q)
    assert call["name"] == "triangle_properties_get" and verdict(q, [call]).right
    as_text = {**call, "arguments": {**call["arguments"], "side1": "5"}}
    assert verdict(q, [as_text]).bucket == "parameter_type"
    extra = {**call, "arguments": {**call["arguments"], "colour": "red"}}
    assert verdict(q, [extra]).bucket == "unexpected_parameter"
    assert verdict(q, [{**call, "arguments": "side1=5"}]).bucket == "unparsed"


def test_irrelevance_is_right_only_without_a_call() -> None:
    questions = _load("irrelevance")
    assert len(questions) == SIZES["irrelevance"] and all(q.answer is None for q in questions)
    q = questions[0]
    assert verdict(q, [], text="I cannot compute that with the tools I have.").right
    name = bfcl.openai_name(q.functions[0]["name"])
    v = verdict(q, [{"name": name, "arguments": {"weight": 70, "height": 1.8}}])
    assert (v.right, v.bucket) == (False, "spurious_call")
    # BFCL decodes a reply whole or not at all: arguments that are not JSON make it no call
    assert verdict(q, [{"name": name, "arguments": "weight=70"}]).right
    assert _load("live_irrelevance")


def test_text_with_a_call_is_unparsed_and_plain_text_is_no_call() -> None:
    q = _load("parallel")[0]
    gemma = '<|tool_call>call:spotify.play{artist:<|"|>Taylor Swift<|"|>,duration:20}<tool_call|>'
    assert verdict(q, [], text=gemma).bucket == "unparsed"
    assert verdict(q, [], text='{"name": "spotify_play", "arguments": {}}').bucket == "unparsed"
    assert verdict(q, [], text="Sure, enjoy the music!").bucket == "no_call"
    assert judge(q, Answer(right=False, error="HTTP 500: boom")).bucket == "error"


def test_buckets_per_server_and_paired_in_the_result_and_report() -> None:
    q = _load("parallel")[0]
    good = right_calls(q)
    says = {  # question -> (a's calls or text, b's)
        "q1": (good, good),  # both right
        "q2": (good, good[:1]),  # b: call_count, a right
        "q3": ("<|tool_call>call:spotify.play{}<tool_call|>", good),  # a: unparsed, b right
        "q4": ("no thanks", "nope"),  # both no_call
        "q5": ("<|tool_call>call:x{}<tool_call|>", good[:1]),  # a unparsed, b call_count
    }
    rows = []
    for qid, sides in says.items():
        answers = {}
        for name, said in zip("ab", sides, strict=True):
            calls, text = (said, None) if isinstance(said, list) else ([], said)
            v = verdict(copy.deepcopy(q), calls, text)
            answers[name] = Answer(tool_calls=calls, text=text, **v.model_dump())
        rows.append(Row(id=qid, answers=answers))
    servers = [ServerSpec(base_url="http://x:1", name="a"), ServerSpec(base_url="http://y:1", name="b")]  # fmt: skip
    totals = report.totals(rows, servers)
    assert totals[0].buckets == {"no_call": 1, "unparsed": 2}
    assert totals[1].buckets == {"call_count": 2, "no_call": 1}
    assert sum(totals[0].buckets.values()) == totals[0].answered - totals[0].right
    p = report.paired(rows, "a", "b")
    by = {x.bucket: x for x in p.buckets}
    assert list(by) == ["call_count", "no_call", "unparsed"]  # BUCKETS' order
    assert (by["unparsed"].a, by["unparsed"].b, by["unparsed"].a_fails_b_passes) == (2, 0, 1)
    assert by["unparsed"].a_fails_b_passes_ids == ["q3"]
    assert (by["call_count"].b_fails_a_passes, by["call_count"].b_fails_a_passes_ids) == (1, ["q2"])  # fmt: skip
    assert by["no_call"].both == 1 and by["no_call"].a_fails_b_passes == 0
    result = EvalResult(run_id="r", out_dir="/tmp/r", suite="bfcl", questions=5, asked_now=5,
                        totals=totals, paired=p, answers_path="/tmp/r/a", report="/tmp/r/R",
                        seconds=1.0)  # fmt: skip
    text = report.markdown(result)
    assert "Wrong answers by bucket" in text and "Failure buckets, paired" in text
    assert "- unparsed: a fails, b right: q3; b fails, a right: none" in text
    assert buckets.server_table(totals, "simple").splitlines()[0].split() == ["wrong", "by", "a", "b"]  # fmt: skip
    again = EvalResult.model_validate_json(result.model_dump_json())
    assert again.paired.buckets == p.buckets and again.totals[0].buckets == totals[0].buckets
