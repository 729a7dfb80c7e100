"""The int4 few-row product (w4_gemm) against its PyTorch reference, on fresh random packed
weights: every row count 1..16, the three epilogues, both inner paths (tensor-core dot and
multiply-and-sum), split-K with the fused ticket reduction and the two-pass one."""

from __future__ import annotations

import json

import pytest
import torch

from engine.kernels.w4gemm import w4_gemm, w4_gemm_reference
from engine.kernels.w4gemm_tune import candidate_configs, shape_key

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# norm-relative error against the reference; 16-bit outputs round (and the GLU / GELU epilogues
# round three times), so a one-ulp difference in y shows up as ~1e-2 for bf16
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# K=96: 12 words, no power-of-two tile divides it. No K is a multiple of 128, so 16-bit rows stay
# on this kernel and off the warp-level mma one (tested in test_kernels_w4mma.py)
SHAPES = [(64, 96), (96, 224), (64, 64)]


def _layer(n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype
    scales = (torch.rand(n, k // 32, generator=gen) * 0.05 + 0.005).to(scale_dtype)
    return packed.to(device), scales.to(device)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _check(device, m, n, k, dtype, epi, config=None, out_dtype=None, seed=0) -> torch.Tensor:
    packed, scales = _layer(n, k, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    aux = torch.randn(m, n, generator=gen).to(dtype).to(device) if epi == 2 else None
    width = n // 2 if epi == 1 else n
    out = None
    if out_dtype is not None:  # poisoned: every element must be written
        out = torch.full((m, width), float("nan"), device=device, dtype=out_dtype)
    y = w4_gemm(x, packed, scales, out=out, epi=epi, aux=aux, config=config)
    assert y.shape == (m, width) and y.dtype == (out_dtype or dtype)
    assert not torch.isnan(y).any()
    ref = w4_gemm_reference(x, packed, scales, epi=epi, aux=aux, out_dtype=out_dtype)
    err = _rel_err(y, ref)
    # the tensor-core path rounds each dequantized weight to x's dtype: x's tolerance
    assert err < TOL[dtype], (m, n, k, dtype, epi, config, err)
    return y


@pytest.mark.parametrize("m", range(1, 17))
def test_every_row_count_every_epilogue_and_dtype(device, m) -> None:
    n, k = SHAPES[m % 3]
    for dtype in DTYPES:
        for epi in (0, 1, 2):
            _check(device, m, n, k, dtype, epi, seed=m * 10 + epi)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_out_given_in_fp32(device, m) -> None:
    """fp32 logits from bf16 activations (the lm_head's case); the epilogues round to out's
    dtype, as the GEMV's do."""
    for epi in (0, 1, 2):
        _check(device, m, 96, 224, torch.bfloat16, epi, out_dtype=torch.float32, seed=m)


def _cfg(**kw):
    base = {"TC": True, "BLOCK_N": 32, "BLOCK_KW": 4, "num_warps": 4, "num_stages": 1,
            "SPLIT": 1, "FUSED": True, "SWAP": False, "PIPE": True}  # fmt: skip
    return dict(base, **kw)


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("slab", [False, True])
def test_multiply_and_sum_path_forced(device, m, slab) -> None:
    """The Turing path (no tl.dot): same function, several K steps and a masked last one."""
    cfg = _cfg(TC=False, BLOCK_N=4, BLOCK_KW=4, SLAB=slab)
    for dtype in DTYPES:
        for epi in (0, 1, 2):
            _check(device, m, 40, 96, dtype, epi, config=cfg, seed=m + epi)


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(SPLIT=2),  # 12 words in steps of 4: splits of 8 and 4 words
        _cfg(SPLIT=4, BLOCK_KW=2),
        _cfg(SPLIT=3, FUSED=False),  # the two-pass reduction
        _cfg(SPLIT=2, SWAP=True, BLOCK_N=16),  # the weight tile as the dot's A operand
        _cfg(SPLIT=2, PIPE=False),
        _cfg(TC=False, BLOCK_N=8, BLOCK_KW=2, SPLIT=4),
        _cfg(SPLIT=64),  # more splits than K steps: clamped, none empty
        # nibble by nibble: 8 dots per K step, or the multiply-and-sum over [rows, BN, BKW]
        _cfg(SLAB=True, PIPE=False),
        _cfg(SLAB=True, SWAP=True, SPLIT=2),
        _cfg(SLAB=True, SPLIT=3, FUSED=False),
        _cfg(SLAB=True, TC=False, BLOCK_N=8, BLOCK_KW=4, SPLIT=2),
    ],
)
def test_split_k_and_tilings_compute_the_same_function(device, cfg) -> None:
    if device.type == "cuda" and cfg.get("SLAB") and cfg["TC"]:
        # the interpreter's small steps; compiled, a slab dot needs K = BLOCK_KW >= 16 (the
        # launcher refuses less: test_a_slab_step_below_the_dot_minimum_is_refused)
        cfg = {**cfg, "BLOCK_KW": 16}
    for dtype, epi, m in ((torch.float32, 0, 3), (torch.bfloat16, 1, 16), (torch.float16, 2, 7)):
        _check(device, m, 72, 96, dtype, epi, config=cfg, seed=epi)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_slab_step_below_the_dot_minimum_is_refused() -> None:
    packed, scales = _layer(64, 128, torch.bfloat16, torch.device("cuda"), 0)
    x = torch.randn(4, 128, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="BLOCK_KW >= 16"):
        w4_gemm(x, packed, scales, config=_cfg(SLAB=True))


def test_split_k_is_deterministic_and_leaves_its_tickets_at_zero(device) -> None:
    from engine.kernels import w4gemm

    cfg = _cfg(SPLIT=4, BLOCK_KW=2)
    y1 = _check(device, 9, 64, 128, torch.float32, 0, config=cfg)
    y2 = _check(device, 9, 64, 128, torch.float32, 0, config=cfg)
    assert torch.equal(y1, y2)
    _, tickets = w4gemm.workspace(device, 0, 0)  # the buffers the calls used
    assert int(tickets.abs().sum()) == 0


def test_one_row_runs_the_gemv_and_agrees_with_the_product(device) -> None:
    from engine.kernels.w4gemv import w4_gemv

    packed, scales = _layer(64, 256, torch.float32, device, 3)
    x = torch.randn(1, 256, device=device)
    assert torch.equal(w4_gemm(x, packed, scales), w4_gemv(x, packed, scales))
    two = w4_gemm(torch.cat([x, x]), packed, scales)
    assert torch.allclose(two[0], two[1]) and torch.allclose(two[:1], w4_gemv(x, packed, scales),
                                                              rtol=1e-5, atol=1e-5)  # fmt: skip


def test_bad_input_is_refused(device) -> None:
    packed, scales = _layer(64, 64, torch.float32, device, 0)
    with pytest.raises(ValueError, match="expected packed"):
        w4_gemm(torch.randn(2, 96, device=device), packed, scales)
    with pytest.raises(ValueError, match="1..16"):
        w4_gemm(torch.randn(17, 64, device=device), packed, scales)
    with pytest.raises(ValueError, match="aux"):
        w4_gemm(torch.randn(2, 64, device=device), packed, scales, epi=2)
    with pytest.raises(ValueError, match="out must be"):
        w4_gemm(torch.randn(2, 64, device=device), packed, scales, epi=1,
                out=torch.empty(2, 64, device=device))  # fmt: skip


def test_candidates_fit_their_shape() -> None:
    """Tiling candidates: no K tile wider than the row, whole gate|up pairs for the GLU, the
    multiply-and-sum accumulator kept small; keys separate row buckets and paths."""
    for tc in (True, False):
        cands = candidate_configs(1536, 256, 16, tc, epi=1)
        assert cands and all(c["BLOCK_KW"] <= 32 and c["BLOCK_N"] % 2 == 0 for c in cands)
        assert all(c["TC"] == tc for c in cands)
    assert any(c["SPLIT"] > 1 for c in candidate_configs(1536, 12288, 8, True))
    keys = {shape_key(1536, 6144, torch.bfloat16, m, tc) for m in (2, 3, 4, 5, 16)
            for tc in (True, False)}  # fmt: skip
    assert len(keys) == 8  # buckets 2, 4, 8, 16 (3 -> 4, 5 -> 8), each for both paths


# ---- on the GPU (skipped where there is none): every E2B shape, CUDA-graph capture ----

E2B_SHAPES = [
    (2560, 1536), (5120, 1536), (2048, 1536), (4096, 1536),  # qkv, q only (sliding, full)
    (1536, 2048), (1536, 4096), (12288, 1536), (24576, 1536),  # o; gate|up (normal, wide)
    (1536, 6144), (1536, 12288), (256, 1536), (1536, 256),  # down; per-layer gate, proj
    (8960, 1536), (262144, 1536),  # per-layer model projection, lm_head
]  # fmt: skip


@pytest.fixture
def no_autotune():
    """The tuned table or the default tiling: no minutes of tuning inside the test run."""
    from engine.kernels import tuning

    with tuning.tuning_settings(tuning.TuningSettings(autotune=False)):
        yield


@pytest.mark.parametrize(("n", "k"), E2B_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.usefixtures("no_autotune")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_w4_gemm_at_e2b_shape(n, k, m) -> None:
    dev = torch.device("cuda")
    _check(dev, m, n, k, torch.bfloat16, 0, out_dtype=torch.bfloat16, seed=n + k)
    if n in (12288, 24576):  # the gate|up matrices run the GLU epilogue
        _check(dev, m, n, k, torch.bfloat16, 1, seed=n + k)
    if n == 256:  # gelu(gate) * per-layer input
        _check(dev, m, n, k, torch.bfloat16, 2, seed=n + k)
    if n == 262144:  # logits straight into fp32
        _check(dev, m, n, k, torch.bfloat16, 0, out_dtype=torch.float32, seed=n + k)


@pytest.mark.parametrize(("n", "k"), [(2560, 1536), (1536, 12288), (12288, 1536)])
@pytest.mark.usefixtures("no_autotune")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fp32_is_exact_on_the_gpu_and_fp16_too(n, k) -> None:
    """fp32 activations: an ieee dot (no tf32), so the reference's tolerance is fp32's."""
    dev = torch.device("cuda")
    for m in (2, 7, 16):
        _check(dev, m, n, k, torch.float32, 0, seed=m)
        _check(dev, m, n, k, torch.float16, 1 if n == 12288 else 0, seed=m)


@pytest.mark.usefixtures("no_autotune")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_paths_and_split_k_on_the_gpu() -> None:
    """The multiply-and-sum path (Turing's), forced on this GPU, and split-K under both
    reductions, at a down-projection shape."""
    dev = torch.device("cuda")
    for cfg in (_cfg(TC=False, BLOCK_N=4, BLOCK_KW=8), _cfg(BLOCK_N=32, BLOCK_KW=16, SPLIT=8),
                _cfg(SLAB=True, SWAP=True, BLOCK_N=64, BLOCK_KW=16, SPLIT=4, PIPE=False),
                _cfg(SLAB=True, TC=False, BLOCK_N=8, BLOCK_KW=16),
                _cfg(BLOCK_N=64, BLOCK_KW=16, SPLIT=4, FUSED=False, SWAP=True)):  # fmt: skip
        for m in (2, 9, 16):
            for epi in (0, 2):
                _check(dev, m, 1536, 6144, torch.bfloat16, epi, config=cfg, seed=m)


@pytest.mark.usefixtures("no_autotune")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_captured_in_a_cuda_graph_and_replayed() -> None:
    """warm, capture (split-K shape included), replay on new inputs: the graph's results equal
    eager calls, and replays are bitwise repeatable (the ticket reduction is ordered)."""
    from engine.kernels.w4gemm import warm

    dev = torch.device("cuda")
    layers = [(_layer(n, k, torch.bfloat16, dev, n)) for n, k in ((1536, 12288), (12288, 1536))]
    xs = [torch.randn(8, 12288, device=dev).bfloat16(), torch.randn(8, 1536, device=dev).bfloat16()]
    outs = [torch.empty(8, 1536, device=dev, dtype=torch.bfloat16),
            torch.empty(8, 6144, device=dev, dtype=torch.bfloat16)]  # fmt: skip
    for (p, _s), x in zip(layers, xs, strict=True):
        warm(p.shape[0], x.shape[1], torch.bfloat16, dev, rows=(8,))
    w4_gemm(xs[0], *layers[0], out=outs[0])  # one eager call each before capture
    w4_gemm(xs[1], *layers[1], out=outs[1], epi=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w4_gemm(xs[0], *layers[0], out=outs[0])
        w4_gemm(xs[1], *layers[1], out=outs[1], epi=1)
    for x in xs:
        x.copy_(torch.randn_like(x))
    graph.replay()
    first = [o.clone() for o in outs]
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(first, outs, strict=True))
    assert torch.equal(first[0], w4_gemm(xs[0], *layers[0]))
    assert torch.equal(first[1], w4_gemm(xs[1], *layers[1], epi=1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the CPU interpreter's")
def test_gemm_bench_smoke_mode_writes_its_table(tmp_path) -> None:
    """lab/engine/gemm_bench.py --smoke: every method measured or reported n/a with a reason,
    the kernel's error small, the JSON and markdown written."""
    from lab.engine.gemm_bench import METHODS, main

    out_json, out_md = tmp_path / "g.json", tmp_path / "g.md"
    assert main(["--smoke", "--rows", "1,4", "--out-json", str(out_json),
                 "--out-md", str(out_md)]) == 0  # fmt: skip
    res = json.loads(out_json.read_text())
    cells = {(c["shape"], c["method"], c["m"]): c for c in res["cells"]}
    assert len(cells) == 2 * len(METHODS) * 2
    ours = [c for c in res["cells"] if c["method"] in ("w4_gemm", "w4_mma") and "na" not in c]
    assert len(ours) == 6  # w4_mma takes smoke_a (K=128), not smoke_b (K=224)
    assert all(c["us"] > 0 and c["rel_err"] < 3e-2 for c in ours)
    assert res["peak_gbps"] == 4800.0  # no card named: the H200's, as before
    assert all(c["pct_peak"] == round(100 * c["gbps"] / 4800.0, 1) for c in ours)
    assert "needs CUDA" in cells[("smoke_a", "tinygemm", 4)]["na"]
    assert "| smoke_b (96 x 224) | 4 |" in out_md.read_text()


def test_gemm_bench_takes_each_cards_bandwidth() -> None:
    """The % column's base follows the card: an H100's table is not read against 4.8 TB/s."""
    from lab.engine.gemm_bench import peak_gbps

    assert peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert peak_gbps("NVIDIA H200") == 4800.0
    assert peak_gbps("cpu (interpreter)") == 4800.0
