"""Run a kernel test module as a script that compiles its kernel for GPU targets (Triton's own
ptxas, no GPU), outside the interpreter this directory's conftest turns on; its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def compiled_rows(script: str, targets: list[int]) -> list[dict]:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the repository (engine/) and tests/ (the helper modules a test module imports)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, script, *map(str, targets)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def ptxas_report(ptx: str, sm: int) -> str:
    """`ptxas -v`'s report (registers, spill stores and loads) on a PTX module for sm_<sm>
    (sm_90a for 90), by Triton's own ptxas. Run it in the script, not under the interpreter."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(sm)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        return subprocess.run(
            [getattr(ptxas, "path", ptxas), "-v", f"--gpu-name=sm_{sm}{'a' * (sm == 90)}", f.name,
             "-o", os.devnull], capture_output=True, text=True, check=False,
        ).stderr  # fmt: skip


# the int4 mma kernel's (engine/kernels/w4mma_kernel.py) runtime arguments and its constexprs'
# values where a compile test does not choose them
MMA_POINTERS = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "aux_ptr")
MMA_SIGNATURE = {n: "*i32" if n in ("x_ptr", "w_ptr") else "*bf16" for n in MMA_POINTERS}
MMA_SIGNATURE |= dict.fromkeys(("M", "N", "KW", "G", "STEPS", "stride_xm", "stride_ym",
                                "stride_am"), "i32")  # fmt: skip
MMA_CONSTS = {"NWN": 1, "NWK": 4, "NB": 1, "EPI": 0, "F16": False, "ASM_ON": True, "MT": 1,
              "AHEAD": False, "PDL": False}  # fmt: skip


def mma_ptx(sm: int, warps: int, **consts: object) -> str:
    """The mma kernel's PTX for sm_<sm> with `consts` over MMA_CONSTS."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from engine.kernels import w4mma_kernel

    values = MMA_CONSTS | consts
    src = ASTSource(fn=w4mma_kernel._w4_mma_kernel, constexprs=values,
                    signature=MMA_SIGNATURE | dict.fromkeys(values, "constexpr"))  # fmt: skip
    return compile(src, target=GPUTarget("cuda", sm, 32),
                   options={"num_warps": warps, "num_stages": 1}).asm["ptx"]  # fmt: skip
