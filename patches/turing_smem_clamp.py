"""The Turing shared-memory clamp for vLLM's Triton unified attention, as data.

Why: on compute capability < 8 (Turing: T4, GTX 16xx, RTX 20xx) one thread block may use at
most `shared_memory_per_block_optin` bytes of shared memory (64 KiB). Gemma 4's full-attention
layers have head size 512; at that width vLLM's default KV tiles need more ("OutOfResources: out
of resource: shared memory, Required: 98304, Hardware limit: 65536") and the server dies while
capturing CUDA graphs. No vLLM release through 0.33.0 fixes it (vllm issues #57712, #36802).

What: in `unified_attention(...)`, once TILE_SIZE_PREFILL / TILE_SIZE_DECODE are final (after
the `use_td` clamp) and before the launch grid picks one of them, halve both while
`(BLOCK_M + 2 * tile) * head_size * element_size` exceeds a budget 4 KiB under the device's
opt-in limit, and launch with one pipeline stage. Nothing changes on capability >= 8, on a
platform that reports no capability, or where the stock tiles already fit (head size 256).
"""

from __future__ import annotations

from patches.spec import Anchor, PatchSpec

TARGET = "vllm/v1/attention/ops/triton_unified_attention.py"

# The block's `- 4096` is headroom under the opt-in limit for what the formula does not count
# (Triton's own scratch for layout conversions and the softmax statistics): 65,536 - 4,096 =
# 61,440 bytes on Turing. Written out in BODY, since BODY is the exact text inserted.

BODY = """\
    # Pre-Ampere GPUs (compute capability < 8, e.g. Turing) allow at most
    # shared_memory_per_block_optin (64 KiB) of shared memory per block, and at
    # head size 512 the default KV tiles ask for more (OutOfResources). Halve the
    # tiles until (BLOCK_M + 2 * TILE) * head_size * element_size fits a budget
    # 4 KiB under that limit, and launch with a single pipeline stage.
    _smem_cap = current_platform.get_device_capability()
    if _smem_cap is not None and _smem_cap[0] < 8:
        _smem_limit = getattr(
            torch.cuda.get_device_properties(q.device),
            "shared_memory_per_block_optin",
            0,
        )
        _smem_budget = (_smem_limit or 65536) - 4096
        _smem_row = head_size * q.element_size()
        _smem_min_tile = 32 if q.element_size() == 1 else 16
        if (
            (BLOCK_M + 2 * TILE_SIZE_PREFILL) * _smem_row > _smem_budget
            or (BLOCK_M + 2 * TILE_SIZE_DECODE) * _smem_row > _smem_budget
        ):
            while (
                TILE_SIZE_PREFILL > _smem_min_tile
                and (BLOCK_M + 2 * TILE_SIZE_PREFILL) * _smem_row > _smem_budget
            ):
                TILE_SIZE_PREFILL //= 2
            while (
                TILE_SIZE_DECODE > _smem_min_tile
                and (BLOCK_M + 2 * TILE_SIZE_DECODE) * _smem_row > _smem_budget
            ):
                TILE_SIZE_DECODE //= 2
            launch_num_stages = 1
"""

TURING_SMEM_CLAMP = PatchSpec(
    id="turing-smem-clamp",
    version=1,
    summary="fit Triton attention tiles in pre-Ampere shared memory",
    target=TARGET,
    distribution="vllm",
    tested_versions=("0.29.0", "0.31.0", "0.32.0", "0.33.0"),
    anchors=(
        Anchor(
            line="def unified_attention(",
            why="the function the block goes into",
        ),
        Anchor(
            line="    launch_num_stages: int | None = None",
            why="the block sets launch_num_stages, so it must be a declared local",
        ),
        Anchor(
            line="        TILE_SIZE_DECODE = min(TILE_SIZE_DECODE, block_size)",
            why="the last change to the tile sizes before the block (end of the use_td clamp)",
        ),
        Anchor(
            line="    grid: tuple[Any, ...]",
            why="the block goes right before it: both tiles are final, none is chosen yet",
        ),
        Anchor(
            line="    launch_kwargs: dict[str, int] = {}",
            why="the launch arguments are built after the block",
        ),
        Anchor(
            line='        launch_kwargs["num_stages"] = launch_num_stages',
            why="launch_num_stages = 1 reaches the kernel launch only through this line",
        ),
    ),
    insert_before="    grid: tuple[Any, ...]",
    indent="    ",
    body=BODY,
)
