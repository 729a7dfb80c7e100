"""A llama.cpp build whose converter cannot run in this interpreter (transformers missing, as after
a plain `pip install .`: transformers is only in the dev extra) is named before any export starts,
and `gpurig demo` then leaves llama.cpp out and says what to install instead of failing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.sweep import demo
from engine.errors import NotFoundError
from tools import llamacpp


@pytest.fixture
def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A build folder with the layout .ci/llama-cpp-build leaves: bin/llama-server and the
    source tree's converter (never run here)."""
    (tmp_path / "bin").mkdir()
    server = tmp_path / "bin" / "llama-server"
    server.write_text("#!/bin/sh\nexit 0\n")
    server.chmod(0o755)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "convert_hf_to_gguf.py").write_text("raise SystemExit(1)\n")
    monkeypatch.setenv("GPURIG_LLAMA_CPP_DIR", str(tmp_path))
    monkeypatch.delenv("GPURIG_LLAMA_SERVER", raising=False)
    return tmp_path


def test_the_converter_is_found_where_its_modules_are(build: Path) -> None:
    assert llamacpp.find_converter() == build / "src" / "convert_hf_to_gguf.py"


def test_a_missing_converter_module_is_named_with_its_install(
    build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # find_spec: not importable
    with pytest.raises(NotFoundError) as caught:
        llamacpp.find_converter()
    assert "transformers" in caught.value.message
    assert caught.value.remedy == f"{sys.executable} -m pip install transformers"


def test_the_demo_leaves_llamacpp_out_and_says_why(
    build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert demo.demo_llama(None) is None
    hints = demo.missing_peers(None, None)
    llama = [h for h in hints if h.startswith("llama.cpp:")]
    assert len(llama) == 1 and "pip install transformers" in llama[0], hints
    with pytest.raises(NotFoundError, match="transformers"):  # asked for by name: refused
        demo.demo_llama(str(build / "bin" / "llama-server"))
