"""`evaluate` against real servers on loopback, no mock anywhere:
- the engine twice on one random-weight tiny checkpoint: every answer the same, on all three
  suites (BFCL simple with its tools, a JSONL file, the recall test), McNemar p = 1;
- a scripted checkpoint (tests/server_support.py: the real engine, weights set so the greedy
  reply is chosen text) that answers known questions right, a BFCL call among them: the scores
  are what they should be;
- resume after a torn write, and a server that is not there;
- the engine against vLLM's CPU build on the same checkpoint (the session's shared server).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_support import REPO, ServerProcess, make_scripted_checkpoint

from bench.eval import EvalRequest, ServerSpec, evaluate
from bench.eval.run import find_run_dir
from bench.eval.store import RunStore
from engine.checkpoint_maker import make_checkpoint
from tools.errors import GpurigError

pytestmark = pytest.mark.slow

END_OF_PROMPT = 101  # "<channel|>": the end of a thinking-off generation prompt
END_OF_TURN = 106
TOOL_CALL, END_CALL, TOOL_RESPONSE = 48, 49, 50
CALL = "call:calculate_triangle_area{base:10,height:5}"
QUESTIONS = [
    {"id": "height", "prompt": "A triangle: base 10, height 5. Its height?", "answer": "#### 5"},
    {"id": "five", "prompt": "Write the number five.", "answer": 5},
    {"id": "area", "prompt": "A triangle: base 10, height 5. Its area?", "answer": "#### 25"},
    {"id": "word", "messages": [{"role": "user", "content": "Capital of France?"}],
     "answer": "Paris"},
]  # fmt: skip


def _start(*dirs: Path) -> list[ServerProcess]:
    with ThreadPoolExecutor(len(dirs)) as pool:  # start-ups overlap: about 6 s each alone
        return list(pool.map(ServerProcess, dirs))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two engines on one random checkpoint, and one scripted to call BFCL's simple_python_0
    function right (given no tools, its reply is that call as text: the last number 5)."""
    root = tmp_path_factory.mktemp("eval")
    make_checkpoint(root / "tiny", preset="tiny", seed=0)
    make_scripted_checkpoint(
        root / "calls", [[END_OF_PROMPT, TOOL_CALL, CALL, END_CALL, TOOL_RESPONSE]]
    )
    procs = _start(root / "tiny", root / "tiny", root / "calls")
    yield dict(zip(["a", "b", "calls"], procs, strict=True))
    for p in procs:
        p.stop()


