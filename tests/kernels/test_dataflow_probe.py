"""The dataflow probe (bench/engine/dataflow_probe.py) computes the chain it times: its tiles,
each K step read after its chunk of activations is complete, give the outputs of one launch per
product bit for bit, and every tile is counted once in its chunk. On the CPU interpreter it runs
one program (programs run one after another there, so a wait on a tile of a program not yet
started would never end); on a GPU, two per SM."""

from __future__ import annotations

import pytest
import torch
import triton

from bench.engine.dataflow_probe import FlowChain
from bench.engine.persistent_probe import Product, resident_for_tests

SMALL = [Product("qkv", 96, 64), Product("o", 64, 64), Product("gate_up", 256, 64),
         Product("down", 64, 128), Product("ple_gate", 32, 64), Product("ple_proj", 64, 32)]  # fmt: skip


@pytest.mark.parametrize(("block_n", "block_kw"), [(16, None), (4, 8)])
def test_dataflow_equals_one_launch_per_product(device: torch.device, block_n, block_kw) -> None:
    chain = FlowChain(SMALL, device, block_n=block_n, num_warps=4, block_kw=block_kw)
    chain.run_launch()
    launched = [o.clone() for o in chain.outs]
    for o in chain.outs:
        o.zero_()
    programs = resident_for_tests(device)
    chain.run_dataflow(programs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert chain.err.item() == 0
    for a, b in zip(launched, chain.outs, strict=True):
        assert torch.equal(a, b)
    chunk = chain.block_kw * 8
    want = [triton.cdiv(min(chunk, p.n - c * chunk), block_n)
            for p in SMALL for c in range(triton.cdiv(p.n, chunk))]  # fmt: skip
    assert chain.counts.tolist() == want  # every tile counted once, in its own chunk
    ref = chain.reference()
    final = chain.outs[-1].float()
    assert final.abs().max() > 0.05 and ((final - ref).norm() / ref.norm()).item() < 0.03


def test_a_tile_wider_than_a_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="inside one 32-value chunk"):
        FlowChain(SMALL, torch.device("cpu"), block_n=64, block_kw=4)
