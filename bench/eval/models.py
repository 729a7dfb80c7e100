"""The evaluation's pydantic models: what goes in (the servers, the suite, the decoding), one
question and its answers as stored line by line, and what comes back (totals, the paired table).

Everything written to a run's directory is one of these dumped as JSON, so a resumed run reads
exactly what the killed one wrote and a report can be rebuilt from the files alone.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tools.errors import InvalidInputError, arg, either

Suite = Literal["bfcl", "jsonl", "recall"]
Scoring = Literal["exact", "last_number", "bfcl"]
# BFCL's AST categories as the wheel names them (each a file under bfcl_eval/data/)
BfclCategory = Literal[
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


ServerUrl = Annotated[str, Field(min_length=1, description="e.g. http://127.0.0.1:8000/v1")]
ServerName = Annotated[
    str | None, Field(max_length=64, pattern=NAME_PATTERN, description="label; default a / b")
]
ServedModel = Annotated[
    str | None, Field(description="served model id; default: /v1/models' first")
]


class ServerSpec(BaseModel):
    """One OpenAI-compatible server: its base URL (with or without /v1), a label, its model."""

    model_config = ConfigDict(extra="forbid")

    base_url: ServerUrl
    name: ServerName = None
    model: ServedModel = None

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url {v!r} must start with http:// or https://")
        return v if v.endswith("/v1") else v + "/v1"


class EvalOptions(BaseModel):
    """What to ask and how, the same for every server: EvalRequest and the front doors'
    EvalArguments both take these fields, declared once here."""

    model_config = ConfigDict(extra="forbid")

    suite: Suite = "jsonl"
    path: str | None = Field(None, description="jsonl suite: the file of {id, prompt, answer}")
    scoring: Literal["exact", "last_number"] | None = Field(
        None,
        description="jsonl suite; default: last_number where answers hold '#### N' or a number",
    )
    bfcl_category: BfclCategory = Field(
        "simple_python",
        description="bfcl suite: simple_python, multiple, parallel, parallel_multiple, "
        "irrelevance, or a live_ one",
    )
    recall_tokens: int = Field(1024, ge=64, le=1_000_000, description="recall prompt size")
    limit: int | None = Field(None, ge=1, description="the first N questions only")
    max_tokens: int = Field(256, ge=1, le=65536, description="per answer")
    temperature: float = Field(0.0, ge=0, le=2, description="0: greedy")
    seed: int = Field(0, ge=0, lt=2**31)
    concurrency: int = Field(4, ge=1, le=256, description="questions in flight")
    timeout_s: float = Field(300.0, gt=0, le=3600, description="seconds per answer")
    out_dir: str | None = Field(None, description="default: GPURIG_HOME/evals/<run id>")
    resume: str | None = Field(None, description="a run's directory or id to continue")


class EvalRequest(EvalOptions):
    """What to ask, whom, and how. Greedy (temperature 0) with a fixed seed unless told."""

    servers: list[ServerSpec] = Field(default_factory=list, max_length=2)

    @model_validator(mode="after")
    def _check(self) -> EvalRequest:
        if not self.resume and not self.servers:
            raise ValueError("give one or two servers (or resume a run)")
        if not self.resume and self.suite == "jsonl" and not self.path:
            raise ValueError("the jsonl suite needs path (a JSONL file of {id, prompt, answer})")
        names = [s.name for s in self.servers if s.name]
        if len(set(names)) != len(names):
            raise ValueError("the two servers need different names")
        return self


class EvalArguments(EvalOptions):
    """`evaluate`'s arguments as the front doors take them, the two servers flat (a and b, each
    with a label and a model), so an MCP client sends {"a": URL, "suite": ...}. The tool's input
    schema and `gpurig eval`'s flags are generated from these fields; `request()` makes the
    EvalRequest, refused in plain words."""

    a: str | None = Field(None, min_length=1, description="the first server; none with resume")
    b: str | None = Field(None, min_length=1, description="a second server to pair with a")
    a_name: ServerName = Field(None, description="label of a (default a)")
    b_name: ServerName = Field(None, description="label of b (default b)")
    a_model: ServedModel = Field(None, description="a's served model; default: the first listed")
    b_model: ServedModel = Field(None, description="b's served model; default: the first listed")

    def request(self) -> EvalRequest:
        servers = [
            {"base_url": url, "name": name, "model": model}
            for url, name, model in (
                (self.a, self.a_name, self.a_model),
                (self.b, self.b_name, self.b_model),
            )
            if url
        ]
        options = {name: getattr(self, name) for name in EvalOptions.model_fields}
        return build_request(servers=servers, **options)


class Question(BaseModel):
    """One question as both servers get it: chat messages, tools for BFCL, the expected answer
    (text, or BFCL's possible answers with the functions' schemas) and how it is scored."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    answer: Any
    scoring: Scoring
    function: dict[str, Any] | None = None  # bfcl, one function offered: its BFCL schema
    functions: list[dict[str, Any]] | None = None  # bfcl: every function offered (BFCL schemas)
    category: str | None = None  # bfcl: which checker applies (None: a run from before: simple)


