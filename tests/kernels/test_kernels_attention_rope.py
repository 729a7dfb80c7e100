"""The batch step's attention made from the q|k|v output in one split launch
(engine/kernels/attention_rope.py) against the two launches it replaces: `qkv_rope_rows`
writing the new keys and values into the pool, then the paged split kernel on its q. Same pool
afterwards, same attention, on paged and ring layers, with a layer that reads another's cache,
and with the new key's pool row holding garbage before the step (the kernel reads its first
tile before it makes that key, and must not use the stale row)."""

from __future__ import annotations

import importlib
import os
import random
import sys
import threading

import pytest
import torch
from compile_support import compiled_rows

import engine
from engine.checkpoint_maker import make_checkpoint
from engine.kernels import attention_paged, attention_rope, fused
from engine.options import EngineOptions
from engine.sampling import SamplingParams

if os.environ.get("TRITON_INTERPRET") == "1":  # imported before conftest set it: rebuild
    attention_paged = importlib.reload(attention_paged)
    fused = importlib.reload(fused)
    attention_rope = importlib.reload(attention_rope)

H, DIM, EPS = 8, 32, 1e-6
SAME = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _inputs(rows: int, own: bool, v_from_k: bool, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = (H + (0 if not own else 1 if v_from_k else 2)) * DIM
    qkv = torch.randn(rows, width, generator=gen).to(dtype).to(device)
    q_norm = (1 + 0.2 * torch.randn(DIM, generator=gen)).to(dtype).to(device)
    k_norm = (1 + 0.2 * torch.randn(DIM, generator=gen)).to(dtype).to(device)
    angle = torch.rand(rows, DIM // 2, generator=gen) * 6.0
    cos = torch.cat([angle.cos(), angle.cos()], 1).to(dtype).to(device)
    sin = torch.cat([angle.sin(), angle.sin()], 1).to(dtype).to(device)
    return qkv, q_norm, k_norm, cos, sin


def _two_launches(att, qkv, q_norm, k_norm, cos, sin, k, v, positions, slots, table, new_rows,
                  v_from_k):  # fmt: skip
    """What the batch step launched before: qkv_rope_rows (writing the pool), then the split."""
    if new_rows is not None:
        q, _, _ = fused.qkv_rope_rows(qkv, q_norm, k_norm, cos, sin, H, 1, DIM, EPS,
                                      v_from_k=v_from_k,
                                      kv_out=(k.view(-1, 1, DIM), v.view(-1, 1, DIM),
                                              new_rows))  # fmt: skip
    else:
        q, _, _ = fused.qkv_rope_rows(qkv, q_norm, q_norm, cos, sin, H, 0, DIM, EPS)
    return att(q, k, v, positions, slots, table)


CASES = [
    # ring, own, v_from_k, use_dot, block_s, splits, dtype
    (False, True, False, True, 16, 3, torch.float32),
    (False, True, True, False, 4, 2, torch.bfloat16),
    (False, False, False, True, 16, 2, torch.float16),  # reads another layer's cache
    (True, True, False, True, 16, 3, torch.float32),
    (True, True, False, False, 8, 2, torch.bfloat16),
    (True, False, False, False, 4, 1, torch.float32),
]


@pytest.mark.parametrize(("ring", "own", "v_from_k", "use_dot", "block_s", "splits", "dtype"),
                         CASES)  # fmt: skip
def test_one_launch_equals_rope_then_split(device, ring, own, v_from_k, use_dot, block_s, splits,
                                           dtype):  # fmt: skip
    rng = random.Random(int(ring) * 10 + int(own) * 3 + block_s)
    rows, num_seqs, bsize, max_blocks, ring_slots = 4, 6, 8, 12, 40
    gen = torch.Generator().manual_seed(block_s + splits)
    if ring:
        pool_rows, table = num_seqs * ring_slots, None
        att = attention_paged.PagedDecodeAttention(
            H, DIM, 5, 4096, device, ring=True, ring_slots=ring_slots, window=30, scale=0.7,
            splits=splits, use_dot=use_dot, block_s=block_s)  # fmt: skip
        pos = [0, ring_slots - 1, 3 * ring_slots + 5, rng.randrange(ring_slots, 9 * ring_slots)]
    else:
        pool_rows = (num_seqs * max_blocks + 1) * bsize
        table = torch.randperm(num_seqs * max_blocks, generator=gen).view(num_seqs, max_blocks)
        table = table.to(torch.int32).to(device)
        att = attention_paged.PagedDecodeAttention(
            H, DIM, 5, max_blocks * bsize, device, ring=False, block_size=bsize, scale=0.7,
            splits=splits, use_dot=use_dot, block_s=block_s)  # fmt: skip
        pos = [0, 2 * bsize - 1, 2 * bsize, max_blocks * bsize - 1]
    rng.shuffle(pos)
    seqs = rng.sample(range(num_seqs), rows)
    positions = torch.tensor(pos, device=device)
    slots = torch.tensor(seqs, dtype=torch.int32, device=device)
    s64 = slots.long()
    if ring:
        new_rows = s64 * ring_slots + positions % ring_slots
    else:
        new_rows = table[s64, positions // bsize].long() * bsize + positions % bsize
    k = torch.randn(pool_rows, DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(pool_rows, DIM, generator=gen).to(dtype).to(device)
    if own:  # the rows this step writes hold garbage until it writes them
        k[new_rows] = float("nan")
        v[new_rows] = float("nan")
    qkv, q_norm, k_norm, cos, sin = _inputs(rows, own, v_from_k, dtype, device, seed=splits)
    written = new_rows if own else None

    k_two, v_two = k.clone(), v.clone()
    want = _two_launches(att, qkv, q_norm, k_norm, cos, sin, k_two, v_two, positions, slots,
                         table, written, v_from_k)  # fmt: skip
    got = attention_rope.rope_attention(att, qkv, q_norm, k_norm if own else None, cos, sin, EPS,
                                        k, v, positions, slots, table, new_rows=written,
                                        v_from_k=v_from_k)  # fmt: skip
    assert got.shape == (rows, H, DIM) and got.dtype == dtype
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < SAME[dtype]
    # the pool afterwards: the same new keys and values, nothing else touched
    if own:
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        assert rel_err(k[new_rows], k_two[new_rows]) < SAME[dtype]
        assert rel_err(v[new_rows], v_two[new_rows]) < SAME[dtype]
    others = torch.ones(pool_rows, dtype=torch.bool, device=device)
    others[new_rows] = False
    assert torch.equal(k[others], k_two[others]) and torch.equal(v[others], v_two[others])


def test_a_padding_row_gets_zeros_and_writes_nothing(device) -> None:
    ring_slots = 16
    att = attention_paged.PagedDecodeAttention(H, DIM, 2, 4096, device, ring=True,
                                               ring_slots=ring_slots, splits=2, use_dot=False,
                                               block_s=4)  # fmt: skip
    k = torch.randn(3 * ring_slots, DIM, device=device)
    v = torch.randn(3 * ring_slots, DIM, device=device)
    before = k.clone(), v.clone()
    qkv, q_norm, k_norm, cos, sin = _inputs(2, True, False, torch.float32, device, seed=1)
    positions = torch.tensor([5, -1], device=device)
    slots = torch.tensor([0, 2], device=device)
    new_rows = slots * ring_slots + positions % ring_slots
    got = attention_rope.rope_attention(att, qkv, q_norm, k_norm, cos, sin, EPS, k, v, positions,
                                        slots, new_rows=new_rows)  # fmt: skip
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(k[2 * ring_slots :], before[0][2 * ring_slots :])  # the padding ring
    assert not torch.equal(k[5], before[0][5])  # the live row's new key was written


def test_bad_shapes_are_refused(device) -> None:
    att = attention_paged.PagedDecodeAttention(H, DIM, 2, 64, device, ring=False, splits=2,
                                               use_dot=False, block_s=4)  # fmt: skip
    qkv, q_norm, k_norm, cos, sin = _inputs(2, True, False, torch.float32, device, seed=2)
    k = v = torch.zeros(128, DIM, device=device)
    pos = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="qkv must be"):
        attention_rope.rope_attention(att, qkv[:, :-1], q_norm, k_norm, cos, sin, EPS, k, v, pos,
                                      pos, torch.zeros(2, 8, dtype=torch.int32, device=device),
                                      new_rows=pos)  # fmt: skip
    with pytest.raises(ValueError, match="cos / sin"):
        attention_rope.rope_attention(att, qkv, q_norm, k_norm, cos[:1], sin, EPS, k, v, pos,
                                      pos, torch.zeros(2, 8, dtype=torch.int32, device=device),
                                      new_rows=pos)  # fmt: skip
    with pytest.raises(ValueError, match="k_norm"):
        attention_rope.rope_attention(att, qkv, q_norm, None, cos, sin, EPS, k, v, pos, pos,
                                      torch.zeros(2, 8, dtype=torch.int32, device=device),
                                      new_rows=pos)  # fmt: skip


def _compile_for_targets(targets: list[int]) -> None:
    """One JSON line per (target, layer kind): the E2B-sized kernel's loads and stores before
    and after the wait in its PTX with PDL. Run as a script."""
    import json

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    sig = dict.fromkeys(("qkv_ptr", "qn_ptr", "kn_ptr", "cos_ptr", "sin_ptr", "k_ptr", "v_ptr"),
                        "*bf16")  # fmt: skip
    sig |= {"new_ptr": "*i64", "pos_ptr": "*i64", "seq_ptr": "*i32", "bt_ptr": "*i32"}
    sig |= dict.fromkeys(("po_ptr", "pm_ptr", "pl_ptr"), "*fp32")
    sig |= dict.fromkeys(("R", "window", "max_keys"), "i32") | {"scale": "fp32", "eps": "fp32"}
    sig |= dict.fromkeys(("stride_qkv", "stride_ks", "stride_vs", "stride_bt"), "i32")
    for sm in targets:
        for ring, d in ((False, 512), (True, 256)):  # E2B's two layer kinds
            att = attention_paged.PagedDecodeAttention(8, d, 1, 64, "cpu", ring=ring,
                                                       ring_slots=64, use_dot=True)  # fmt: skip
            block_s, warps = attention_rope.rope_tiling(att)
            consts = {"H": 8, "HP": 16, "D": d, "BLOCK_S": block_s, "BLOCK_KV": 16,
                      "RING": ring, "USE_DOT": True, "OWN_KV": True, "V_FROM_K": False,
                      "PDL": sm >= 90}  # fmt: skip
            src = ASTSource(fn=attention_rope._rope_split_kernel, constexprs=consts,
                            signature=sig | dict.fromkeys(consts, "constexpr"))  # fmt: skip
            ptx = compile(src, target=GPUTarget("cuda", sm, 32),
                          options={"num_warps": warps, "num_stages": 2}).asm["ptx"]  # fmt: skip
            at = ptx.find("griddepcontrol.wait")
            head, tail = (ptx[:at], ptx[at:]) if at >= 0 else ("", ptx)
            print(json.dumps({"sm": sm, "ring": ring, "waits": ptx.count("griddepcontrol.wait"),
                              "loads_before": head.count("ld.global"),
                              "stores_before": head.count("st.global"),
                              "loads_after": tail.count("ld.global")}),
                  flush=True)  # fmt: skip


def test_hopper_binary_reads_the_cache_before_the_wait_and_the_qkv_row_after() -> None:
    rows = compiled_rows(__file__, [90])
    assert len(rows) == 2
    for row in rows:
        assert row["waits"] == 1, row
        # position, slot, table entry, cos / sin, norm weights, new row, the first keys and
        # values: all before; nothing is written before
        assert row["loads_before"] >= 8 and row["stores_before"] == 0, row
        assert row["loads_after"] >= 2, row  # the q|k|v row (and the further tiles)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_an_engine_with_rope_attention_makes_the_tokens_of_one_without(tmp_path) -> None:
    """Greedy fp32 tokens of eight overlapping requests (batched graph steps) and of one alone
    (the one-row graph), with the q/k/v work inside the split kernel and without."""
    make_checkpoint(tmp_path, preset="small", seed=5, emb4=True)
    prompts = [[2] + [(11 * i + 7 * j) % 900 + 20 for i in range(30 + 17 * j)] for j in range(8)]

    def tokens(rope: bool) -> list[list[int]]:
        eng = engine.load(tmp_path, device="cuda", dtype=torch.float32, max_context=1024,
                          max_num_seqs=8, options=EngineOptions(rope_attention=rope))  # fmt: skip
        params = SamplingParams(max_tokens=40, stop_ids=())
        got: dict[int, list[int]] = {-1: eng.generate(prompts[0], params)}
        threads = [threading.Thread(target=lambda j=j: got.__setitem__(j, eng.generate(
            prompts[j], params))) for j in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        eng.close()
        return [got[j] for j in range(-1, 8)]

    assert tokens(True) == tokens(False)


if __name__ == "__main__":
    _compile_for_targets([int(a) for a in sys.argv[1:]])
