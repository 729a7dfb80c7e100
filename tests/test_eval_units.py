"""bench.eval without servers: the BFCL checker (on hand-made calls and on the shipped
questions and possible answers), text scoring, the intervals, McNemar's exact p against known
tables, the question-file refusals, and the run store's torn-line repair that resume relies on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.eval.models import Answer, EvalRequest, Question, Row, RunConfig, ServerSpec
from bench.eval.score_bfcl import check_call
from bench.eval.score_text import score_exact, score_last_number
from bench.eval.stats import mcnemar_exact, wilson
from bench.eval.store import RunStore
from bench.eval.suites import bfcl, jsonl
from tools.errors import InvalidInputError, NotFoundError

TRIANGLE = {
    "name": "calculate_triangle_area",
    "parameters": {
        "type": "dict",
        "properties": {
            "base": {"type": "integer"},
            "height": {"type": "integer"},
            "unit": {"type": "string"},
        },
        "required": ["base", "height"],
    },
}
TRIANGLE_TRUTH = [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]


def call(name: str = "calculate_triangle_area", **args: object) -> list[dict]:
    return [{"name": name, "arguments": args}]


@pytest.mark.parametrize(
    ("calls", "right", "why"),
    [
        (call(base=10, height=5), True, "match"),
        (call(base=10, height=5, unit="Units"), True, "match"),  # case-insensitive strings
        (call(base="10", height=5), False, "str '10' where the schema says integer"),
        (call(base=10.0, height=5), False, "float 10.0 where the schema says integer"),
        (call(base=True, height=5), False, "bool True where the schema says integer"),
        (call(base=10), False, "missing required argument 'height'"),
        (call(base=10, height=5, colour="red"), False, "unexpected argument 'colour'"),
        (call(base=10, height=6), False, "height=6 is none of [5]"),
        (call("triangle_area", base=10, height=5), False, "not 'calculate_triangle_area'"),
        ([], False, "no function call"),
        (call(base=10, height=5) * 2, False, "2 calls where 1 expected"),
    ],
)
def test_checker_on_a_known_question(calls: list[dict], right: bool, why: str) -> None:
    verdict = check_call(TRIANGLE, calls, TRIANGLE_TRUTH)
    assert verdict.right is right
    assert why in verdict.why


def test_checker_floats_lists_dicts_and_optional_parameters() -> None:
    fn = {
        "name": "f",
        "parameters": {
            "type": "dict",
            "properties": {
                "rate": {"type": "float"},
                "cities": {"type": "array", "items": {"type": "string"}},
                "opts": {"type": "dict", "properties": {"k": {"type": "integer"}}},
                "when": {"type": "string"},
            },
            "required": ["rate"],
        },
    }
    truth = [{"f": {"rate": [0.5, 1.0], "cities": [["New York", "Paris"]], "opts": [{"k": [1]}, ""],
                    "when": ["April 1, 2024"]}}]  # fmt: skip
    ok = {"rate": 1, "cities": ["new york", "PARIS"], "when": "april 1 2024"}
    assert check_call(fn, call("f", **ok), truth).right  # an int for a float, std. strings
    assert check_call(fn, call("f", **ok, opts={"k": 1}), truth).right
    assert not check_call(fn, call("f", **ok, opts={"k": 2}), truth).right
    assert not check_call(fn, call("f", **{**ok, "cities": ["Paris", "New York"]}), truth).right
    assert not check_call(fn, call("f", **{**ok, "cities": ["Paris", 3]}), truth).right
    missing_when = {k: v for k, v in ok.items() if k != "when"}
    verdict = check_call(fn, call("f", **missing_when), truth)
    assert not verdict.right and "not optional" in verdict.why


@pytest.fixture(scope="module")
def shipped() -> list[Question]:
    """BFCL v4 simple_python from the real wheel (downloaded once into the cache), or a skip."""
    try:
        return bfcl.load("simple_python")
    except NotFoundError as exc:
        pytest.skip(f"no bfcl-eval wheel: {exc.message}")


def _concrete(option: object) -> object:
    """One value an option stands for: a dict of options becomes a dict of first options."""
    if isinstance(option, dict):
        return {k: _concrete(_first(v)) for k, v in option.items() if _first(v) != ""}
    if isinstance(option, list) and option and all(isinstance(o, dict) for o in option):
        return [_concrete(o) for o in option]
    return option


def _first(options: list) -> object:
    return next((o for o in options if o != ""), "")


def _first_options(truth: list[dict]) -> dict:
    """A call made of each parameter's first non-empty option: what a right model says."""
    ((name, options),) = truth[0].items()
    args = {k: _concrete(_first(v)) for k, v in options.items() if _first(v) != ""}
    return {"name": name, "arguments": args}


def test_every_shipped_possible_answer_passes_the_checker(shipped: list[Question]) -> None:
    assert len(shipped) == 400
    assert shipped[0].id == "simple_python_0"
    wrong = [q.id for q in shipped if not check_call(q.function, [_first_options(q.answer)], q.answer).right]  # fmt: skip
    assert wrong == []


def test_shipped_answers_with_wrong_types_and_missing_arguments_fail(
    shipped: list[Question],
) -> None:
    changed = 0
    for q in shipped:
        good = _first_options(q.answer)
        required = q.function["parameters"].get("required") or []
        props = q.function["parameters"]["properties"]
        ints = [k for k, v in good["arguments"].items() if props[k]["type"] == "integer"]
        if required:
            args = {k: v for k, v in good["arguments"].items() if k != required[0]}
            verdict = check_call(q.function, [{**good, "arguments": args}], q.answer)
            assert not verdict.right and required[0] in verdict.why, q.id
            changed += 1
        if ints:
            args = {**good["arguments"], ints[0]: str(good["arguments"][ints[0]]) + ".5"}
            assert not check_call(q.function, [{**good, "arguments": args}], q.answer).right, q.id
    assert changed > 300


