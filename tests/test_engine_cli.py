"""`gpurig engine make-checkpoint | quantize | generate | memory` through the installed console
script, as a user runs them."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)


def test_make_generate_memory(run_gpurig, tmp_path):
    out = tmp_path / "tiny"
    r = run_gpurig(
        "engine", "make-checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "3", "--json"
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["preset"] == "tiny" and "model.safetensors" in info["files"]

    r = run_gpurig(
        "engine",
        "generate",
        "--model",
        str(out),
        "--chat",
        "Hi there",
        "--max-tokens",
        "12",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["prompt_tokens"] > 10 and 1 <= res["new_tokens"] <= 12
    assert res["decode_tokens_per_s"] is None or res["decode_tokens_per_s"] > 0

    r = run_gpurig(
        "engine",
        "generate",
        "--model",
        str(out),
        "--prompt",
        "abc",
        "--max-tokens",
        "5",
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "prompt" in r.stdout

    r = run_gpurig("engine", "memory", "--model", str(out), "--max-context", "256", "--json")
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout)
    assert mem["max_context"] == 256 and mem["cache_bytes"] > 0


def test_errors_are_clean(run_gpurig, tmp_path):
    r = run_gpurig("engine", "generate", "--model", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "config.json" in r.stderr and "Traceback" not in r.stderr
    out = tmp_path / "q"
    r = run_gpurig("engine", "make-checkpoint", "--out", str(out), "--unquantized")
    assert r.returncode == 0, r.stderr
    r = run_gpurig("engine", "quantize", "--in", str(out), "--out", str(tmp_path / "q4"), "--emb4")
    assert r.returncode == 0, r.stderr and (tmp_path / "q4" / "model.safetensors").is_file()
    r = run_gpurig(
        "engine",
        "generate",
        "--model",
        str(tmp_path / "q4"),
        "--prompt",
        "x" * 5000,
        "--max-context",
        "1000",
    )
    assert r.returncode == 2 and "context" in r.stderr and "what to do" in r.stderr
