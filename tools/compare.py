"""`compare_outputs`: token-level comparison of two OpenAI-compatible servers.

The same token-id prompts go to both servers, greedy (temperature 0, `ignore_eos`), asking for
the top k log-probabilities per step and the generated token ids: through /v1/completions with
vLLM's `return_token_ids` and `return_tokens_as_token_ids` (gpurig's engine server has them
too), or through llama-server's native /completion (tools/compare_client.py says how). Per prompt
the result says how many leading tokens are identical and, at the first difference, both
tokens with each side's log-probability of both (when the other's token is among its top k),
so a near-tie (both sides rate the two tokens within `near_tie` nats of each other: rounding
decides, not the model) is told from a real difference (a bug, a wrong dtype, another model).

With `reference` (a local checkpoint directory) transformers runs the same greedy prompts
in-process (tools/compare_reference.py) as the implementation both should match, and each
prompt says which side departs from it first and how close the reference itself was there: on
one checkpoint vLLM's CPU build departed after 6 tokens while our engine matched transformers
for all 24, so "they differ" alone does not tell who is wrong.

Before comparing, one text is tokenised by both servers (a `return_token_ids` probe): servers
whose tokenizers disagree do not serve the same vocabulary, and their token ids cannot be
compared. Prompts given as `texts` are tokenised by server a (and checked against b).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from tools.compare_client import CompareClient, NoPromptIds
from tools.compare_types import Output, ServerTarget, leading_token_apart
from tools.errors import InvalidInputError

if TYPE_CHECKING:
    from tools.compare_reference import ReferenceRun

DEFAULT_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are red,",
    "Water boils at 100 degrees Celsius, which is",
    "Q: What is 17 times 23?\nA:",
    "import numpy as np\nx = np.arange(10)\n",
    "The quick brown fox jumps over the lazy dog. Then the fox",
)
PROBE_TEXT = "Hello, world! 12345 caf\u00e9 \u65e5\u672c"
MAX_PROMPTS = 64
MAX_PROMPT_TOKENS = 8192
NEAR_TIE_NATS = 0.1


class CompareRequest(BaseModel):
    a: ServerTarget
    b: ServerTarget
    prompts: list[list[int]] | None = Field(
        None, max_length=MAX_PROMPTS, description="token-id prompts (default: `texts`)"
    )
    texts: list[str] | None = Field(
        None,
        max_length=MAX_PROMPTS,
        description="text prompts, tokenised by server a; default: 8 built-in ones",
    )
    max_tokens: int = Field(32, ge=1, le=1024, description="greedy tokens per prompt")
    top_logprobs: int = Field(5, ge=1, le=20, description="alternatives asked per step")
    near_tie: float = Field(
        NEAR_TIE_NATS, gt=0, le=10, description="log-probability gap (nats) that is a near-tie"
    )
    reference: str | None = Field(
        None, max_length=4096, description="a local checkpoint for transformers in-process"
    )
    reference_dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    timeout_s: float = Field(300.0, gt=0, le=3600, description="per request")


class ServerInfo(BaseModel):
    name: str
    base_url: str
    model: str


class SideAt(BaseModel):
    """One side's view of the first difference: its token and what it gave both tokens."""

    token: int
    logprob: float | None = Field(None, description="its log-probability of its own token")
    other_logprob: float | None = Field(
        None, description="its log-probability of the other side's token (None: not in its top k)"
    )
    margin: float | None = Field(
        None, description="logprob - other_logprob: how sure it was (None: other not listed)"
    )
    margin_at_least: float | None = Field(
        None, description="when the other's token is not listed: logprob - the lowest listed"
    )


class Difference(BaseModel):
    position: int = Field(description="index of the first differing new token")
    a: SideAt
    b: SideAt
    near_tie: bool


class ReferenceCheck(BaseModel):
    """The prompt against transformers: tokens each side kept, who departs first, and the
    reference's own margin (its log-probability of its token less that of the side's) there."""

    tokens: list[int]
    agreed_a: int
    agreed_b: int
    departs_first: Literal["a", "b", "both", "neither"]
    margin_at_a: float | None = None
    margin_at_b: float | None = None


