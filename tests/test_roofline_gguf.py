"""A llama.cpp target's roofline bytes from its GGUF file (bench/sweep/roofline_gguf.py): real
GGUF files written by llama.cpp's own gguf library, in f16 and q8_0, tied and untied."""

from __future__ import annotations

import numpy as np
import pytest

from bench.sweep.roofline import bytes_per_token
from bench.sweep.roofline_gguf import gguf_bytes_per_token, is_gguf

gguf = pytest.importorskip("gguf")


def _write(path, tensors: dict[str, np.ndarray], quantize: set[str] = frozenset()) -> dict:
    """A GGUF with these tensors (q8_0 for the names in `quantize`); each one's bytes on disk."""
    writer = gguf.GGUFWriter(str(path), "gemma4")
    sizes = {}
    for name, data in tensors.items():
        if name in quantize:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            sizes[name] = q.nbytes
        else:
            writer.add_tensor(name, data)
            sizes[name] = data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


def _model(untied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = {}
    for i in range(2):
        for part, shape in (("attn_q", (64, 32)), ("attn_k", (32, 32)), ("attn_v", (32, 32)),
                            ("attn_output", (32, 64)), ("ffn_gate", (96, 32)),
                            ("ffn_up", (96, 32)), ("ffn_down", (32, 96)),
                            ("inp_gate", (16, 32)), ("proj", (32, 16))):  # fmt: skip
            t[f"blk.{i}.{part}.weight"] = rng.standard_normal(shape).astype(np.float16)
        t[f"blk.{i}.attn_norm.weight"] = np.ones(32, dtype=np.float32)  # not read per token
    t["per_layer_model_proj.weight"] = rng.standard_normal((32, 32)).astype(np.float16)
    t["per_layer_token_embd.weight"] = rng.standard_normal((512, 32)).astype(np.float16)
    t["token_embd.weight"] = rng.standard_normal((256, 32)).astype(np.float16)
    if untied:
        t["output.weight"] = rng.standard_normal((256, 32)).astype(np.float16)
    return t


@pytest.mark.parametrize("untied", [False, True])
def test_counts_the_matrices_every_token_reads(tmp_path, untied):
    path = tmp_path / "m.gguf"
    sizes = _write(path, _model(untied))
    linear = sum(n for k, n in sizes.items() if k.startswith("blk.") and "norm" not in k)
    linear += sizes["per_layer_model_proj.weight"]
    out_name = "output.weight" if untied else "token_embd.weight"
    total, parts, tensors = bytes_per_token(path)  # the dispatch on the suffix
    assert parts["decoder linears"] == linear
    key = "output layer (output)" if untied else "output layer (tied token_embd)"
    assert parts[key] == sizes[out_name] and total == linear + sizes[out_name]
    assert tensors == 2 * 9 + 1 + 1


def test_a_quantized_file_counts_its_own_bytes(tmp_path):
    """A q8_0 conversion reads about 34/64 of its f16 source's bytes, as its tensors say (the
    matrices 16 wide stay f16: q8_0 blocks are 32 wide)."""
    model = _model(False)
    _write(tmp_path / "f16.gguf", model)
    f16 = gguf_bytes_per_token(tmp_path / "f16.gguf")
    names = {k for k in model if k.startswith("blk.") and "norm" not in k
             and model[k].shape[-1] % 32 == 0}  # q8_0 blocks are 32 wide  # fmt: skip
    rest = {k for k in model if k.startswith("blk.") and "norm" not in k} - names
    sizes = _write(tmp_path / "q8.gguf", {k: v.astype(np.float32) if k in names else v
                                          for k, v in model.items()}, quantize=names)  # fmt: skip
    q8 = gguf_bytes_per_token(tmp_path / "q8.gguf")
    assert (
        q8[1]["decoder linears"]
        == sum(sizes[k] for k in names | rest) + sizes["per_layer_model_proj.weight"]
    )
    assert 0.5 < q8[1]["decoder linears"] / f16[1]["decoder linears"] < 0.6


def test_not_a_gguf_says_so(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    assert is_gguf(bad) and not is_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        bytes_per_token(bad)
    empty = tmp_path / "empty.gguf"
    _write(empty, {"token_embd.weight": np.zeros((4, 4), dtype=np.float16)})
    with pytest.raises(ValueError, match="no decoder matrices"):
        bytes_per_token(empty)
