"""Programmatic dependent launch (PDL): a kernel of the decode step starts while the one before
it is still finishing, and requests what does not depend on it (its weights) before it waits.

Why: the decode step is hundreds of short dependent kernels (lab/journal.md, v19: 384 at one
row), and each one pays a launch, a ramp and a first round trip to memory before it streams
anything. With PDL (sm_90 on, CUDA 12.3 on; kept by stream capture as a programmatic edge of
the graph) the launch and the first weight loads overlap the previous kernel's tail.

The contract every kernel that declares `PDL: tl.constexpr = False` keeps:
- before `wait_inputs(PDL)` it only reads memory that no kernel of the step writes (weights,
  scales, and what the host wrote before the replay: positions, sequence slots, block tables)
  and writes nothing, since the kernel before it may still be reading and writing. The one
  exception is what a step's head makes of the host's inputs (the token pick's int32 slots,
  engine/kernels/step_inputs.py): a kernel starts only once every program of the kernel
  before it has passed its own wait, so what it reads before its wait was finished two
  kernels earlier; the attention kernels, which read the slots early, come far later;
- every program calls `wait_inputs` once, unconditionally: it returns when the previous
  kernel has finished and its writes are visible. Since every kernel waits for the one before,
  a kernel also sees everything earlier kernels wrote;
- `wait_inputs` then lets the next kernel launch (its programs wait in turn).

`engine.kernels.launch.run_kernel` adds `PDL=True` and Triton's `launch_pdl` to the kernels
that declare PDL inside `pdl_launches()`: engine/fast/batch_graph.py captures the decode graphs
of few rows so, where EngineOptions.pdl asks for it and `pdl_supported` says the device and
Triton can. Kernels that do not declare it, and every launch outside the block, start after
the whole kernel before them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_inputs(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
