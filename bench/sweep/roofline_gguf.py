"""Bytes read per decode token of a GGUF file (what llama-server serves), from its tensor table.

Why: a llama.cpp target serves a GGUF conversion (f16, q8_0, q4_0, ...) of the checkpoint the
sweep takes its prompt ids from, so the safetensors headers of that directory describe other
bytes: a q4_0 file reads about a quarter of its f16 source. `gguf.GGUFReader` (llama.cpp's own
reader, on PyPI) memory-maps the file and parses its header; no tensor data is read. The same
parts are counted as for safetensors (bench/sweep/roofline.py): the decoder's linears, the
per-layer-input projection, and the output layer (`output`, else the tied `token_embd`); not the
per-layer embedding table, norms or scales of a few kilobytes.
"""

from __future__ import annotations

import re
from pathlib import Path

# llama.cpp's names (gguf-py constants.py, MODEL_TENSOR) of the matrices every token reads
_LINEAR = re.compile(
    r"^blk\.\d+\.(attn_qkv|attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down"
    r"|inp_gate|proj)\.weight$"
)
_PER_TOKEN = {"per_layer_model_proj.weight"}


def is_gguf(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return p.suffix == ".gguf" and p.is_file()


def gguf_bytes_per_token(path: str | Path) -> tuple[int, dict[str, int], int]:
    """(bytes read per decode token, bytes by part, tensors counted) for one GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(Path(path).expanduser())
    except (ValueError, OSError) as exc:  # not GGUF (bad magic), truncated, unreadable
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    linear = output = embed = 0
    counted = {"linear": 0, "output": 0, "embed": 0}
    for t in reader.tensors:
        n = int(t.n_bytes)
        if _LINEAR.match(t.name) or t.name in _PER_TOKEN:
            linear += n
            counted["linear"] += 1
        elif t.name == "output.weight":
            output += n
            counted["output"] += 1
        elif t.name == "token_embd.weight":
            embed += n
            counted["embed"] += 1
    if not counted["linear"]:
        raise ValueError(f"{path}: no decoder matrices under llama.cpp's names (blk.N.attn_q...)")
    parts = {"decoder linears": linear}
    if counted["output"]:
        parts["output layer (output)"] = output
    else:
        parts["output layer (tied token_embd)"] = embed
    tensors = counted["linear"] + (counted["output"] or counted["embed"])
    return sum(parts.values()), parts, tensors
