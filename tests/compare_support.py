"""Checkpoints and servers for the comparison tests (tests/test_compare_vllm.py).

vLLM's CPU build has two kernel libraries, chosen by the CPU: `_C` (AVX-512) and `_C_AVX2`. Only
the first has `cpu_gemm_wna16`, the op its W4A16 linear kernel (CPUWNA16LinearKernel) calls, so on
an AVX2-only host (this CI machine: an AMD EPYC without AVX-512) vLLM cannot run the tiny W4A16
checkpoint at all: its warm-up dies with `'_OpNamespace' '_C' object has no attribute
'cpu_gemm_wna16'` and the engine core never starts. `dequantized_copy` writes the same model as
plain float32 tensors: q * scale is exact in float32, so vLLM, transformers and our engine
(which also reads the W4A16 original) all compute with the very same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from vllm_cpu_support import VllmCpuServer

from engine.packed import PackedLinear, dequantize

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja")  # fmt: skip


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The W4A16 checkpoint at `src` as an unquantized float32 checkpoint at `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            keys = set(f.keys())
            for key in sorted(keys):
                if key.endswith((".weight_scale", ".weight_shape")):
                    continue
                if key.endswith(".weight_packed"):
                    base = key[: -len(".weight_packed")]
                    packed = f.get_tensor(key)
                    scales = f.get_tensor(base + ".weight_scale")
                    n, k = (int(v) for v in f.get_tensor(base + ".weight_shape").tolist())
                    group = k // scales.shape[1]
                    w = PackedLinear(packed, scales, n, k, group)
                    tensors[base + ".weight"] = dequantize(w, torch.float32)
                else:
                    tensors[key] = f.get_tensor(key).to(torch.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in SIDE_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


# vllm_cpu_support.VllmCpuServer is ready only when its own process answers on its port
OwnVllm = VllmCpuServer


def compare_and_print(vllm_base: str, engine_base: str, name: str, reference: Path, tokens: int):
    """compare_outputs(vLLM, the engine) with transformers on `reference`, each prompt printed
    (the measurement bench/NOTES.md records; pytest -s shows it)."""
    from tools.compare import CompareRequest, ServerTarget, compare_outputs

    result = compare_outputs(
        CompareRequest(
            a=ServerTarget(base_url=vllm_base, name=name),
            b=ServerTarget(base_url=engine_base, name="engine"),
            max_tokens=tokens,
            reference=str(reference),
        )
    )
    for p in result.prompts:
        d, ref = p.difference, p.reference
        where = "" if d is None else (
            f" at {d.position}: {d.a.token} ({d.a.logprob:.4f}, engine {d.b.other_logprob}) vs "
            f"{d.b.token} ({d.b.logprob:.4f}, {name} {d.a.other_logprob}); margins "
            f"{d.a.margin} / {d.b.margin}; reference margin {ref.margin_at_a}"
        )  # fmt: skip
        print(f"{name} prompt {p.index} ({p.prompt_tokens} tokens): {p.agreed}/{p.compared}"
              f" {p.verdict}; reference kept {ref.agreed_a} / {ref.agreed_b}{where}")  # fmt: skip
    return result
