"""Programmatic dependent launch and the L2 weight prefetch (engine/kernels/pdl.py).

Neither may change a single bit of any result: they only move when a kernel starts and what
sits in L2. So on a Hopper GPU every check compares the kernels with both switched on against
the same kernels with both off, bit for bit, including chains of dependent kernels replayed
as a CUDA graph, where a missing wait would read a predecessor's half-written output. On the
CPU (CI) the switches must stay off: the interpreter has no such instructions.
"""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.fast.decode import FusedDecoder
from engine.fast.graph import GraphDecoder
from engine.generate import prefill
from engine.kernels import pdl
from engine.kernels.w4gemv import w4_gemv, w4_gemv_residual

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs a GPU of compute capability 9.0+")


def test_switches_are_off_by_default_and_on_the_cpu(monkeypatch) -> None:
    cpu = torch.zeros(1)
    monkeypatch.delenv("GPURIG_PDL", raising=False)
    monkeypatch.delenv("GPURIG_PREFETCH", raising=False)
    assert not pdl.pdl_on(cpu) and not pdl.prefetch_on(cpu)
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}
    monkeypatch.setenv("GPURIG_PDL", "1")
    monkeypatch.setenv("GPURIG_PREFETCH", "1")
    assert not pdl.pdl_on(cpu) and not pdl.prefetch_on(cpu)  # the interpreter has neither
    if torch.cuda.is_available():
        gpu = torch.zeros(1, device="cuda")
        assert pdl.pdl_on(gpu) == SM90 and pdl.prefetch_on(gpu) == SM90
        monkeypatch.delenv("GPURIG_PDL")
        monkeypatch.delenv("GPURIG_PREFETCH")
        assert not pdl.pdl_on(gpu) and not pdl.prefetch_on(gpu)


def _both(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("GPURIG_PDL", "1" if on else "0")
    monkeypatch.setenv("GPURIG_PREFETCH", "1" if on else "0")


def _weights(n: int, k: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda",
                           generator=g)  # fmt: skip
    scales = (torch.rand(n, k // 32, device="cuda", generator=g) * 0.02 + 0.002).to(dtype)
    return packed, scales


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("n", "k"), [(2560, 1536), (1536, 12288), (1000, 256), (262144, 1536)])
def test_gemv_with_prefetch_and_pdl_is_bit_identical(monkeypatch, n, k) -> None:
    packed, scales = _weights(n, k, n + k)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    cfg = {"BLOCK_N": 16, "BLOCK_KW": 64, "num_warps": 2, "num_stages": 2}  # 1000: ragged end
    _both(monkeypatch, False)
    plain = w4_gemv(x, packed, scales, config=cfg)
    _both(monkeypatch, True)
    fast = w4_gemv(x, packed, scales, config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(plain, fast)


@pytest.mark.gpu
@needs_sm90
def test_a_dependent_chain_in_a_cuda_graph_waits_for_each_predecessor(monkeypatch) -> None:
    """40 GEMVs, each reading the previous one's output (and the residual epilogue's in-place
    update), replayed as one graph with PDL: equal, bit for bit, to the chain run eagerly with
    PDL off. A kernel that read its input before the predecessor finished would differ."""
    d = 1536
    mats = [_weights(d, d, 100 + i) for i in range(40)]
    norm_w = torch.rand(d, device="cuda").to(torch.bfloat16) + 0.5

    def chain(x0: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = x0
        for i, (p, s) in enumerate(mats):
            if i % 4 == 3:  # the residual epilogue: h updated in place by the last program
                x = w4_gemv_residual(x, p, s, h, norm_w, 1e-6, w_next=norm_w)
            else:
                x = w4_gemv(x, p, s)
        return x

    x0 = torch.randn(1, d, device="cuda").to(torch.bfloat16)
    h_init = torch.randn(d, device="cuda").to(torch.bfloat16)
    _both(monkeypatch, False)
    h_plain = h_init.clone()
    expected = chain(x0, h_plain)

    _both(monkeypatch, True)
    h_graph = h_init.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x0, h_init.clone())  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x0, h_graph)
    for _ in range(3):  # every replay starts from the same residual
        h_graph.copy_(h_init)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert torch.equal(h_graph, h_plain)


@pytest.mark.gpu
@needs_sm90
def test_the_graph_decode_step_is_bit_identical_with_and_without_pdl(monkeypatch, tmp_path):
    make_checkpoint(tmp_path, preset="tiny", seed=5, emb4=True)
    eng = engine.load(tmp_path, device="cuda", dtype=torch.bfloat16, max_context=256)
    prompt = [2] + list(range(10, 50))
    logits = prefill(eng.model, eng.cache, prompt, 16)
    start = logits.argmax().view(1)
    runs = []
    for on in (False, True):
        _both(monkeypatch, on)
        cache = copy.deepcopy(eng.cache)
        cache.__dict__.pop("_gpurig_decoders", None)
        dec = GraphDecoder(eng.model, cache, FusedDecoder(eng.model, cache).step)
        tok, pos, out = start, torch.tensor([len(prompt)], device="cuda"), []
        for _ in range(12):
            step = dec(tok, pos).clone()
            out.append(step)
            tok, pos = step[0].argmax().view(1), pos + 1
        runs.append(torch.cat(out))
    assert torch.equal(runs[0], runs[1])
