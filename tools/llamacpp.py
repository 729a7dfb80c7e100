"""llama.cpp as a peer: where its binaries and converter are, and a checkpoint's GGUF export.

The llama.cpp used is the one the llama-cpp-python 0.3.36 sdist vendors (ggml-org llama.cpp
0c1e570, with Gemma 4 support), built for the CPU once per machine outside the clone by
`.ci/llama-cpp-build` into ~/.cache/gpurig/llama-cpp-0.3.36/ (GPURIG_LLAMA_CPP_DIR elsewhere):
`bin/llama-server`, `bin/llama-quantize` and the source tree `src/` whose own
`convert_hf_to_gguf.py` (with its bundled gguf-py) the export runs: no re-implementation.

A binary may also be given explicitly, or found on PATH (a llama.cpp of one's own, e.g. a CUDA
build); GPURIG_LLAMA_SERVER names one too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from engine import env as variables
from tools.errors import InvalidInputError, NotFoundError, RefusedError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_SCRIPT = ".ci/llama-cpp-build"
GGUF_MAGIC = b"GGUF"
OutType = Literal["f16", "bf16", "q4_0"]
OUT_TYPES = ("f16", "bf16", "q4_0")
CONVERT_TIMEOUT_S = 1800
# what convert_hf_to_gguf.py imports beside its bundled gguf-py; transformers is not one of
# gpurig's own dependencies (only of its dev extra), so a plain `pip install .` lacks it
CONVERTER_MODULES = ("transformers", "torch", "numpy", "safetensors")


def llama_cpp_dir() -> Path:
    """Where `.ci/llama-cpp-build` puts the build (it may not be there)."""
    default = Path.home() / ".cache" / "gpurig" / f"llama-cpp-{LLAMA_CPP_PYTHON_VERSION}"
    return Path(variables.read("GPURIG_LLAMA_CPP_DIR") or default).expanduser()


def _build_hint() -> str:
    return (
        f"build it once per machine: {BUILD_SCRIPT} (from a gpurig clone; downloads the "
        f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist and builds its llama.cpp for the CPU, "
        "about 6 minutes on 2 cores; needs cmake and a C++ compiler)"
    )


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_binary(name: str, given: str | None = None) -> Path:
    """`llama-server` or `llama-quantize`: the given path, else $GPURIG_LLAMA_SERVER (for the
    server), else gpurig's build, else PATH."""
    if given:
        path = Path(given).expanduser()
        if path.is_dir():
            path = path / name
        if not _executable(path):
            found = shutil.which(given)
            if found:
                return Path(found)
            raise NotFoundError(
                f"{given} is not an executable {name}",
                remedy=f"pass the path of a built {name}, or leave it out to use gpurig's build; "
                + _build_hint(),
            )
        return path.absolute()
    env = variables.read("GPURIG_LLAMA_SERVER") if name == "llama-server" else None
    candidates = [Path(env).expanduser()] if env else []
    candidates.append(llama_cpp_dir() / "bin" / name)
    for path in candidates:
        if _executable(path):
            return path
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise NotFoundError(
        f"no {name} found (not at {llama_cpp_dir() / 'bin' / name}, not on PATH)",
        remedy=f"pass its path, put it on PATH, or {_build_hint()}",
    )