def test_bfcl_tools_are_json_schema_with_openai_names(shipped: list[Question]) -> None:
    dotted = next(q for q in shipped if "." in q.function["name"])
    tool = dotted.tools[0]["function"]
    assert "." not in tool["name"] and tool["name"] == dotted.function["name"].replace(".", "_")
    assert tool["parameters"]["type"] == "object"
    text = json.dumps([q.tools for q in shipped])
    assert '"type": "dict"' not in text and '"type": "float"' not in text


def test_last_number_and_exact_scoring() -> None:
    assert score_last_number("so 17*23 = 391.", "#### 391")[0]
    assert score_last_number("The answer is 1,186", "Janet ... #### 1186")[0]
    assert score_last_number("72.0", 72)[0]
    assert not score_last_number("391 then 392", "391")[0]
    assert score_last_number(None, "5") == (False, "no number in the reply")
    assert score_exact("  Paris \n", "Paris")[0]
    assert not score_exact("paris", "Paris")[0]


def test_wilson_interval() -> None:
    low, high = wilson(1186, 1319)
    assert 0.8817 < low < 0.8818 and 0.9142 < high < 0.9143  # a seed-000 GSM8K-sized total
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(3.8415 / 13.8415, rel=1e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(0, 0) == (0.0, 1.0)


def test_mcnemar_exact_against_known_tables() -> None:
    assert mcnemar_exact(26, 26) == 1.0  # seed 000's GSM8K pair: 26 each way
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 1) == 1.0
    assert mcnemar_exact(1, 0) == 1.0  # BFCL simple: one question apart says nothing
    # b=1, c=9: 2 * (C(10,0) + C(10,1)) / 2^10 = 22/1024, by hand
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(2000, 2100) == pytest.approx(mcnemar_exact(2100, 2000))
    assert 0 < mcnemar_exact(0, 3000) < 1e-300 or mcnemar_exact(0, 3000) == 0.0
    assert math.isfinite(mcnemar_exact(5000, 5000))


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "questions.jsonl:2: not JSON"),
        ('{"id": "q2", "prompt": "x"}', "questions.jsonl:2: no 'answer'"),
        ('{"id": "q2", "answer": "x"}', "questions.jsonl:2: give 'prompt'"),
        ('{"id": "q1", "prompt": "x", "answer": 1}', "id 'q1' is already on line 1"),
        ("[1, 2]", "questions.jsonl:2: not a JSON object"),
    ],
)
def test_bad_question_lines_are_named(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "questions.jsonl"
    path.write_text('{"id": "q1", "prompt": "2+2?", "answer": "#### 4"}\n' + line + "\n")
    with pytest.raises(InvalidInputError) as err:
        jsonl.load(str(path))
    assert says in err.value.message


def test_jsonl_auto_scoring_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    rows = [{"id": 1, "prompt": "2+2?", "answer": "#### 4"}, {"id": "c", "answer": "Paris",
            "messages": [{"role": "user", "content": "Capital of France?"}]}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    qs = jsonl.load(str(path))
    assert [(q.id, q.scoring) for q in qs] == [("1", "last_number"), ("c", "exact")]
    with pytest.raises(NotFoundError):
        jsonl.load(str(tmp_path / "missing.jsonl"))


def _row(qid: str) -> Row:
    return Row(id=qid, answers={"a": Answer(text="4", right=True), "b": Answer(text="5", right=False)})  # fmt: skip


def test_store_cuts_a_torn_last_line_and_keeps_whole_ones(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    request = EvalRequest(servers=[ServerSpec(base_url="http://127.0.0.1:1")], suite="recall")
    questions = [Question(id=f"q{i}", messages=[], answer="4", scoring="exact") for i in range(3)]
    store.save_plan(RunConfig(run_id="r", request=request, servers=request.servers, questions=3), questions)  # fmt: skip
    store.append(_row("q0"))
    store.append(_row("q1"))
    whole = store.answers_path.read_bytes()
    store.answers_path.write_bytes(whole + _row("q2").model_dump_json()[:30].encode())  # killed
    assert [r.id for r in store.load_rows()] == ["q0", "q1"]
    assert [r.id for r in store.load_rows(repair=True)] == ["q0", "q1"]
    assert store.answers_path.read_bytes() == whole
    config, loaded = store.load_plan()
    assert config.run_id == "r" and [q.id for q in loaded] == ["q0", "q1", "q2"]
    with pytest.raises(NotFoundError):
        RunStore(tmp_path / "none").load_plan()


def test_requests_refused_in_plain_words() -> None:
    from bench.eval.models import build_request

    with pytest.raises(InvalidInputError, match="one or two servers"):
        build_request(servers=[])
    with pytest.raises(InvalidInputError, match="needs path"):
        build_request(servers=[{"base_url": "http://x:1"}], suite="jsonl")
    with pytest.raises(InvalidInputError, match="must start with http"):
        build_request(servers=[{"base_url": "x:1"}], suite="recall")
    assert build_request(servers=[{"base_url": "http://x:1/"}], suite="recall").servers[0].base_url == "http://x:1/v1"  # fmt: skip
