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
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from server_support import free_port
from vllm_cpu_support import READY_TIMEOUT_S, VllmCpuServer

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


class OwnVllm(VllmCpuServer):
    """A VllmCpuServer that is ready only when *it* answers: vLLM binds its port only after the
    engine has started (a minute or more on 2 cores), so on a machine shared with other agents
    another server may take that port first, and `/health` would then be theirs. Ready means
    our process is alive and the port's /v1/models lists our model; a port taken by someone
    else gets our server restarted on a new one."""

    def start(self) -> OwnVllm:
        for _ in range(3):
            if self._start_once():
                return self
            self.stop()
            self.port = free_port()
        raise RuntimeError(f"vLLM lost its port to other servers three times:\n{self.log_tail()}")

    def _start_once(self) -> bool:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(self.log_path.parent), start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "Address already in use" in self.log_tail(80):
                    return False
                raise RuntimeError(f"vLLM exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.base + "/v1/models", timeout=2)
                ids = (
                    [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
                )
                if str(self.model) in ids:
                    return True
                if ids:  # somebody else's server on our port
                    return False
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM was not ready within {READY_TIMEOUT_S} s:\n{self.log_tail()}")


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
