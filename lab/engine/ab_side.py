"""One side of lab/engine/ab.py: the metrics measured in a fresh process over one tree's
`engine` (that tree's root first on `sys.path`), through an adapter for each of the two engine
APIs, with the KV filled with random keys to a depth (decode cost depends on how many slots are
read, not on what they hold). ab.py loads this file by its path, not as `lab.engine.ab_side`:
in the side's process `bench` and `engine` are the other tree's."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

STEPS = 64  # decode steps timed per measurement
WARM = 3  # steps before timing (capture, tuning)


# ---- the two engine APIs -----------------------------------------------------------------------
class NewAPI:
    """The one-design engine (issue 23): EngineConfig, SamplingParams, a pool for every caller."""

    name = "new"

    def __init__(self, engine) -> None:
        self.engine = engine

    def load(self, ckpt: Path, **fields: Any):
        return self.engine.load(ckpt, self.engine.EngineConfig(**fields))

    def generate(self, eng, ids: list[int], n: int) -> list[int]:
        return eng.generate(ids, self.engine.SamplingParams(max_tokens=n, stop_ids=()))

    def load_batching(self, ckpt: Path, rows: int, **fields: Any):
        return self.load(ckpt, max_num_seqs=rows, **fields)

    def rows_step(self, eng, rows: int, tokens: int):
        """`rows` pool slots holding positions 0..tokens-1 and the runner's step over them."""
        pool = eng.pool
        slots = [pool.blocks.open_slot() for _ in range(rows)]
        grants = tuple(g for s in slots if (g := pool.blocks.grow(s, tokens)) is not None)
        pool.apply(tuple(slots), grants)
        return pool, slots, eng.runner.step

    def release(self, eng, slots: list[int]) -> None:
        for s in slots:
            eng.pool.blocks.close_slot(s)

    def generate_together(self, eng, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Every prompt queued at once, then the engine stepped until all are done."""
        out: dict[int, list[int]] = {}

        def sink(seq, output) -> None:
            out.setdefault(seq.id, []).extend(output.tokens)

        params = self.engine.SamplingParams(max_tokens=n, stop_ids=())
        seqs = [eng.add_request(p, params, sink) for p in prompts]
        while eng.step():
            pass
        return [out.get(s.id, []) for s in seqs]

    def close(self, eng) -> None:
        eng.close()


class OldAPI:
    """The engine before issue 23: `generate(ids, n, stop_ids=[])`, a KVCache and
    `eng.backend.step()` when loaded without max_num_seqs, else a pool and a scheduler thread
    whose BatchRunner steps rows."""

    name = "old"

    def __init__(self, engine) -> None:
        self.engine = engine

    def load(self, ckpt: Path, **fields: Any):
        return self.engine.load(ckpt, **fields)

    def generate(self, eng, ids: list[int], n: int) -> list[int]:
        return eng.generate(ids, n, stop_ids=[])

    def load_batching(self, ckpt: Path, rows: int, **fields: Any):
        return self.load(ckpt, max_num_seqs=rows, **fields)

    def rows_step(self, eng, rows: int, tokens: int):
        pool = eng.pool
        slots = [pool.open_slot() for _ in range(rows)]
        for s in slots:
            if not pool.grow(s, tokens):
                raise RuntimeError(f"the pool does not hold {rows} x {tokens} tokens")
        return pool, slots, eng.scheduler.runner.step

    def release(self, eng, slots: list[int]) -> None:
        for s in slots:
            eng.pool.close_slot(s)

    def generate_together(self, eng, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Every stream opened at once (the scheduler's thread decodes them together)."""
        gens = [eng.stream(p, n, stop_ids=[]) for p in prompts]
        return [list(g) for g in gens]

    def close(self, eng) -> None:
        eng.close()


def api_of(engine) -> NewAPI | OldAPI:
    return NewAPI(engine) if hasattr(engine, "EngineConfig") else OldAPI(engine)


# ---- filling the KV with random keys -----------------------------------------------------------
def _fill(k, v, pos, rows, positions, gen) -> None:
    """Random K/V into `rows` (recorded as holding `positions`), in pieces."""
    import torch

    for i in range(0, positions.numel(), 8192):
        r, p = rows[i : i + 8192], positions[i : i + 8192]
        shape = (p.numel(), *k.shape[1:])
        k[r] = torch.randn(shape, device=k.device, generator=gen).to(k.dtype)
        v[r] = torch.randn(shape, device=v.device, generator=gen).to(v.dtype)
        pos[r] = p


def fill_cache(cache, depth: int, device) -> None:
    """An old KVCache as if positions 0..depth-1 had been read (decode cost depends on how many
    slots are read, not on what they hold)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(depth)
    for layer in cache.layers.values():
        layer.pos.fill_(-1)
        if depth == 0:
            continue
        if layer.window is None:
            positions = torch.arange(min(depth, layer.slots), device=device)
            slots = positions
        else:
            positions = torch.arange(max(0, depth - layer.slots), depth, device=device)
            slots = positions % layer.slots
        _fill(layer.k, layer.v, layer.pos, slots, positions, gen)


def fill_pool(pool, cfg, slots: list[int], depth: int) -> None:
    """Pool slots (both trees' KVPool: full layers in blocks, sliding layers in a ring of
    `ring_slots` rows per slot) as if each had read positions 0..depth-1."""
    import torch

    gen = torch.Generator(device=pool.device).manual_seed(depth)
    r = pool.ring_slots
    for slot in slots:
        for i in pool.k:
            if cfg.is_sliding(i):
                pool.pos[i][slot * r : (slot + 1) * r].fill_(-1)
                positions = torch.arange(max(0, depth - r), depth, device=pool.device)
                rows = slot * r + positions % r
            else:
                positions = torch.arange(depth, device=pool.device)
                rows = pool.rows_of(slot, positions)
            if depth:
                _fill(pool.k[i], pool.v[i], pool.pos[i], rows, positions, gen)


# ---- one side ----------------------------------------------------------------------------------
class Side:
    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        sys.path.insert(0, str(root))
        import torch

        import engine

        self.torch = torch
        self.api = api_of(engine)
        self.args = args
        self.ckpt = args.ckpt
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.out: dict[str, Any] = {"root": str(root), "engine_file": engine.__file__,
                                    "api": self.api.name}  # fmt: skip

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def limit(self) -> int:
        cfg = json.loads((self.ckpt / "config.json").read_text())
        return int(cfg.get("text_config", cfg)["max_position_embeddings"])

    def timed_steps(self, step, tokens, positions) -> float:
        """tok/s of STEPS steps of `step(tokens, positions)` back to back, after WARM steps."""
        with self.torch.no_grad():
            for _ in range(WARM):
                step(tokens, positions)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                tokens = step(tokens, positions).argmax(-1)
                positions += 1
            self.sync()
        return tokens.numel() * STEPS / (time.perf_counter() - t0)

    def decode(self) -> None:
        torch, api = self.torch, self.api
        ctx = min(self.limit(), max(self.args.depths) + STEPS + WARM + 1)
        eng = api.load(self.ckpt, device=self.device, max_context=ctx)
        for depth in self.args.depths:
            d = min(depth, ctx - STEPS - WARM - 1)
            tok = torch.tensor([7], device=eng.device)
            pos = torch.tensor([d], device=eng.device)
            if isinstance(api, OldAPI):
                fill_cache(eng.cache, d, eng.device)
                rate = self.timed_steps(eng.backend.step(), tok, pos)
            else:
                pool, slots, step = api.rows_step(eng, 1, ctx)
                fill_pool(pool, eng.config, slots, d)
                s = torch.tensor(slots, dtype=torch.int32, device=eng.device)
                rate = self.timed_steps(lambda t, p, step=step, s=s: step(t, p, s), tok, pos)
                api.release(eng, slots)
            self.out[f"decode_1row_depth_{depth}_tok_per_s"] = rate
            if d != depth:
                self.out[f"decode_1row_depth_{depth}_measured_at"] = d
        self.out["_engine"] = eng  # reused by e2e / prompt when they run in this process

    def batch(self) -> None:
        torch, api = self.torch, self.api
        depth = self.args.batch_depth
        rows_list = self.args.rows
        ctx = depth + STEPS + WARM + 64
        eng = api.load_batching(self.ckpt, max(rows_list), device=self.device, max_context=ctx)
        for rows in rows_list:
            pool, slots, step = api.rows_step(eng, rows, ctx)
            fill_pool(pool, eng.config, slots, depth)
            tok = torch.full((rows,), 7, dtype=torch.int64, device=eng.device)
            pos = torch.full((rows,), depth, dtype=torch.int64, device=eng.device)
            s = torch.tensor(slots, dtype=torch.int32, device=eng.device)
            rate = self.timed_steps(lambda t, p, step=step, s=s: step(t, p, s), tok, pos)
            api.release(eng, slots)
            self.out[f"decode_{rows}rows_depth_{depth}_tok_per_s"] = rate
        api.close(eng)

    def _plain_engine(self):
        eng = self.out.pop("_engine", None)
        if eng is None:
            ctx = min(self.limit(), self.args.prompt + 256)
            eng = self.api.load(self.ckpt, device=self.device, max_context=ctx)
        return eng

    def prompt_ids(self, n: int) -> list[int]:
        torch = self.torch
        cfg = json.loads((self.ckpt / "config.json").read_text())
        vocab = int(cfg.get("text_config", cfg)["vocab_size"])
        gen = torch.Generator().manual_seed(n)
        return [2] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist()

    def best_time(self, fn, repeats: int = 3) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    def e2e(self) -> None:
        eng, n = self._plain_engine(), self.args.e2e_tokens
        ids = self.prompt_ids(16)
        t = self.best_time(lambda: self.api.generate(eng, ids, n))
        self.out[f"e2e_1row_{n}_tok_per_s"] = n / t
        self.out["_engine"] = eng

    def prompt(self) -> None:
        eng, n = self._plain_engine(), self.args.prompt
        if n + 1 > eng.max_context:
            eng = self.api.load(self.ckpt, device=self.device, max_context=n + 256)
        ids = self.prompt_ids(n)
        self.out[f"prompt_{n}_first_token_s"] = self.best_time(
            lambda: self.api.generate(eng, ids, 1)
        )
        self.out["_engine"] = eng

    def long(self) -> None:
        torch, a = self.torch, self.args
        eng = self.api.load(self.ckpt, device=self.device, max_context=a.long_context,
                            memory_cap_mib=a.cap)  # fmt: skip
        ids = self.prompt_ids(a.long)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        first = self.api.generate(eng, ids, 1)
        self.sync()
        self.out[f"long_{a.long}_first_token_s"] = time.perf_counter() - t0
        if self.cuda:
            self.out[f"long_{a.long}_peak_allocated_mib"] = (
                torch.cuda.max_memory_allocated() / 2**20
            )
        self.out["long_first_token"] = first

    def identity(self) -> None:
        torch, api = self.torch, self.api
        off = api.engine.EngineOptions(fast="off")
        ids, n = [2, *range(100, 131)], 32
        fast = api.load(self.ckpt, device=self.device, dtype=torch.float32, max_context=1024)
        self.out["fp32_greedy_fast"] = api.generate(fast, ids, n)
        del fast
        ref = api.load(self.ckpt, device=self.device, dtype=torch.float32, max_context=1024,
                       options=off)  # fmt: skip
        self.out["fp32_greedy_reference"] = api.generate(ref, ids, n)
        del ref
        eng = api.load_batching(self.ckpt, 16, device=self.device, dtype=torch.float32,
                                max_context=512)  # fmt: skip
        prompts = [self.prompt_ids(5 + 9 * i) for i in range(16)]
        together = api.generate_together(eng, prompts, 24)
        alone = [api.generate(eng, p, 24) for p in prompts]
        self.out["batch_vs_alone_equal"] = [a == b for a, b in zip(together, alone, strict=True)]
        self.out["batch_tokens"] = together
        api.close(eng)

    def run(self, metrics: list[str]) -> dict[str, Any]:
        for m in metrics:
            t0 = time.perf_counter()
            getattr(self, m)()
            self.out[f"{m}_wall_s"] = round(time.perf_counter() - t0, 1)
        self.out.pop("_engine", None)
        return self.out