class PromptComparison(BaseModel):
    index: int
    prompt_tokens: int
    agreed: int = Field(description="identical leading new tokens")
    compared: int = Field(description="tokens both returned")
    verdict: Literal["identical", "near-tie", "diverged"]
    difference: Difference | None = None
    a_tokens: list[int]
    b_tokens: list[int]
    reference: ReferenceCheck | None = None


class CompareResult(BaseModel):
    a: ServerInfo
    b: ServerInfo
    max_tokens: int
    top_logprobs: int
    near_tie: float
    reference: str | None = None
    reference_dtype: str | None = None
    prompts: list[PromptComparison]
    identical: int
    near_ties: int
    diverged: int
    min_agreed: int
    verdict: Literal["ok", "warn", "fail"] = Field(
        description="ok: all identical; warn: only near-ties; fail: a real difference"
    )
    notes: list[str] = Field(default_factory=list)
    seconds: float


# ---- comparing -----------------------------------------------------------------------------


def _side(out: Output, i: int, other: int) -> SideAt:
    own = out.logprobs[i] if i < len(out.logprobs) else None
    top = out.top[i] if i < len(out.top) else {}
    if own is None:
        own = top.get(out.tokens[i])
    other_lp = top.get(other)
    side = SideAt(token=out.tokens[i], logprob=own, other_logprob=other_lp)
    if own is not None and other_lp is not None:
        side.margin = round(own - other_lp, 6)
    elif own is not None and top:
        side.margin_at_least = round(own - min(top.values()), 6)
    return side


def compare_pair(a: Output, b: Output, near_tie: float) -> tuple[int, Difference | None]:
    """(identical leading tokens, the first difference or None)."""
    n = min(len(a.tokens), len(b.tokens))
    agreed = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), n)
    if agreed == n:
        return agreed, None
    sa, sb = _side(a, agreed, b.tokens[agreed]), _side(b, agreed, a.tokens[agreed])
    tie = all(s.margin is not None and abs(s.margin) <= near_tie for s in (sa, sb))
    return agreed, Difference(position=agreed, a=sa, b=sb, near_tie=tie)


def _reference_check(ref: ReferenceRun, a: Output, b: Output) -> ReferenceCheck:
    """Where each side departs from the reference's greedy tokens, and how sure it was there."""

    def agreed(out: Output) -> int:
        n = min(len(out.tokens), len(ref.tokens))
        return next((i for i in range(n) if out.tokens[i] != ref.tokens[i]), n)

    ka, kb = agreed(a), agreed(b)
    n = min(len(a.tokens), len(b.tokens), len(ref.tokens))
    if ka >= n and kb >= n:
        first = "neither"
    elif ka == kb:
        first = "both"
    else:
        first = "a" if ka < kb else "b"
    check = ReferenceCheck(tokens=list(ref.tokens), agreed_a=ka, agreed_b=kb, departs_first=first)
    if ka < n:
        check.margin_at_a = round(ref.margin(ka, a.tokens[ka]), 6)
    if kb < n:
        check.margin_at_b = round(ref.margin(kb, b.tokens[kb]), 6)
    return check


def _check_vocab(
    sa: CompareClient, sb: CompareClient, text: str, ids_a: list[int] | None = None
) -> str | None:
    """Refuse servers whose tokenizers differ; a leading token only one of them adds to a text
    prompt (its BOS policy: llama.cpp's GGUF adds <bos>, a tokenizer.json without a
    post-processor does not) is not a vocabulary difference: returned as a note."""
    ids_a = ids_a if ids_a is not None else sa.prompt_ids(text)
    ids_b = sb.prompt_ids(text)
    if ids_a == ids_b:
        return None
    if leading_token_apart(ids_a, ids_b):
        adds, other = (sa, sb) if len(ids_a) > len(ids_b) else (sb, sa)
        first = (ids_a if adds is sa else ids_b)[0]
        return (
            f"{adds.label} adds token {first} before a text prompt and {other.label} does not "
            f"(its BOS policy); the prompts are {sa.label}'s ids, sent as ids to both"
        )
    raise InvalidInputError(
        f"the servers tokenise the same text differently ({sa.label}: {ids_a[:16]}, "
        f"{sb.label}: {ids_b[:16]} for {text[:40]!r}): they do not share a vocabulary, so "
        "their token ids cannot be compared",
        "compare two servers of the same model (same tokenizer), e.g. vLLM and `gpurig "
        "engine serve` on one checkpoint",
    )


