"""Helpers shared by the Turing-patch tests: real vLLM files, fake-free site-packages layouts,
and a runner for the patched tile-size path.

Everything here works on real vLLM source: the files in tests/data/turing_patch (copied from the
wheels) or the files a real wheel installs. The only stand-ins are for what cannot exist on a
machine without a GPU: `current_platform.get_device_capability()` and
`torch.cuda.get_device_properties(...)`, which return what a Tesla T4 reports
(capability (7, 5), shared_memory_per_block_optin 65536).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

from patches.turing_smem_clamp import TURING_SMEM_CLAMP as SPEC

DATA = Path(__file__).parent / "data" / "turing_patch"
# (file, RECORD sha256, RECORD size) as the wheels list them
STOCK_0_33_0 = (
    DATA / "triton_unified_attention-0.33.0.py.orig",
    "wc8jAMmfXcH7KX1-VWYghCq1PGTF7NpMa6ifuOFiFdo",
    46147,
)
STOCK_0_22_0 = (
    DATA / "triton_unified_attention-0.22.0.py.orig",
    "LQoy8W_JTc4CaFDgnybcnpu4MMqgwhqGUNhchmnGGKI",
    38909,
)
T4_SMEM_OPTIN = 65536  # torch.cuda.get_device_properties(0).shared_memory_per_block_optin on a T4
BUDGET = T4_SMEM_OPTIN - 4096


def install_fake_wheel(site: Path, version: str, source: Path, record_hash: str, size: int) -> Path:
    """Lay out a real file as pip would: package folder plus a dist-info with METADATA and RECORD.

    `importlib.metadata` reads exactly these two files, so the serving interpreter's lookup
    runs through the same code as for a full install.
    """
    target = site / SPEC.target
    target.parent.mkdir(parents=True, exist_ok=True)
    (site / "vllm" / "__init__.py").write_text("")
    target.write_bytes(source.read_bytes())
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (dist / "RECORD").write_text(
        f"vllm/__init__.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0\n"
        f"{SPEC.target},sha256={record_hash},{size}\n"
        f"vllm-{version}.dist-info/METADATA,,\nvllm-{version}.dist-info/RECORD,,\n"
    )
    return target


def user_site(userbase: Path) -> Path:
    """The site-packages folder Python uses for PYTHONUSERBASE=userbase (posix_user scheme)."""
    import sys

    return userbase / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _function_source(tree: ast.Module, text: str, name: str) -> str:
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node) or ""


def tile_path_sources(patched: str) -> tuple[str, str, str]:
    """From a patched file: the tile helpers, the stock tile-size lines and our inserted block.

    The stock part runs from `TILE_SIZE_PREFILL = _get_tile_size(` to the end of the `use_td`
    clamp; the block follows later, and nothing in between may touch the tile sizes or
    launch_num_stages (checked here), so running the two in order is the function's own path.
    """
    tree = ast.parse(patched)
    helpers = "\n\n".join(
        _function_source(tree, patched, n) for n in ("_is_gemma3_attention", "_get_tile_size")
    )
    lines = patched.splitlines(keepends=True)
    start = next(
        i for i, ln in enumerate(lines) if ln.startswith("    TILE_SIZE_PREFILL = _get_tile_size(")
    )
    td_end = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == SPEC.anchors[2].line)
    begin = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == SPEC.begin_marker)
    end = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == SPEC.end_marker)
    between = "".join(lines[td_end + 1 : begin])
    touching = re.findall(
        r"^\s*(TILE_SIZE_PREFILL|TILE_SIZE_DECODE|launch_num_stages)\s*[-+*/]?=", between, re.M
    )
    assert not touching, f"code between the tile sizes and the block changes {touching}"
    stock = textwrap.dedent("".join(lines[start : td_end + 1]))
    block = textwrap.dedent("".join(lines[begin : end + 1]))
    return helpers, stock, block


def run_tile_path(
    patched: str,
    capability: tuple[int, int] | None,
    head_size: int,
    dtype: str = "float16",
    smem_optin: int = T4_SMEM_OPTIN,
    sliding_window_val: int = 0,
    block_m: int = 16,
    with_block: bool = True,
) -> dict:
    """Run the real tile-size code of `unified_attention` with its real variable names bound."""
    import torch

    helpers, stock, block = tile_path_sources(patched)
    asked: list[object] = []

    def get_device_properties(device: object) -> SimpleNamespace:
        asked.append(device)
        return SimpleNamespace(shared_memory_per_block_optin=smem_optin)

    ns: dict = {}
    exec(compile(helpers, "<vllm tile helpers>", "exec"), ns)
    ns.update(
        q=torch.empty((4, 8, head_size), dtype=getattr(torch, dtype)),
        head_size=head_size,
        sliding_window_val=sliding_window_val,
        BLOCK_M=block_m,
        block_size=16,
        use_td=False,
        tuned_large_head=False,
        launch_num_warps=None,
        launch_num_stages=None,
        current_platform=SimpleNamespace(get_device_capability=lambda: capability),
        torch=SimpleNamespace(cuda=SimpleNamespace(get_device_properties=get_device_properties)),
    )
    exec(compile(stock, "<vllm tile sizes>", "exec"), ns)
    if with_block:
        exec(compile(block, "<gpurig clamp>", "exec"), ns)
    return {
        "prefill": ns["TILE_SIZE_PREFILL"],
        "decode": ns["TILE_SIZE_DECODE"],
        "stages": ns["launch_num_stages"],
        "asked": asked,
        "esz": ns["q"].element_size(),
    }


def smem_need(block_m: int, tile: int, head_size: int, esz: int) -> int:
    """The doc's formula: Q block plus one K and one V tile, in bytes."""
    return (block_m + 2 * tile) * head_size * esz
