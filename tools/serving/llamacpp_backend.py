"""backend="llamacpp": llama.cpp's `llama-server` under the same lifecycle as vLLM and the engine.

It serves one GGUF file (`gpurig engine export-gguf` writes one from a checkpoint directory):
`llama-server -m X.gguf --host H --port P -c CONTEXT -np SLOTS -ngl LAYERS --metrics --alias NAME`.
`-np` (its parallel slots, its batching) comes from max_num_seqs; `-c` is the context shared by
the slots, so a per-request max_model_len becomes `-c max_model_len x slots` (llama.cpp splits
it evenly: each slot gets max_model_len). The flags it accepts are read from its own `--help`.
"""

from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

from tools.errors import InvalidInputError, NotFoundError
from tools.llamacpp import is_gguf

DEFAULT_SLOTS = 4
DEFAULT_CONTEXT_PER_SLOT = 4096
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def check_gguf(local: str | None, model: str) -> str:
    """The GGUF file to serve: a local file whose first bytes are GGUF's magic."""
    if local is None:
        raise InvalidInputError(
            f"llama.cpp serves a local GGUF file, not the hub id {model!r}",
            remedy="download the checkpoint, export it: gpurig engine export-gguf DIR --out "
            "model.gguf (MCP: export_gguf), and pass the .gguf file",
        )
    path = Path(local)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise InvalidInputError(
                f"{path} is a directory"
                + (f" with {len(ggufs)} GGUF files" if ggufs else " without a GGUF file"),
                remedy="pass one .gguf file; from a checkpoint directory make one first: gpurig "
                f"engine export-gguf {path} --out {path.name}.gguf",
            )
    if not path.is_file():
        raise NotFoundError(f"the model file {path} does not exist", remedy="pass a .gguf file")
    if not is_gguf(path):
        raise InvalidInputError(
            f"{path} is not a GGUF file (its first bytes are not 'GGUF')",
            remedy="export the checkpoint for llama.cpp: gpurig engine export-gguf CHECKPOINT_DIR "
            "--out model.gguf (MCP: export_gguf)",
        )
    return str(path.absolute())


@lru_cache(maxsize=8)
def _help_flags(binary: str, mtime: float) -> tuple[str, ...]:
    del mtime  # part of the cache key: a rebuilt binary is asked again
    try:
        proc = subprocess.run(
            [binary, "--help"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    text = proc.stdout + proc.stderr
    return tuple(sorted({m.group(1) for m in _FLAG.finditer(text)}))


def accepted_flags(binary: str) -> list[str]:
    """The flags `binary --help` lists (empty when it cannot be asked: nothing is refused)."""
    try:
        mtime = Path(binary).stat().st_mtime
    except OSError:
        return []
    return list(_help_flags(binary, mtime))


def unknown_flags(args: list[str], known: list[str]) -> list[str]:
    if not known:
        return []
    return [
        a.split("=", 1)[0]
        for a in args
        if a.startswith("-") and not _is_number(a) and a.split("=", 1)[0] not in known
    ]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def slots_and_context(max_model_len: int | None, max_num_seqs: int | None) -> tuple[int, int]:
    """(slots, total context `-c`): max_model_len is per request, as for vLLM."""
    slots = max_num_seqs or DEFAULT_SLOTS
    per_slot = max_model_len or DEFAULT_CONTEXT_PER_SLOT
    return slots, per_slot * slots


def llama_server_command(
    binary: str,
    gguf: str,
    alias: str,
    host: str,
    port: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    gpu_layers: int | None,
    extra_args: list[str],
) -> tuple[list[str], list[str]]:
    """(full command, the flags gpurig added)."""
    slots, context = slots_and_context(max_model_len, max_num_seqs)
    flags = ["--host", host, "--port", str(port), "-c", str(context), "-np", str(slots)]
    if gpu_layers is not None:
        flags += ["-ngl", str(gpu_layers)]
    # -lv 4: the model's facts (architecture, slots, context, KV buffers) reach the log, which
    # the start-up facts are read from; at the default level it prints none of them
    flags += ["--metrics", "--alias", alias, "-lv", "4"]
    return [binary, "-m", gguf, *flags, *extra_args], flags
