"""The dataflow probe (bench/engine/dataflow_probe.py) computes the chain it times: its tiles,
each K step read after its chunk of activations is complete, give the outputs of one launch per
product bit for bit, and every tile is counted once in its chunk. On the CPU interpreter it runs
one program (programs run one after another there, so a wait on a tile of a program not yet
started would never end); on a GPU, two per SM."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import triton
from compile_support import compiled_rows

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


def _weight_loads(sm: int) -> None:
    """Each probe kernel's global loads in its PTX for sm_<sm>, counted by instruction."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from bench.engine import dataflow_probe, persistent_probe

    ptrs = {"table_ptr": "*i64", "base_ptr": "*i64", "counts_ptr": "*i32", "bar_ptr": "*i32",
            "err_ptr": "*i32", "x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16",
            "y_ptr": "*bf16"}  # fmt: skip
    kernels = {"launch": (persistent_probe._launch_kernel, ["x_ptr", "w_ptr", "s_ptr", "y_ptr", "N", "K"], {}),
               "persistent": (persistent_probe._persistent_kernel,
                              ["table_ptr", "n_products", "bar_ptr", "err_ptr"],
                              {"PREFETCH": False, "LINES": 16}),
               "dataflow": (dataflow_probe._dataflow_kernel,
                            ["table_ptr", "base_ptr", "counts_ptr", "n_products", "err_ptr"], {})}  # fmt: skip
    for even_k in (True, False):
        consts = {"BLOCK_N": 4, "BLOCK_KW": 128, "EVEN_K": even_k, "H2": True, "USE_ASM": True,
                  "PDL": False}  # fmt: skip
        for name, (fn, args, extra) in kernels.items():
            values = consts | extra
            sig = {a: ptrs.get(a, "i32") for a in args} | dict.fromkeys(values, "constexpr")
            ptx = compile(ASTSource(fn=fn, signature=sig, constexprs=values),
                          target=GPUTarget("cuda", sm, 32),
                          options={"num_warps": 4, "num_stages": 2}).asm["ptx"]  # fmt: skip
            loads: dict[str, int] = {}
            for op in re.findall(r"ld\.global[\w.]*", ptx):
                loads[op] = loads.get(op, 0) + 1
            print(json.dumps({"sm": sm, "kernel": name, "even_k": even_k, "loads": loads}),
                  flush=True)  # fmt: skip


def test_the_probes_read_16_bytes_of_weights_at_a_time() -> None:
    """A pointer read from the product table carries no alignment, so without the tile's hint
    Triton loads the packed words 4 bytes at a time (and `launch`, whose K / 8 it cannot prove
    a multiple of 4, 8 bytes): the probes would time a slower tile than the engine's GEMV."""
    rows = compiled_rows(__file__, [90])
    assert len(rows) == 6
    for row in rows:
        loads = row["loads"]
        assert loads.get("ld.global.v4.b32", 0) >= 2, row  # the first step and the next
        assert "ld.global.b32" not in loads and "ld.global.v2.b32" not in loads, row


if __name__ == "__main__":
    for target in sys.argv[1:]:
        _weight_loads(int(target))
