"""A prompt pass's attention, every segment in one launch, against the reference `_attend` on
each segment's concatenated keys (its cache rows, then its own chunk)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from compile_support import compiled_rows

from engine import ops
from engine.kernels import attention_prefill

if os.environ.get("TRITON_INTERPRET") == "1":  # imported before conftest set it: rebuild
    attention_prefill = importlib.reload(attention_prefill)

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SMALL = (16, 16, 4, 2)  # tiles for the interpreter: several row blocks and key steps per segment


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def make_pass(lengths, starts, hq, hkv, d, window, dtype, device, seed=0, ring=0):
    """A pass of segments (lengths), each continuing a sequence at `starts`: q/k/v of the pass,
    and a pool whose rows hold each segment's cache, in shuffled rows. ring > 0: the cache is a
    ring of that many slots holding positions start-ring..start-1 (slot = position % ring), with
    stale positions beyond the window and empty slots (-1) mixed in."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    q_pos = torch.cat([torch.arange(s, s + n) for n, s in zip(lengths, starts, strict=True)])
    cache_len = [ring if ring and s else s for s in starts]
    pool_rows = sum(cache_len) + 7
    kp = torch.randn(pool_rows, hkv, d, generator=gen).to(dtype)
    vp = torch.randn(pool_rows, hkv, d, generator=gen).to(dtype)
    pp = torch.full((pool_rows,), -1, dtype=torch.int64)
    perm = torch.randperm(pool_rows, generator=gen)
    rows, used = [], 0
    for n_cache, s in zip(cache_len, starts, strict=True):
        r = perm[used : used + n_cache]
        used += n_cache
        if ring:
            held = torch.arange(s - n_cache, s)
            held = torch.where(held >= 0, held, torch.full_like(held, -1))
            if n_cache > 3:
                held[n_cache // 2] = -1  # an empty slot
            pp[r] = held
        else:
            pp[r] = torch.arange(n_cache)
        rows.append(r)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_c = [0]
    for n in cache_len:
        cu_c.append(cu_c[-1] + n)
    to = dict(device=device)
    cache = None
    if any(cache_len):
        cache = (kp.to(**to), vp.to(**to), pp.to(**to), torch.cat(rows).to(**to),
                 torch.tensor(cu_c, dtype=torch.int32, **to))  # fmt: skip
    return dict(
        q=q.to(**to), k=k.to(**to), v=v.to(**to), q_pos=q_pos.to(**to),
        cu_q=torch.tensor(cu, dtype=torch.int32, **to), max_rows=max(lengths), window=window,
        cache=cache,
    ), (kp, vp, pp, rows)  # fmt: skip


def reference(args, pool) -> torch.Tensor:
    kp, vp, pp, rows = pool
    q, k, v, q_pos = (args[n].cpu() for n in ("q", "k", "v", "q_pos"))
    cu = args["cu_q"].cpu().tolist()
    outs = []
    for b in range(len(cu) - 1):
        a, e = cu[b], cu[b + 1]
        r = rows[b] if args["cache"] is not None else torch.zeros(0, dtype=torch.int64)
        keys = torch.cat([kp[r], k[a:e]])
        values = torch.cat([vp[r], v[a:e]])
        kpos = torch.cat([pp[r], q_pos[a:e]])
        outs.append(ops._attend(q[a:e], keys, values, kpos, q_pos[a:e], args["window"]))
    return torch.cat(outs)


CASES = [  # lengths, starts, window, ring
    ([5, 37, 1, 20], [0, 0, 0, 0], None, 0),  # fresh prompts, full layer
    ([5, 37, 1, 20], [0, 0, 0, 0], 8, 0),  # fresh prompts, sliding
    ([9, 30], [12, 40], None, 0),  # continuing chunks over a filled prefix
    ([9, 30, 4], [12, 40, 0], 16, 16),  # continuing chunks over rings, one fresh
    ([33], [5], 16, 16),  # a ring not yet full (some slots still empty)
]


@pytest.mark.parametrize(("lengths", "starts", "window", "ring"), CASES)
def test_segments_match_the_reference(device, lengths, starts, window, ring) -> None:
    args, pool = make_pass(lengths, starts, 4, 2, 32, window, torch.float32, device, ring=ring)
    got = attention_prefill.prefill_attention(**args, tiles=SMALL)
    assert got.shape == args["q"].shape
    assert rel_err(got.cpu(), reference(args, pool)) < TOL[torch.float32]


def test_one_segment_alone_equals_itself_in_a_pass(device) -> None:
    """A segment's rows do not depend on the other segments of its pass: read alone or beside
    others, bit for bit (the batch-vs-alone identity of the engine rests on it)."""
    args, _ = make_pass([7, 21, 3], [0, 0, 0], 2, 1, 16, 8, torch.float32, device)
    both = attention_prefill.prefill_attention(**args, tiles=SMALL)
    alone = dict(args, q=args["q"][7:28], k=args["k"][7:28], v=args["v"][7:28],
                 q_pos=args["q_pos"][7:28], max_rows=21,
                 cu_q=torch.tensor([0, 21], dtype=torch.int32, device=device))  # fmt: skip
    one = attention_prefill.prefill_attention(**alone, tiles=SMALL)
    assert torch.equal(both[7:28], one)


@pytest.mark.parametrize(("lengths", "starts", "window", "ring"), [CASES[1], CASES[3]])
def test_flat_grid_equals_the_segment_grid(device, lengths, starts, window, ring) -> None:
    """A CUDA graph's grid (`flat`): one program per row block of the pass, the segments' blocks
    one after another, with padding rows past the last segment and empty segments (cu_q
    repeating T) as a captured pass has them. The real rows equal the per-segment grid's bit
    for bit; padding rows are not read."""
    args, _ = make_pass(lengths, starts, 4, 2, 32, window, torch.float32, device, ring=ring)
    want = attention_prefill.prefill_attention(**args, tiles=SMALL)
    t, pad = sum(lengths), 19

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.full((pad, *x.shape[1:]), 7, dtype=x.dtype, device=device)])

    cu = torch.cat([args["cu_q"], torch.full((3,), t, dtype=torch.int32, device=device)])
    graph_like = dict(args, q=padded(args["q"]), k=padded(args["k"]), v=padded(args["v"]),
                      q_pos=padded(args["q_pos"]), cu_q=cu, max_rows=0)  # fmt: skip
    if args["cache"] is not None:  # three more segments with no cached rows
        kp, vp, pp, rows, cu_c = args["cache"]
        cu_c = torch.cat([cu_c, cu_c[-1:].repeat(3)])
        graph_like["cache"] = (kp, vp, pp, rows, cu_c)
    got = attention_prefill.prefill_attention(**graph_like, tiles=SMALL, flat=True)
    assert got.shape[0] == t + pad
    assert torch.equal(got[:t], want)


