"""Programmatic dependent launch (engine/kernels/pdl.py): every kernel the engine launches keeps
the contract (declares PDL and waits for its inputs), `run_kernel` asks for PDL only where it
is asked for and declared, the sm_90 binaries request the weights before the wait and the activations
after it, and on a Hopper GPU an engine with PDL makes the same tokens as one without."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
from compile_support import compiled_rows, mma_ptx
from engine_support import overlapping_tokens

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.fast.batch_graph import PDL_DRIVER, _driver_version, pdl_supported
from engine.kernels import launch
from engine.options import EngineOptions

KERNELS = Path(engine.__file__).parent / "kernels"


def _launched_kernels() -> list[tuple[str, str]]:
    """(module, kernel name) of every `run_kernel(<kernel>, ...)` call in engine/kernels."""
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "run_kernel" and isinstance(node.args[0], ast.Name)):  # fmt: skip
                found.append((f"engine.kernels.{path.stem}", node.args[0].id))
    return found


def test_every_launched_kernel_declares_pdl_and_waits_for_its_inputs() -> None:
    kernels = _launched_kernels()
    assert len(kernels) >= 15  # the decode step's, the prompt pass's and the dequant kernels
    for module, name in kernels:
        kernel = getattr(importlib.import_module(module), name)
        assert "PDL" in kernel.arg_names, f"{module}.{name} does not declare PDL"
        assert inspect.signature(kernel.fn).parameters["PDL"].default is False, name
        body = inspect.getsource(kernel.fn)
        assert body.count("wait_inputs(PDL)") == 1, f"{module}.{name} must wait once"


class _Recorder:
    """Stands for a compiled kernel: what `kernel[grid](...)` was given (no launch here)."""

    def __init__(self, arg_names: list[str]) -> None:
        self.arg_names = arg_names
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append({"grid": grid, **kwargs})


def test_run_kernel_asks_for_pdl_only_when_set_and_declared() -> None:
    declares, plain = _Recorder(["x_ptr", "PDL"]), _Recorder(["x_ptr"])
    launch.run_kernel(declares, (1,), 0, num_warps=4)
    with launch.pdl_launches():
        assert launch.pdl_enabled()
        launch.run_kernel(declares, (2,), 0, num_warps=4)
        launch.run_kernel(plain, (3,), 0, num_warps=4)
        with launch.pdl_launches(False):
            launch.run_kernel(declares, (4,), 0, num_warps=4)
    launch.run_kernel(declares, (5,), 0, num_warps=4)
    assert not launch.pdl_enabled()
    assert declares.calls == [
        {"grid": (1,), "num_warps": 4},
        {"grid": (2,), "num_warps": 4, "PDL": True, "launch_pdl": True},
        {"grid": (4,), "num_warps": 4},
        {"grid": (5,), "num_warps": 4},
    ]
    assert plain.calls == [{"grid": (3,), "num_warps": 4}]


def test_pdl_only_on_hopper_and_later() -> None:
    assert not pdl_supported(torch.device("cpu"))
    if torch.cuda.is_available():
        expect = torch.cuda.get_device_capability() >= (9, 0) and _driver_version() >= PDL_DRIVER
        assert pdl_supported(torch.device("cuda")) == expect


def _compile_for_targets(targets: list[int]) -> None:
    """One JSON line per target: where the mma product's and the GEMV's loads sit against the
    wait in their PTX with PDL on (sm_90) or off. Run as a script (no interpreter)."""
    import json

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from engine.kernels import attention_paged, w4gemv_kernel

    def ptx_of(fn, sig, consts, warps):
        src = ASTSource(fn=fn, signature=sig | dict.fromkeys(consts, "constexpr"),
                        constexprs=consts)  # fmt: skip
        return compile(src, target=GPUTarget("cuda", sm, 32),
                       options={"num_warps": warps, "num_stages": 1}).asm["ptx"]  # fmt: skip

    def around_wait(ptx: str, loads: str) -> dict:
        at = ptx.find("griddepcontrol.wait")
        head, tail = (ptx[:at], ptx[at:]) if at >= 0 else ("", ptx)
        return {"waits": ptx.count("griddepcontrol.wait"),
                "launches": ptx.count("griddepcontrol.launch_dependents"),
                "launch_first": "griddepcontrol.launch_dependents" in head,
                "before": head.count(loads), "after": tail.count(loads)}  # fmt: skip

    for sm in targets:
        pdl = sm >= 90
        ptx = mma_ptx(sm, 4, AHEAD=True, PDL=pdl)
        weights = around_wait(ptx, "ld.global.nc.v4.b32")
        acts = around_wait(ptx, "ld.global.v4.b32")
        gemv_ptrs = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "aux_ptr", "py_ptr", "ph_ptr", "pwp_ptr",
                     "psc_ptr", "pwn_ptr", "ph_out_ptr")  # fmt: skip
        sig = {n: "*i32" if n == "w_ptr" else "*bf16" for n in gemv_ptrs}
        sig |= dict.fromkeys(("N", "K", "KW", "G", "stride_xm", "stride_ym", "stride_am"), "i32")
        sig["eps"] = "fp32"
        consts = {"BLOCK_N": 4, "BLOCK_KW": 64, "EVEN_K": True, "USE_ASM": True, "H2": True,
                  "EPI": 0, "PIPE": True, "PRO": False, "PRO_SCALAR": False, "PRO_NEXT": False,
                  "BLOCK_P": 16, "PDL": pdl}  # fmt: skip
        gemv = around_wait(ptx_of(w4gemv_kernel._w4_gemv_kernel, sig, consts, 4), "ld.global")
        # the paged attention (a full layer's tiles): the row's position and slot before the
        # wait, the table, q, keys and values after it; the combine: the position before
        att_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64",
                   "seq_ptr": "*i32", "bt_ptr": "*i32", "po_ptr": "*fp32", "pm_ptr": "*fp32",
                   "pl_ptr": "*fp32", "scale": "fp32"}  # fmt: skip
        att_sig |= dict.fromkeys(("R", "window", "max_keys", "stride_qb", "stride_qh",
                                  "stride_ks", "stride_vs", "stride_bt"), "i32")  # fmt: skip
        att_consts = {"H": 8, "HP": 16, "D": 512, "BLOCK_S": 32, "BLOCK_KV": 16, "RING": False,
                      "USE_DOT": True, "PDL": pdl}  # fmt: skip
        split = around_wait(ptx_of(attention_paged._paged_split_kernel, att_sig, att_consts, 4),
                            "ld.global")  # fmt: skip
        comb_sig = {"po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pos_ptr": "*i64",
                    "o_ptr": "*bf16"}  # fmt: skip
        comb_sig |= dict.fromkeys(("R", "window", "max_keys", "P", "stride_ob", "stride_oh"),
                                  "i32")  # fmt: skip
        comb_consts = {"H": 8, "D": 512, "BLOCK_D": 32, "BLOCK_S": 32, "BLOCK_P": 64,
                       "CHUNK_P": 64, "RING": False, "PDL": pdl}  # fmt: skip
        combine = around_wait(ptx_of(attention_paged._paged_combine_kernel, comb_sig,
                                     comb_consts, 4), "ld.global")  # fmt: skip
        print(json.dumps({"sm": sm, "mma_weights": weights, "mma_acts": acts, "gemv": gemv,
                          "split": split, "combine": combine}), flush=True)  # fmt: skip


def test_hopper_binaries_request_weights_before_the_wait_and_activations_after() -> None:
    """Weights (and the attention's host-written position and slot) before the wait, the
    step's activations after it, in the sm_90 PTX; sm_80 has no wait at all."""
    rows = {row["sm"]: row for row in compiled_rows(__file__, [80, 90])}
    hopper, ampere = rows[90], rows[80]
    assert hopper["mma_weights"]["waits"] == 1 and hopper["mma_weights"]["launches"] == 1
    assert hopper["mma_weights"]["before"] >= 2  # the first step's two weight rows
    assert hopper["mma_acts"]["before"] == 0 and hopper["mma_acts"]["after"] >= 4
    assert hopper["gemv"]["before"] >= 1 and hopper["gemv"]["after"] >= 1
    for part in ("mma_weights", "gemv"):  # the next kernel launches after the wait
        assert not hopper[part]["launch_first"]
    # the attention reads only what the host wrote before the wait: position and slot (split),
    # position (combine); everything a kernel of the step writes after it
    assert hopper["split"]["before"] == 2 and hopper["split"]["after"] >= 4
    assert hopper["combine"]["before"] == 1 and hopper["combine"]["after"] >= 2
    for part in ("mma_weights", "gemv", "split", "combine"):
        assert ampere[part]["waits"] == 0 and ampere[part]["launches"] == 0  # nothing to wait


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and pdl_supported(torch.device("cuda"))),
    reason="needs an sm_90+ GPU (programmatic dependent launch)",
)
def test_an_engine_with_pdl_makes_the_tokens_of_one_without(tmp_path) -> None:
    """Greedy tokens of eight overlapping requests (batched graph steps, pass graphs) and of
    one alone (the one-row graph) with PDL and without, in fp32 on the small preset. fp32:
    which rows share a step depends on timing, and in bf16 another bucket's product rounds
    one near tie of this prompt set the other way in about one run of two, with PDL or
    without (bench/NOTES.md v22)."""
    make_checkpoint(tmp_path, preset="small", seed=5, emb4=True)

    def rows(pdl: bool):
        return lambda eng: assert_pdl_rows(eng, 8 if pdl else 0)

    fp32 = torch.float32
    with_pdl = overlapping_tokens(tmp_path, EngineOptions(pdl=True), dtype=fp32, check=rows(True))
    assert with_pdl == overlapping_tokens(tmp_path, EngineOptions(pdl=False), dtype=fp32,
                                          check=rows(False))  # fmt: skip


def assert_pdl_rows(eng, rows: int) -> None:
    assert eng.runner.graphs.pdl_rows == rows


if __name__ == "__main__":
    _compile_for_targets([int(a) for a in sys.argv[1:]])
