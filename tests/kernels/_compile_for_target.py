"""Compile the decode attention's split kernel for GPU targets without a GPU (Triton's own
ptxas), as DecodeAttention would configure it there; print one JSON line per case.

Run as a script in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit).
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.attention_decode import _attn_split_kernel, dot_for_capability, split_tiling


def main(targets: list[int]) -> None:
    for sm in targets:
        use_dot = dot_for_capability((sm // 10, sm % 10))
        for head_dim, ring in ((512, False), (256, True)):
            block_s, heads_padded, warps = split_tiling(head_dim, 8, use_dot)
            sig = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr")}
            sig |= {"pos_ptr": "*i64", "kpos_ptr": "*i64", "po_ptr": "*fp32", "pm_ptr": "*fp32",
                    "pl_ptr": "*fp32", "S": "i32", "window": "i32", "scale": "fp32",
                    "stride_qh": "i32", "stride_ks": "i32", "stride_vs": "i32"}  # fmt: skip
            consts = {"H": 8, "HP": heads_padded, "D": head_dim, "BLOCK_S": block_s,
                      "RING": ring, "USE_DOT": use_dot, "HAS_KPOS": ring, "PDL": sm >= 90}  # fmt: skip
            sig |= {name: "constexpr" for name in consts}
            compiled = triton.compile(
                ASTSource(fn=_attn_split_kernel, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", sm, 32),
                options={"num_warps": warps, "num_stages": 2},
            )
            print(json.dumps({"sm": sm, "head_dim": head_dim, "use_dot": use_dot,
                              "shared": compiled.metadata.shared,
                              "mma": "mma" in compiled.asm["ptx"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
