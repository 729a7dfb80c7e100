"""The persistent-kernel probe (bench/engine/persistent_probe.py) computes the chain it times:
one launch per product and one persistent launch give the same outputs bit for bit, and both
agree with the float32 chain. On the CPU interpreter the persistent kernel runs one program
(the interpreter runs programs one after another, so a barrier across several would wait for
programs that have not started); on a GPU, as many as fit at once."""

from __future__ import annotations

import pytest
import torch

from bench.engine.persistent_probe import Chain, Product, layer_products, resident_for_tests

SMALL = [Product("qkv", 96, 64), Product("o", 64, 64), Product("gate_up", 256, 64),
         Product("down", 64, 128), Product("ple_gate", 32, 64), Product("ple_proj", 64, 32)]  # fmt: skip


def test_layer_products_follow_the_e2b_shapes() -> None:
    prods = layer_products("e2b")
    assert len(prods) == 35 * 6
    by = {p.name: p for p in prods}
    assert (by["0.qkv"].n, by["0.qkv"].k) == (2560, 1536)  # 8 x 256 queries, one k and v head
    assert (by["4.qkv"].n, by["4.o"].k) == (4096 + 1024, 4096)  # a full layer: 512-wide heads
    assert by["15.qkv"].n == 2048  # a KV-shared layer computes queries only
    assert (by["15.gate_up"].n, by["15.down"].k) == (24576, 12288)  # the wide MLP
    assert (by["0.ple_gate"].n, by["0.ple_proj"].k) == (256, 256)


def test_a_product_that_reads_more_than_the_last_one_wrote_is_refused() -> None:
    with pytest.raises(ValueError, match="reads K=128"):
        Chain([Product("a", 64, 64), Product("b", 64, 128)], torch.device("cpu"))


@pytest.mark.parametrize("block_kw", [None, 8])
def test_persistent_equals_one_launch_per_product(device: torch.device, block_kw) -> None:
    chain = Chain(SMALL, device, block_n=16, num_warps=4, block_kw=block_kw)
    if block_kw is None:  # the widest step dividing every K / 8 (K = 32 -> 4 words)
        assert chain.block_kw == 4 and chain.even_k
    else:  # 8 words: the K = 32 products walk a masked step
        assert not chain.even_k
    ref = chain.reference()
    chain.run_launch()
    launched = [o.clone() for o in chain.outs]
    for o in chain.outs:
        o.zero_()
    programs = resident_for_tests(device)
    chain.run_persistent(programs, prefetch=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert chain.err.item() == 0
    assert chain.bar[0].item() == programs * len(SMALL)  # every program passed every barrier
    for a, b in zip(launched, chain.outs, strict=True):
        assert torch.equal(a, b)
    for o in chain.outs:
        o.zero_()
    chain.run_layered(programs, per_layer=3)  # q|k|v alone, then two products in one launch
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert chain.err.item() == 0
    assert chain.bar[[1, 4]].tolist() == [2 * programs] * 2  # one counter per persistent launch
    for a, b in zip(launched, chain.outs, strict=True):
        assert torch.equal(a, b)
    final = chain.outs[-1].float()
    assert final.abs().max() > 0.05  # the scales keep the chain's values from vanishing
    assert ((final - ref).norm() / ref.norm()).item() < 0.03