def find_converter() -> Path:
    """llama.cpp's own convert_hf_to_gguf.py from the build's source tree."""
    script = llama_cpp_dir() / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise NotFoundError(
            f"llama.cpp's converter is not at {script}",
            remedy=_build_hint() + " (it keeps the source tree with convert_hf_to_gguf.py)",
        )
    missing = [m for m in CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:  # found before it runs, not as an ImportError at the end of a long export
        raise NotFoundError(
            f"llama.cpp's converter needs {', '.join(missing)}, which {sys.executable} lacks",
            remedy=f"{sys.executable} -m pip install {' '.join(missing)}",
        )
    return script


def is_gguf(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GgufExport(BaseModel):
    """What `export_gguf` wrote."""

    checkpoint: str
    path: str = Field(description="the GGUF file")
    outtype: str
    bytes: int
    seconds: float
    converter: str = Field(description="llama.cpp's convert_hf_to_gguf.py that wrote it")
    quantizer: str | None = Field(None, description="llama-quantize, for q4_0")


def _check_checkpoint(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        what = "does not exist" if not checkpoint.exists() else "is not a directory"
        raise NotFoundError(
            f"the checkpoint {checkpoint} {what}",
            remedy="pass a Gemma 4 checkpoint directory (make one: gpurig engine make-checkpoint "
            "--unquantized --out DIR)",
        )
    for name in ("config.json", "tokenizer.json"):
        if not (checkpoint / name).is_file():
            raise NotFoundError(
                f"{checkpoint} has no {name}",
                remedy="pass a checkpoint directory holding config.json, tokenizer.json and "
                "safetensors weights",
            )
    try:
        cfg = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(
            f"{checkpoint / 'config.json'} is not readable JSON: {exc}",
            remedy="pass a checkpoint directory written by transformers or gpurig",
        ) from exc
    if cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config"):
        raise RefusedError(
            f"{checkpoint} is a W4A16 (compressed-tensors) checkpoint; llama.cpp's converter "
            "reads 16-bit weights",
            remedy="export a 16-bit checkpoint (gpurig engine make-checkpoint --unquantized), "
            "then quantize in llama.cpp with outtype q4_0",
        )
    _check_layer_order(checkpoint, cfg.get("text_config") or cfg)
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    model = tokenizer.get("model") or {}
    if not model.get("byte_fallback"):
        raise RefusedError(
            f"{checkpoint}'s tokenizer is not a byte-fallback BPE (Gemma's kind); llama.cpp's "
            "converter refuses it ('Cannot find Llama BPE tokenizer'): checkpoints made before "
            "gpurig's Gemma-style synthetic tokenizer ship a byte-level one",
            remedy="make the checkpoint again with this gpurig (gpurig engine make-checkpoint)",
        )


def _check_layer_order(checkpoint: Path, cfg: dict) -> None:
    """llama.cpp's Gemma 4 gives a KV-shared layer the cache of layer n-1 (a full one) or n-2 (a
    sliding one), n the number of layers owning a cache (llama-model.cpp), while transformers
    and the engine take the last own layer of the same kind; where those differ llama.cpp
    aborts loading (a GGML_ASSERT) or would attend over the wrong cache, so refuse before
    converting. The real E2B and E4B have that order."""
    kinds = list(cfg.get("layer_types") or [])
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if not kinds or not shared:
        return
    own = len(kinds) - shared
    needs = {"full_attention": own - 1, "sliding_attention": own - 2}
    wrong = [
        f"a shared {kind.split('_')[0]} layer would read layer {i} ({kinds[i] if i >= 0 else 'none'})"
        for kind, i in needs.items()
        if kind in kinds[own:] and (i < 0 or kinds[i] != kind)
    ]
    if wrong:
        raise RefusedError(
            f"{checkpoint}'s layer order cannot be loaded by llama.cpp's Gemma 4: it gives a "
            f"KV-shared full layer the cache of layer {own - 1} and a sliding one that of layer "
            f"{own - 2} (the last two of the {own} owning a cache), and here {'; '.join(wrong)}",
            remedy="export a checkpoint whose last layer before the KV-shared ones is full and "
            "the one before it sliding, as in the real E2B (gpurig engine make-checkpoint "
            "presets have that order)",
        )


def _run(argv: list[str], what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RefusedError(
            f"{what} did not finish in {timeout:g} s", remedy="retry; check free RAM and disk"
        ) from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise RefusedError(
            f"{what} failed (exit {proc.returncode}):\n{tail}",
            remedy="read the lines above; the converter needs torch, transformers, numpy and "
            "safetensors in this interpreter",
        )


def export_gguf(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    outtype: str = "f16",
    overwrite: bool = False,
) -> GgufExport:
    """Write `checkpoint` (a 16-bit Gemma 4 directory) as one GGUF file at `out`, through
    llama.cpp's convert_hf_to_gguf.py (f16, bf16), then llama-quantize for q4_0. The file appears
    only when complete (written beside it under a temporary name, then renamed)."""
    if outtype not in OUT_TYPES:
        raise InvalidInputError(
            f"outtype {outtype!r} is not one of {', '.join(OUT_TYPES)}",
            remedy="use f16 (exact for bf16 weights up to rounding), bf16, or q4_0",
        )
    src = Path(checkpoint).expanduser().absolute()
    dest = Path(out).expanduser().absolute()
    _check_checkpoint(src)
    if dest.suffix != ".gguf":
        raise InvalidInputError(
            f"the output {dest} does not end in .gguf", remedy="name the file e.g. model.gguf"
        )
    if dest.exists() and not overwrite:
        raise RefusedError(
            f"{dest} already exists", remedy="choose another path, or pass overwrite"
        )
    if not dest.parent.is_dir():
        raise NotFoundError(
            f"the output's folder {dest.parent} does not exist", remedy="create it first"
        )
    converter = find_converter()
    quantizer = find_binary("llama-quantize") if outtype == "q4_0" else None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".gguf-export-") as tmp:
        first = Path(tmp) / ("f16.gguf" if quantizer else "out.gguf")
        _run(
            [
                sys.executable,
                str(converter),
                str(src),
                "--outtype",
                "f16" if quantizer else outtype,
                "--outfile",
                str(first),
            ],  # fmt: skip
            "llama.cpp's convert_hf_to_gguf.py",
            CONVERT_TIMEOUT_S,
        )
        final = first
        if quantizer:
            final = Path(tmp) / "q4_0.gguf"
            _run([str(quantizer), str(first), str(final), "Q4_0"], "llama-quantize", 1800)
        os.replace(final, dest)  # same folder: atomic
    return GgufExport(
        checkpoint=str(src),
        path=str(dest),
        outtype=outtype,
        bytes=dest.stat().st_size,
        seconds=round(time.monotonic() - started, 2),
        converter=str(converter),
        quantizer=str(quantizer) if quantizer else None,
    )