def test_unsupported_shapes_are_refused(device) -> None:
    args, _ = make_pass([4], [0], 2, 1, 24, None, torch.float32, device)
    with pytest.raises(ValueError, match="power of two"):
        attention_prefill.prefill_attention(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("d", "window", "ring"), [(256, 512, 512), (512, None, 0)])
@pytest.mark.parametrize("starts", [[0, 0, 0, 0], [0, 700, 0, 1500]])
def test_e2b_shapes_on_the_gpu(dtype, d, window, ring, starts) -> None:
    """E2B's layers (8 query heads on one KV head; 256-wide sliding, 512-wide full), four
    segments of prompt lengths around the scheduler's, with the default tiles."""
    lengths = [511, 511, 37, 989]
    args, pool = make_pass(lengths, starts, 8, 1, d, window, dtype, "cuda", ring=ring)
    got = attention_prefill.prefill_attention(**args)
    want = reference({**args, "q": args["q"].float(), "k": args["k"].float(),
                      "v": args["v"].float()}, tuple(
                          x.float() if x.is_floating_point() else x for x in pool[:3]
                      ) + (pool[3],))  # fmt: skip
    assert rel_err(got.float().cpu(), want) < TOL[dtype]


# ---- compiled for each GPU generation (Triton's own ptxas, no GPU needed) ----------------

_SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}  # A100, RTX 30xx, H100/H200


def _compile_for_targets(targets: list[int]) -> None:
    """One JSON line per (target, layer kind): the kernel compiled with `tiling`'s tiles, its
    shared memory and ptxas's spill report. Run as a script (no interpreter)."""
    import json

    import triton
    from compile_support import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for sm in targets:
        for dim, window, flat in ((256, True, False), (512, False, False), (256, True, True),
                                  (512, False, True)):  # fmt: skip
            block_m, block_n, warps, stages = attention_prefill.tiling(dim)
            sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "ck_ptr", "cv_ptr", "out_ptr")}
            sig |= {n: "*i64" for n in ("qpos_ptr", "cpos_ptr", "crows_ptr")}
            sig |= {"cu_q_ptr": "*i32", "cu_c_ptr": "*i32", "window": "i32", "segments": "i32"}
            sig |= {n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                       "stride_vt", "stride_vh", "stride_ckt", "stride_ckh",
                                       "stride_cvt", "stride_cvh", "stride_ot", "stride_oh")}  # fmt: skip
            consts = {"GROUP": 8, "D": dim, "BLOCK_M": block_m, "BLOCK_N": block_n,
                      "WINDOW": window, "HAS_CACHE": True, "FLAT": flat, "SEGS": 32,
                      "PDL": sm >= 90}  # fmt: skip
            sig |= {n: "constexpr" for n in consts}
            compiled = triton.compile(
                ASTSource(fn=attention_prefill._prefill_attention_kernel, signature=sig,
                          constexprs=consts),
                target=GPUTarget("cuda", sm, 32),
                options={"num_warps": warps, "num_stages": stages},
            )  # fmt: skip
            report = ptxas_report(compiled.asm["ptx"], sm)
            spills = [ln for ln in report.splitlines() if "spill stores" in ln]
            print(json.dumps({"sm": sm, "dim": dim, "flat": flat,
                              "shared": compiled.metadata.shared,
                              "mma": "mma" in compiled.asm["ptx"], "spills": spills}),
                  flush=True)  # fmt: skip


def test_kernel_fits_each_gpu_and_keeps_its_tiles_in_registers() -> None:
    """Shared memory within each generation's limit, tensor cores used, and at most a few
    words spilled, on both grids (per segment, and flat for captured passes): ptxas gave 4 bytes for sm_80 at D = 512 under Triton 3.8, 116 under 3.6; the
    first choice of tiles (64 x 64 on 4 warps) spilled 3.7-29 KB."""
    import re

    rows = compiled_rows(__file__, list(_SMEM_LIMIT))
    assert len(rows) == 4 * len(_SMEM_LIMIT)  # two layer kinds, each grid
    for row in rows:
        assert row["shared"] <= _SMEM_LIMIT[row["sm"]] and row["mma"], row
        stores = [int(re.search(r"(\d+) bytes spill stores", s).group(1)) for s in row["spills"]]
        assert stores and max(stores) <= 256, row


if __name__ == "__main__":
    import sys

    _compile_for_targets([int(a) for a in sys.argv[1:]])
