"""MCP tool `export_gguf`: a thin wrapper around tools/llamacpp.py (the CLI's
`gpurig engine export-gguf` calls the same function), run in a worker thread (llama.cpp's
converter takes seconds to minutes)."""

from __future__ import annotations

from typing import Annotated, Literal

import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from pydantic import Field

from mcp_server.annotations import IDEMPOTENT_WRITE
from tools.llamacpp import GgufExport, export_gguf


def register(mcp: MCPServer) -> None:
    @mcp.tool(name="export_gguf", title="Export a checkpoint as GGUF", annotations=IDEMPOTENT_WRITE)
    async def export_gguf_tool(
        checkpoint: Annotated[
            str, Field(min_length=1, description="a 16-bit Gemma 4 checkpoint directory")
        ],
        out: Annotated[str, Field(min_length=1, description="the .gguf file to write")],
        outtype: Literal["f16", "bf16", "q4_0"] = "f16",
        overwrite: bool = False,
    ) -> GgufExport:
        """Write a checkpoint directory as one GGUF file for llama.cpp (start_vllm_server with
        backend='llamacpp' serves it), through llama.cpp's own convert_hf_to_gguf.py from
        gpurig's llama.cpp build (.ci/llama-cpp-build): f16 or bf16, or q4_0 (converted to f16,
        then llama-quantize). Refuses a W4A16 checkpoint (export the 16-bit one), a tokenizer
        that is not a byte-fallback BPE (checkpoints made by older gpurig), an existing file
        without overwrite."""
        return await anyio.to_thread.run_sync(
            lambda: export_gguf(checkpoint, out, outtype=outtype, overwrite=overwrite)
        )
