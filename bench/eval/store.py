"""A run's directory, written so that a kill loses at most the questions in flight:

    run.json          the request, the servers as resolved (their models), written once
    questions.jsonl   every question as asked (the recall prompts are generated: kept here),
                      written whole and atomically before the first question is asked
    answers.jsonl     one Row per finished question (both servers' answers and verdicts),
                      appended with one write + fsync each
    results.json      the totals and the paired table, rewritten atomically at the end
    REPORT.md         the same for people
    .lock             held (flock) by the process running the run

A torn last line of answers.jsonl (the kill came mid-write) is cut off when the run resumes; a
whole line is a finished question and is never asked again.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from bench.eval.models import Question, Row, RunConfig
from tools import journal
from tools.errors import NotFoundError
from tools.fileio import write_atomic


class RunStore:
    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir).expanduser().resolve()
        self.config_path = self.dir / "run.json"
        self.questions_path = self.dir / "questions.jsonl"
        self.answers_path = self.dir / "answers.jsonl"
        self.results_path = self.dir / "results.json"
        self.report_path = self.dir / "REPORT.md"

    def exists(self) -> bool:
        return self.config_path.is_file() and self.questions_path.is_file()

    def save_plan(self, config: RunConfig, questions: list[Question]) -> None:
        """The plan, questions first: run.json's presence says both are whole."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lines = "".join(q.model_dump_json() + "\n" for q in questions)
        write_atomic(self.questions_path, lines)
        write_atomic(self.config_path, config.model_dump_json(indent=2) + "\n")

    def load_plan(self) -> tuple[RunConfig, list[Question]]:
        if not self.exists():
            raise NotFoundError(
                f"{self.dir} holds no evaluation run (no run.json and questions.jsonl)",
                "pass the directory an earlier run wrote (its out_dir), or its run id",
            )
        config = RunConfig.model_validate_json(self.config_path.read_text(encoding="utf-8"))
        text = self.questions_path.read_text(encoding="utf-8")
        return config, [Question.model_validate_json(line) for line in text.splitlines() if line]

    def append(self, row: Row) -> None:
        """One finished question, durable before the next is counted done."""
        journal.append_line(self.answers_path, (row.model_dump_json() + "\n").encode())

    def load_rows(self, repair: bool = False) -> list[Row]:
        """The finished questions on disk, in the order they finished. The first line that is
        not a whole Row ends the list; with `repair` it and anything after it are cut off."""
        return journal.read_whole_lines(self.answers_path, Row.model_validate_json, repair)

    def save_results(self, results_json: str, report: str) -> None:
        write_atomic(self.results_path, results_json)
        write_atomic(self.report_path, report)

    def running(self) -> contextlib.AbstractContextManager[None]:
        """Hold the run's lock while this process asks: a second process on the same run is
        refused instead of asking the same questions twice."""
        return journal.run_lock(
            self.dir / ".lock",
            f"the evaluation in {self.dir} is being run by another process",
            "wait for it to finish, or stop that process first",
        )
