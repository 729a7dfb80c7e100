"""Helpers for the live server tests: a free loopback port, the real engine server
process (`python -m engine.server`), and a "scripted" checkpoint whose greedy decode follows chosen token sequences.

The scripted checkpoint is a real tiny W4A16 checkpoint from `make_checkpoint`, edited so the
model is a first-order lookup table: every layer's residual contributions (o_proj, down_proj,
per_layer_projection) have zero scales, so the last position's hidden state is just its token's
embedding; the tied embedding and the final norm weight are then set so that, for each chosen
link `a -> b`, argmax(logits | last token a) = b. Each link owns one hidden dimension (norm
weight +1) where row a holds its strength s and row b holds 1; each token owns one dimension with
norm weight -M that pushes its own logit far down. Along a chain the strengths increase, so the
forward link always beats the link the chain came in by (the bilinear form is symmetric). That
makes the real engine, through the real server, write an exact tool call, with no mock anywhere.
New text pieces (e.g. `call:get_weather{city:`) go into placeholder vocabulary slots of the
byte-level tokenizer: they decode to their text but are never produced by encoding.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint_maker import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
SELF_PENALTY = 400.0
ZEROED = (".self_attn.o_proj.", ".mlp.down_proj.", ".per_layer_projection.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _byte_level(text: str) -> str:
    """GPT-2 byte-to-unicode mapping: how a byte-level BPE vocabulary spells `text`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return "".join(mapping[b] for b in text.encode("utf-8"))


def make_scripted_checkpoint(
    out_dir: Path, chains: Sequence[Sequence[int | str]], quantized: bool = True
) -> dict[str, int]:
    """Write a tiny checkpoint whose greedy continuation of token `chain[0]` is the rest of the
    chain (ints are existing token ids, strings new vocabulary pieces). Chains may share a tail
    (a token keeps one successor). Returns {piece: id} for the new pieces."""
    make_checkpoint(out_dir, preset="tiny", seed=0, quantized=quantized)
    tok_path = out_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    free = iter(sorted((i, t) for t, i in vocab.items() if t.startswith("<unused_")))
    # how the vocabulary spells a piece: Gemma's byte-fallback BPE marks spaces with "▁"
    spell = (
        (lambda t: t.replace(" ", "\u2581")) if tok["model"].get("byte_fallback") else _byte_level
    )
    piece_ids: dict[str, int] = {}
    for chain in chains:
        for item in chain:
            if isinstance(item, str) and item not in piece_ids:
                i, placeholder = next(free)
                del vocab[placeholder]
                vocab[spell(item)] = i
                piece_ids[item] = i
    tok_path.write_text(json.dumps(tok, ensure_ascii=False))

    ids = [[piece_ids[x] if isinstance(x, str) else int(x) for x in chain] for chain in chains]
    successor: dict[int, int] = {}
    for chain in ids:
        for a, b in zip(chain, chain[1:], strict=False):
            if successor.setdefault(a, b) != b:
                raise ValueError(f"token {a} would need two successors")
    # strength of a -> b: one more than the strongest link into a
    strength: dict[int, float] = {}

    def link_strength(a: int) -> float:
        if a not in strength:
            incoming = [link_strength(p) for p, q in successor.items() if q == a]
            strength[a] = 1.0 + max(incoming, default=0.0)
        return strength[a]

    tokens = sorted({t for chain in ids for t in chain})
    weights = load_file(str(out_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    if len(successor) + len(tokens) > hidden:
        raise ValueError("more links and tokens than hidden dimensions")
    table = torch.zeros_like(embed, dtype=torch.float32)
    norm = torch.zeros(hidden)
    dim = 0
    for a, b in sorted(successor.items()):
        table[a, dim], table[b, dim], norm[dim] = link_strength(a), 1.0, 1.0
        dim += 1
    for t in tokens:
        table[t, dim], norm[dim] = 1.0, -SELF_PENALTY
        dim += 1
    weights["model.embed_tokens.weight"] = table.to(embed.dtype)
    weights["model.norm.weight"] = norm.to(weights["model.norm.weight"].dtype)
    for name, tensor in weights.items():
        zeroed = name.endswith("weight_scale") or (not quantized and name.endswith(".weight"))
        if zeroed and any(z in name for z in ZEROED):
            weights[name] = torch.zeros_like(tensor)
        elif name.endswith("layer_scalar"):
            weights[name] = torch.ones_like(tensor)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return piece_ids


class ServerProcess:
    """The engine server (`python -m engine.server`) in a child process on a free loopback
    port."""

    def __init__(self, model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = model_dir.parent / f"server-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "engine.server",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self._log_file, stderr=subprocess.STDOUT, env=env
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        """Until /health answers. The bound is generous: on a 2-core CI host the server starts
        beside vLLM's CPU build and the other test worker (60 s once ran out there after the
        server had logged that it was serving)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log.read_text()}")

    def metrics(self) -> dict:
        return httpx.get(self.base + "/metrics", params={"format": "json"}, timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()