def compare_outputs(request: CompareRequest) -> CompareResult:
    """Greedy token ids and log-probabilities of the same prompts on two servers (see the
    module docstring); the verdict is fail when a prompt diverges beyond a near-tie."""
    started = time.perf_counter()
    if request.prompts is not None and request.texts is not None:
        raise InvalidInputError("give prompts (token ids) or texts, not both",
                                "pass one of them")  # fmt: skip
    if request.prompts is not None:
        for i, p in enumerate(request.prompts):
            if not p or len(p) > MAX_PROMPT_TOKENS or any(t < 0 for t in p):
                raise InvalidInputError(
                    f"prompt {i} must be 1 to {MAX_PROMPT_TOKENS} token ids, none negative",
                    "pass token ids of the servers' tokenizer",
                )
    reference = None
    if request.reference is not None:
        from tools.compare_reference import check_checkpoint

        check_checkpoint(Path(request.reference))
    notes: list[str] = []
    sa = CompareClient(request.a, "a", request.timeout_s)
    sb = CompareClient(request.b, "b", request.timeout_s)
    try:
        for s in (sa, sb):
            s.resolve_model()
        if sa.label == sb.label:
            sb.label += "-2"
        if request.prompts is not None:
            prompts = [list(p) for p in request.prompts]
            try:
                notes += filter(None, [_check_vocab(sa, sb, PROBE_TEXT)])
            except NoPromptIds as exc:  # token-id prompts still compare; say what was not checked
                notes.append(f"vocabularies not checked: {exc.message}")
        else:
            texts = list(request.texts or DEFAULT_TEXTS)
            prompts = [sa.prompt_ids(t) for t in texts]
            checks = [_check_vocab(sa, sb, texts[0], prompts[0]), _check_vocab(sa, sb, PROBE_TEXT)]
            notes += sorted(set(filter(None, checks)))
        if request.reference is not None:
            from tools.compare_reference import Reference

            reference = Reference.load(Path(request.reference), request.reference_dtype)
            try:
                probe = sa.prompt_ids(PROBE_TEXT)
            except NoPromptIds:
                probe = None
            reference.check_prompts(prompts, PROBE_TEXT, probe)
        k = request.top_logprobs
        with ThreadPoolExecutor(2) as pool:  # the two servers work at the same time
            fa = pool.submit(lambda: [sa.generate(p, request.max_tokens, k) for p in prompts])
            fb = pool.submit(lambda: [sb.generate(p, request.max_tokens, k) for p in prompts])
            outs_a, outs_b = fa.result(), fb.result()
    finally:
        sa.close()
        sb.close()
    rows = []
    for i, (p, oa, ob) in enumerate(zip(prompts, outs_a, outs_b, strict=True)):
        agreed, diff = compare_pair(oa, ob, request.near_tie)
        verdict = "identical" if diff is None else ("near-tie" if diff.near_tie else "diverged")
        row = PromptComparison(
            index=i, prompt_tokens=len(p), agreed=agreed,
            compared=min(len(oa.tokens), len(ob.tokens)), verdict=verdict, difference=diff,
            a_tokens=oa.tokens, b_tokens=ob.tokens,
        )  # fmt: skip
        if reference is not None:
            row.reference = _reference_check(reference.run(p, request.max_tokens), oa, ob)
        rows.append(row)
    if any(r.compared < request.max_tokens for r in rows):
        notes.append("a server returned fewer tokens than asked (it may not honour ignore_eos)")
    counts = {v: sum(r.verdict == v for r in rows) for v in ("identical", "near-tie", "diverged")}
    verdict = "fail" if counts["diverged"] else ("warn" if counts["near-tie"] else "ok")
    return CompareResult(
        a=ServerInfo(name=sa.label, base_url=sa.root, model=sa.model),
        b=ServerInfo(name=sb.label, base_url=sb.root, model=sb.model),
        max_tokens=request.max_tokens,
        top_logprobs=request.top_logprobs,
        near_tie=request.near_tie,
        reference=request.reference,
        reference_dtype=request.reference_dtype if request.reference else None,
        prompts=rows,
        identical=counts["identical"],
        near_ties=counts["near-tie"],
        diverged=counts["diverged"],
        min_agreed=min((r.agreed for r in rows), default=0),
        verdict=verdict,
        notes=notes,
        seconds=round(time.perf_counter() - started, 3),
    )
