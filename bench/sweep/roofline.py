"""The decode roofline: bytes read per token (from safetensors headers alone) over the GPU's
measured read bandwidth.

At batch 1 a decode step reads every weight it uses once, so `bandwidth / bytes per token` is
the speed no server can beat. Counted from the headers (8-byte little-endian length, then JSON
with each tensor's dtype, shape and byte offsets), never the tensor data, so a 10 GB checkpoint
costs a few kilobytes of reading:
- the decoder's linears with their scales (q/k/v/o, gate/up/down, the per-layer-input gate and
  projection; packed codes, scales, zero points, or plain 16-bit weights), and the
  per_layer_model_projection that runs on every token;
- the output layer: lm_head, or the tied embedding counted once;
- not the per-layer embedding table (a row lookup per token), not the input embedding row, not
  norms (a few KB), not the vision or audio towers (idle for text).
The bandwidth comes from bench/sweep/bandwidth_probe.py run under the serving interpreter; on a
host without a GPU the ceiling is missing and says why.
"""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

from bench.sweep.bandwidth_probe import MARKER
from bench.sweep.roofline_gguf import gguf_bytes_per_token, is_gguf

PROBE = Path(__file__).with_name("bandwidth_probe.py")
MAX_HEADER = 100 << 20
LINEARS = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
}
WEIGHT_PARTS = {"weight", "weight_packed", "weight_scale", "weight_zero_point", "qweight", "scales"}
TOWERS = ("vision", "audio")


class HeaderError(ValueError):
    """A file that is not a readable safetensors file."""


def read_header(path: str | Path) -> dict[str, dict]:
    """The tensor entries of one safetensors file's header (no tensor data is read)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise HeaderError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise HeaderError(f"{path}: header length {n} is not plausible")
        data = fh.read(n)
    try:
        header = json.loads(data)
    except ValueError as exc:
        raise HeaderError(f"{path}: header is not JSON ({exc})") from None
    return {k: v for k, v in header.items() if k != "__metadata__"}


def classify(name: str) -> str | None:
    """'linear', 'lm_head', 'embed' (the tied output layer's candidate) or None (not read)."""
    if any(t in name for t in TOWERS):
        return None
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] not in WEIGHT_PARTS:
        return None
    module = parts[-2]
    if parts[0] == "lm_head":
        return "lm_head"
    if module == "embed_tokens":
        return "embed"
    if module in LINEARS and (module == "per_layer_model_projection" or "layers" in parts):
        return "linear"
    return None


def bytes_per_token(model_dir: str | Path) -> tuple[int, dict[str, int], int]:
    """(bytes read per decode token, bytes by part, tensors counted) for a checkpoint dir, or
    for a GGUF file (bench/sweep/roofline_gguf.py)."""
    if is_gguf(model_dir):
        return gguf_bytes_per_token(model_dir)
    files = sorted(Path(model_dir).expanduser().glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    parts = {"decoder linears": 0, "lm_head": 0, "embed": 0}
    counted = {"decoder linears": 0, "lm_head": 0, "embed": 0}
    for f in files:
        for name, entry in read_header(f).items():
            kind = classify(name)
            if kind is None:
                continue
            key = "decoder linears" if kind == "linear" else kind
            begin, end = entry["data_offsets"]
            parts[key] += int(end) - int(begin)
            counted[key] += 1
    out = {"decoder linears": parts["decoder linears"]}
    n = counted["decoder linears"]
    if counted["lm_head"]:  # untied: lm_head is read, embed_tokens is only looked up
        out["output layer (lm_head)"] = parts["lm_head"]
        n += counted["lm_head"]
    else:
        out["output layer (tied embedding)"] = parts["embed"]
        n += counted["embed"]
    return sum(out.values()), out, n


def run_bandwidth_probe(python_bin: str, timeout_s: float = 180.0) -> dict:
    """The probe's result under `python_bin`: {"available": True, "gb_s", "device", ...} or
    {"available": False, "reason"}."""
    try:
        proc = subprocess.run(
            [python_bin, str(PROBE)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": f"the bandwidth probe ran past {timeout_s:.0f} s"}
    except OSError as exc:
        return {"available": False, "reason": f"cannot run {python_bin}: {exc}"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            try:
                return json.loads(line[len(MARKER) :])
            except ValueError:
                break
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"available": False, "reason": f"the probe failed (exit {proc.returncode}): {tail[0]}"}
