"""The roofline a sweep measures once, before its first cell: bytes per decode token per target
(from the weights' headers) and one bandwidth probe per serving interpreter, run before any
server the sweep starts holds the GPU. Split from bench/sweep/run.py.
"""

from __future__ import annotations

from bench.sweep import targets
from bench.sweep.models import Roofline, SweepConfig
from bench.sweep.roofline import bytes_per_token, run_bandwidth_probe
from bench.sweep.roofline_gguf import is_gguf
from tools.settings import serving_python


def measure_roofline(config: SweepConfig) -> list[Roofline]:
    """Bytes per token per target (headers) and one bandwidth probe per serving interpreter,
    run before any server the sweep starts holds the GPU."""
    probes: dict[str, dict] = {}
    out = []
    for t in config.targets:
        r = Roofline(target=t.label, model_dir=targets.static_model_dir(t))
        python_bin = t.python_bin or (t.server or {}).get("python_bin") or serving_python()
        if r.model_dir is None and t.base_url:
            try:
                r.model_dir = targets.resolve(t).model_dir
            except Exception:
                r.model_dir = None
        missing = []
        weights = _served_gguf(t) or r.model_dir  # llama-server reads its GGUF, not the dir
        if weights:
            try:
                r.bytes_per_token, r.parts, r.tensors = bytes_per_token(weights)
            except (OSError, ValueError) as exc:
                missing.append(f"no bytes per token: {exc}")
        else:
            missing.append("no bytes per token: the checkpoint directory is not known")
        if python_bin not in probes:
            probes[python_bin] = _no_gpu() or run_bandwidth_probe(python_bin)
        probe = probes[python_bin]
        if probe.get("available"):
            r.bandwidth_gb_s, r.device = probe.get("gb_s"), probe.get("device")
        else:
            missing.append(f"no bandwidth: {probe.get('reason')}")
        if r.bytes_per_token and r.bandwidth_gb_s:
            r.ceiling_tok_s = round(r.bandwidth_gb_s * 1e9 / r.bytes_per_token, 1)
        r.missing = "; ".join(missing) or None
        out.append(r)
    return out


def _served_gguf(target) -> str | None:
    """The GGUF file a llama.cpp target serves, where the sweep starts its server."""
    model = str((target.server or {}).get("model") or "")
    return model if model.endswith(".gguf") and is_gguf(model) else None


def _no_gpu() -> dict | None:
    """The probe's answer without running it when NVML sees no GPU at all (no driver): the
    probe would only import torch to say the same, seconds later."""
    from tools.gpu_nvml import nvml_gpu_count, read_nvml

    if nvml_gpu_count(timeout_s=2.0):
        return None
    error = read_nvml().error or "NVML lists no GPU"
    return {"available": False, "reason": f"no NVIDIA GPU visible ({error})"}