@pytest.fixture
def questions(tmp_path: Path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def _spec(server: ServerProcess, name: str | None = None) -> ServerSpec:
    return ServerSpec(base_url=server.base, name=name)


def _rows(result) -> list[dict]:
    return [json.loads(line) for line in Path(result.answers_path).read_text().splitlines()]


@pytest.mark.parametrize(
    "suite",
    [
        {"suite": "jsonl"},
        {"suite": "recall", "recall_tokens": 300, "limit": 2},
        {"suite": "bfcl", "limit": 3},
    ],  # fmt: skip
    ids=lambda s: s["suite"],
)
def test_the_engine_twice_gives_the_same_answers(servers, questions, tmp_path, suite) -> None:
    kw = {"path": str(questions)} if suite["suite"] == "jsonl" else {}
    try:
        result = evaluate(
            EvalRequest(
                servers=[_spec(servers["a"]), _spec(servers["b"])],
                max_tokens=8,
                out_dir=str(tmp_path / "run"),
                **suite,
                **kw,
            )  # fmt: skip
        )
    except GpurigError as exc:
        if "bfcl-eval" in exc.message:
            pytest.skip(exc.message)
        raise
    p = result.paired
    print(result.model_dump_json(indent=1))
    assert p is not None and result.questions == len(_rows(result)) > 1
    assert p.same_answer == result.questions and p.differing_ids == []
    assert p.only_a == p.only_b == 0 and p.mcnemar_p == 1.0
    assert result.totals[0].right == result.totals[1].right
    assert Path(result.report).read_text().startswith(f"# Evaluation {result.run_id}")


def test_a_scripted_server_scores_what_it_should(servers, questions, tmp_path) -> None:
    """The scripted server's reply is its call as text: right on 'height' and 'five' (last
    number 5), wrong on 'area' and 'word'; paired with a random-weight engine (right on none)."""
    result = evaluate(
        EvalRequest(
            servers=[_spec(servers["calls"], "scripted"), _spec(servers["a"], "random")],
            path=str(questions),
            max_tokens=8,
            out_dir=str(tmp_path / "run"),
        )  # fmt: skip
    )
    scripted, random_ = result.totals
    assert (scripted.right, scripted.answered) == (2, 4)
    assert random_.right == 0
    p = result.paired
    assert (p.both_right, p.only_a, p.only_b, p.both_wrong) == (0, 2, 0, 2)
    assert p.only_a_ids == ["height", "five"] and p.mcnemar_p == 0.5
    verdicts = {r["id"]: r["answers"]["scripted"] for r in _rows(result)}
    assert CALL in verdicts["height"]["text"] and "last number 5" in verdicts["height"]["why"]
    assert "expected 25" in verdicts["area"]["why"]


def test_a_scripted_bfcl_call_is_scored_right(servers, tmp_path) -> None:
    try:
        result = evaluate(
            EvalRequest(
                servers=[_spec(servers["calls"])],
                suite="bfcl",
                limit=3,
                max_tokens=16,
                out_dir=str(tmp_path / "run"),
            )  # fmt: skip
        )
    except GpurigError as exc:
        pytest.skip(exc.message)
    rows = {r["id"]: r["answers"]["a"] for r in _rows(result)}
    first = rows["simple_python_0"]
    assert first["tool_calls"] == [
        {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}
    ]
    assert first["right"], first
    assert not rows["simple_python_1"]["right"]
    assert "called 'calculate_triangle_area'" in rows["simple_python_1"]["why"]
    assert result.paired is None and result.totals[0].right == 1


def test_resume_asks_only_what_a_kill_lost(servers, questions, tmp_path) -> None:
    """A run whose answers.jsonl ends in a torn line (killed mid-write) is continued through
    the CLI: the whole lines are kept, the rest asked, the result the same as in one go."""
    out = tmp_path / "run"
    request = EvalRequest(servers=[_spec(servers["a"]), _spec(servers["calls"])],
                          path=str(questions), max_tokens=8, out_dir=str(out))  # fmt: skip
    whole = evaluate(request)
    store = RunStore(out)
    lines = store.answers_path.read_bytes().splitlines(keepends=True)
    store.answers_path.write_bytes(lines[0] + lines[1][:25])
    done = subprocess.run(
        [sys.executable, "-m", "mcp_server.cli", "eval", "--resume", str(out), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    resumed = json.loads(done.stdout)
    assert resumed["asked_now"] == 3 and resumed["questions"] == 4
    assert resumed["totals"] == json.loads(whole.model_dump_json())["totals"]
    assert sorted(r["id"] for r in _rows(whole)) == sorted(q["id"] for q in QUESTIONS)
    assert find_run_dir(str(out)) == out.resolve()
    again = evaluate(EvalRequest(resume=str(out)))
    assert again.asked_now == 0 and again.paired == whole.paired


def test_a_server_that_is_not_there_is_refused(questions, tmp_path) -> None:
    from server_support import free_port

    with pytest.raises(GpurigError) as err:
        evaluate(EvalRequest(servers=[ServerSpec(base_url=f"http://127.0.0.1:{free_port()}")],
                             path=str(questions), out_dir=str(tmp_path / "run")))  # fmt: skip
    assert "cannot reach server a" in err.value.message
    assert not (tmp_path / "run" / "run.json").exists()  # nothing half-written


def test_engine_and_vllm_agree_on_the_same_checkpoint(vllm_cpu_server, questions, tmp_path):
    engine = ServerProcess(Path(vllm_cpu_server.model))
    try:
        for suite in ({"suite": "jsonl", "path": str(questions)},
                      {"suite": "recall", "recall_tokens": 300, "limit": 4}):  # fmt: skip
            result = evaluate(
                EvalRequest(servers=[ServerSpec(base_url=engine.base, name="engine"),
                                     ServerSpec(base_url=vllm_cpu_server.base, name="vllm")],
                            max_tokens=8, out_dir=str(tmp_path / suite["suite"]), **suite)
            )  # fmt: skip
            print(result.model_dump_json(indent=1))
            for row in _rows(result):
                print(json.dumps(row)[:600])
            p = result.paired
            assert p is not None and p.same_answer >= result.questions - 1, p
    finally:
        engine.stop()