class Answer(BaseModel):
    """One server's reply to one question and its verdict."""

    text: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    error: str | None = None
    right: bool
    why: str = ""
    bucket: str | None = Field(None, description="why it is wrong, as a bucket (score_bfcl)")
    seconds: float = 0.0
    prompt_tokens: int | None = None
    token_ids: list[int] | None = Field(None, description="where the server returns them")


class Row(BaseModel):
    """One line of answers.jsonl: a question's id and each server's answer (name -> Answer)."""

    id: str
    answers: dict[str, Answer]


class RunConfig(BaseModel):
    """run.json: the request as it ran (servers resolved to their models), written once."""

    run_id: str
    request: EvalRequest
    servers: list[ServerSpec]
    questions: int


class Total(BaseModel):
    server: str
    base_url: str
    model: str
    right: int
    answered: int
    errors: int
    rate: float
    ci95: tuple[float, float] = Field(description="Wilson score interval of the rate")
    buckets: dict[str, int] = Field(
        default_factory=dict, description="wrong answers by bucket (wrong_tool, unparsed, ...)"
    )


class BucketPair(BaseModel):
    """One failure bucket across the pair: how often each side fails that way, and how often it
    does while the other side is right on the same question."""

    bucket: str
    a: int = Field(description="questions a got wrong this way")
    b: int = Field(description="questions b got wrong this way")
    a_fails_b_passes: int
    b_fails_a_passes: int
    both: int = Field(description="questions both got wrong this way")
    a_fails_b_passes_ids: list[str] = Field(default_factory=list)
    b_fails_a_passes_ids: list[str] = Field(default_factory=list)


class Paired(BaseModel):
    """Question by question: both right, only a, only b, both wrong, McNemar's exact p."""

    both_right: int
    only_a: int
    only_b: int
    both_wrong: int
    same_answer: int = Field(description="questions where both servers said the same thing")
    mcnemar_p: float = Field(description="exact two-sided binomial test on only_a vs only_b")
    only_a_ids: list[str]
    only_b_ids: list[str]
    differing_ids: list[str] = Field(description="questions whose answers differ, right or not")
    buckets: list[BucketPair] = Field(default_factory=list, description="failures by bucket")


class EvalResult(BaseModel):
    run_id: str
    out_dir: str
    suite: Suite
    questions: int
    asked_now: int = Field(description="questions asked in this call (the rest were on disk)")
    totals: list[Total]
    paired: Paired | None = None
    answers_path: str
    report: str
    seconds: float
    notes: list[str] = Field(default_factory=list)


def build_request(**fields: Any) -> EvalRequest:
    """An EvalRequest from the front doors' fields, its refusal in plain words (which field,
    why) as an InvalidInputError rather than pydantic's report."""
    try:
        return EvalRequest(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        what = first["msg"].removeprefix("Value error, ")
        raise InvalidInputError(
            f"{where}: {what}" if where else what,
            f"give {either(cli='URL_A [URL_B]', mcp='a (and b)')} as server URLs, "
            f"{arg('path')} for the jsonl suite, or {arg('resume')} with a run's directory",
        ) from None
