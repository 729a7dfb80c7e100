"""llama.cpp as a third peer (issue 27): the Gemma-style synthetic tokenizer, GGUF export through
llama.cpp's own converter, and llama-server under the serving lifecycle through MCP.

The llama.cpp build (llama-server, llama-quantize, the source tree with convert_hf_to_gguf.py)
is `.ci/llama-cpp-build`'s, made once per machine outside the clone; tests that need it skip with
the reason where it is absent. One llama-server (2 slots, tiny bf16 checkpoint exported as f16)
is shared by the module's real tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from mcp import Client, StdioServerParameters
from server_support import free_port

from engine.checkpoint_maker import make_checkpoint
from engine.errors import InvalidInputError, NotFoundError, RefusedError
from engine.tokenizer_synth import (
    BOS_ID,
    SPECIAL_TOKENS,
    build_byte_level_tokenizer,
    build_tokenizer,
    byte_token_ids,
)
from tools import llamacpp
from tools.serving import LogsResult, QueryResult, ServerRecord, StatusReport, StopResult
from tools.serving.failures import diagnose
from tools.serving.llamacpp_backend import check_gguf, slots_and_context, unknown_flags
from tools.serving.startup_facts import parse_startup_facts

REPO = Path(__file__).resolve().parents[1]
GPURIG = [sys.executable, "-m", "mcp_server.cli"]  # this checkout's, whatever `gpurig` is on PATH
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
PROMPT = [BOS_ID, 105, 40, 41, 42, 43, 44, 45, 46]
NEW_TOKENS = 12


# ---- the tokenizer ----------------------------------------------------------------------------


def test_synthetic_tokenizer_is_structurally_gemma4s():
    tok = build_tokenizer(512)
    spec = json.loads(tok.to_str())
    model = spec["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] and model["merges"]
    assert spec["normalizer"] == {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    assert [d["type"] for d in spec["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse"]
    assert tok.get_vocab_size() == 512
    assert all(tok.token_to_id(t) == i for i, t in SPECIAL_TOKENS.items())
    assert len(set(byte_token_ids(tok))) == 256
    text = 'Hello world, the model answered: 東京 🙂 {"a": [1, 2]}\n'
    enc = tok.encode(text, add_special_tokens=False)
    assert "▁the" in enc.tokens and "<0xE6>" in enc.tokens  # a word start; a byte fallback
    assert len(enc.ids) < len(text.encode())  # merges, not one token per byte
    assert tok.decode(enc.ids) == text
    assert tok.decode([tok.token_to_id("▁the")]) == " the"


def test_a_checkpoint_with_the_older_byte_level_tokenizer_still_loads(tmp_path):
    import engine

    make_checkpoint(tmp_path / "old", preset="tiny", seed=0, quantized=False)
    (tmp_path / "old" / "tokenizer.json").write_text(build_byte_level_tokenizer(512).to_str())
    eng = engine.load(tmp_path / "old", device="cpu", max_context=64)
    ids = eng.tokenizer.encode("Hi there", add_special_tokens=False).ids
    assert len(ids) == len("Hi there") and eng.tokenizer.decode(ids) == "Hi there"
    with pytest.raises(RefusedError, match="byte-fallback"):  # llama.cpp could not read it
        llamacpp.export_gguf(tmp_path / "old", tmp_path / "old.gguf")


# ---- refusals, facts and failures (no llama.cpp needed) --------------------------------------


def test_export_refuses_what_the_converter_cannot_take(tmp_path):
    make_checkpoint(tmp_path / "w4", preset="tiny", seed=0, quantized=True)
    with pytest.raises(RefusedError, match="W4A16"):
        llamacpp.export_gguf(tmp_path / "w4", tmp_path / "w4.gguf")
    with pytest.raises(InvalidInputError, match="outtype"):
        llamacpp.export_gguf(tmp_path / "w4", tmp_path / "w4.gguf", outtype="q8")
    with pytest.raises(NotFoundError, match="does not exist"):
        llamacpp.export_gguf(tmp_path / "nope", tmp_path / "x.gguf")


def test_export_refuses_a_layer_order_llamacpps_loader_misreads(tmp_path):
    """llama.cpp gives a KV-shared full layer the cache of own layer n-1 and a sliding one that
    of n-2; the order the tiny preset had before (... full, sliding | sliding, full) made its
    loader abort, so it is refused before converting, with the rule."""
    order = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
             "sliding_attention", "full_attention"]  # fmt: skip
    make_checkpoint(tmp_path / "old", preset="tiny", seed=0, quantized=False,
                    overrides={"layer_types": order})  # fmt: skip
    with pytest.raises(RefusedError, match="layer 3 and a sliding one that of layer 2") as err:
        llamacpp.export_gguf(tmp_path / "old", tmp_path / "old.gguf")
    assert "real E2B" in err.value.remedy and not (tmp_path / "old.gguf").exists()


def test_serving_refuses_a_model_llamacpp_cannot_serve(tmp_path):
    with pytest.raises(InvalidInputError, match="local GGUF"):
        check_gguf(None, "google/gemma-4-E2B-it")
    (tmp_path / "x.gguf").write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidInputError, match="not a GGUF file"):
        check_gguf(str(tmp_path / "x.gguf"), "x.gguf")
    (tmp_path / "d").mkdir()
    with pytest.raises(InvalidInputError, match="export-gguf"):
        check_gguf(str(tmp_path / "d"), "d")
    (tmp_path / "ok.gguf").write_bytes(b"GGUF" + b"\x00" * 60)
    assert check_gguf(str(tmp_path / "ok.gguf"), "ok.gguf").endswith("ok.gguf")
    assert unknown_flags(["--ctx-sizee", "8", "-t", "2", "-1"], ["-t", "--ctx-size"]) == [
        "--ctx-sizee"
    ]
    assert slots_and_context(512, 2) == (2, 1024)


LOG = """\
build: 1 (0c1e570) with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu
llama_model_loader: - kv   0:                       general.architecture str              = gemma4
print_info: arch                  = gemma4
load_tensors:   CPU_Mapped model buffer size =     0.89 MiB
llama_context: n_seq_max     = 2
llama_context: n_ctx_seq     = 512
llama_kv_cache: size =    0.50 MiB (  1024 cells,   2 layers,  2/2 seqs), K (f16):    0.25 MiB
llama_kv_cache_iswa: creating SWA KV cache, size = 1024 cells
llama_kv_cache: size =    1.50 MiB (  1024 cells,   6 layers,  2/2 seqs), K (f16):    0.75 MiB
main: server is listening on http://127.0.0.1:8080 - starting the main loop
"""


def test_startup_facts_from_a_llama_server_log():
    facts = parse_startup_facts(LOG.splitlines())
    assert facts.architecture == "gemma4" and facts.slots == 2 and facts.max_context == 512
    assert facts.kv_cache_memory_gib == round(2.0 / 1024, 4) and facts.device == "CPU"
    assert facts.llamacpp_build == "1 (0c1e570)"
    assert facts.serving_url == "http://127.0.0.1:8080"


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        (
            "llama_model_load: error loading model: error loading model architecture: unknown "
            "model architecture: 'gemma9'",
            "llamacpp_unknown_architecture",
        ),
        (
            "gguf_init_from_file_impl: invalid magic characters: 'PK\x03\x04', expected 'GGUF'",
            "llamacpp_not_gguf",
        ),
        ("error: invalid argument: --ctx-sizee", "llamacpp_bad_flag"),
        (
            "start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080",
            "address_in_use",
        ),
    ],
)
def test_llama_server_failures_are_named(line, cause):
    failure = diagnose(["build: 1 (0c1e570)", line], {"returncode": 1})
    assert failure.cause == cause and failure.remedy


# The /metrics page of llama-server (0.3.36's llama.cpp) after two requests of one 20-token
# prompt, the second from its slot cache (19 of 20 tokens reused), as it printed it.
METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 25
llamacpp:prompt_tokens_cached_total 19
llamacpp:prompt_seconds_total 0.001149
llamacpp:tokens_predicted_total 11
llamacpp:n_decode_total 11
llamacpp:requests_processing 1
llamacpp:requests_deferred 2
llamacpp:n_busy_slots_per_decode 1
"""


def test_llamacpp_counters_read_as_the_sweeps_telemetry():
    from bench.sweep.telemetry import parse_metrics

    kept = parse_metrics(METRICS)
    # its prompt counter is the tokens it computed: the cached ones are counted apart
    assert kept["prompt_tokens"] == kept["prefix_cache_queries"] == 44
    assert kept["prefix_cache_hits"] == 19 and kept["generation_tokens"] == 11
    assert (kept["requests_running"], kept["requests_waiting"]) == (1, 2)


def test_llamacpp_probability_entries_land_on_their_tokens():
    """One entry per text piece: the byte tokens of an incomplete character are folded into
    the entry completing it, so position 1 (byte 0xCF) has none; the rest keep theirs."""
    from tools.compare_client import llamacpp_output

    def entry(tid: int, lp: float, *alts: tuple[int, float]) -> dict:
        top = [{"id": tid, "logprob": lp}] + [{"id": a, "logprob": v} for a, v in alts]
        return {"id": tid, "token": "?", "logprob": lp, "top_logprobs": top}

    out = llamacpp_output([51, 207, 130, 507], [entry(51, -3.9, (298, -4.2)), entry(130, -3.0),
                                                entry(507, -3.5, (337, -4.1))])  # fmt: skip
    assert out.logprobs == [-3.9, None, -3.0, -3.5]
    assert out.top[0] == {51: -3.9, 298: -4.2} and out.top[1] == {} and out.top[3][337] == -4.1
    assert llamacpp_output([5, 6], None).logprobs == [None, None]  # no entries: nothing invented


# ---- the real llama.cpp ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converter() -> Path:
    try:
        return llamacpp.find_converter()
    except NotFoundError as exc:
        pytest.skip(f"{exc.message}: {exc.remedy}")


@pytest.fixture(scope="module")
def server_bin() -> Path:
    try:
        return llamacpp.find_binary("llama-server")
    except NotFoundError as exc:
        pytest.skip(f"{exc.message}: {exc.remedy}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llamacpp")
    make_checkpoint(root / "tiny", preset="tiny", seed=0, quantized=False)  # bf16
    return root / "tiny"


@pytest.fixture(scope="module")
def gguf(tiny: Path, converter: Path) -> Path:
    result = llamacpp.export_gguf(tiny, tiny.parent / "tiny.gguf", outtype="f16")
    assert result.converter == str(converter)
    return Path(result.path)


def test_export_through_llamacpps_converter(gguf: Path, tiny: Path):
    assert llamacpp.is_gguf(gguf) and gguf.stat().st_size > 100_000
    again = subprocess.run(
        [*GPURIG, "engine", "export-gguf", str(tiny), "--out", str(gguf)],
        capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60, check=False,
    )  # fmt: skip
    assert again.returncode == 2 and "already exists" in again.stderr  # no silent overwrite


def test_q4_0_export_through_llama_quantize(gguf: Path, tiny: Path):
    """q4_0: the f16 GGUF, then llama.cpp's own llama-quantize; its own gguf-py reads the
    result as MOSTLY_Q4_0 (file type 2) with Q4_0 tensors, and the f16 intermediate is gone."""
    try:
        llamacpp.find_binary("llama-quantize")
    except NotFoundError as exc:
        pytest.skip(f"{exc.message}: {exc.remedy}")
    out = tiny.parent / "tiny-q4_0.gguf"
    result = llamacpp.export_gguf(tiny, out, outtype="q4_0")
    assert result.quantizer and llamacpp.is_gguf(out) and result.bytes < gguf.stat().st_size
    assert sorted(p.name for p in tiny.parent.glob("*.gguf")) == ["tiny-q4_0.gguf", "tiny.gguf"]
    sys.path.insert(0, str(llamacpp.llama_cpp_dir() / "src" / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    reader = GGUFReader(str(out))
    field = reader.fields["general.file_type"]
    assert int(field.parts[field.data[0]][0]) == 2
    assert sum(t.tensor_type.name == "Q4_0" for t in reader.tensors) >= 30


async def _call(client: Client, name: str, args: dict):
    result = await client.call_tool(name, args)
    assert not result.is_error, result.content
    return result.structured_content


async def _lifecycle(params: StdioServerParameters, gguf: Path, port: int) -> tuple:
    async with Client(params, read_timeout_seconds=120) as client:
        args = {"model": str(gguf), "backend": "llamacpp", "name": "llama", "port": port,
                "max_num_seqs": 2, "max_model_len": 512, "timeout_s": 90}  # fmt: skip
        record = ServerRecord.model_validate(await _call(client, "start_vllm_server", args))
        status = StatusReport.model_validate(await _call(client, "server_status", {}))
        query = QueryResult.model_validate(
            await _call(client, "query_model", {"prompt": "Hi", "max_tokens": 4})
        )
        logs = LogsResult.model_validate(await _call(client, "get_server_logs", {"tail": 400}))
        return record, status, query, logs


@pytest.fixture(scope="module")
def llama(gguf: Path, server_bin: Path, tmp_path_factory):
    """One llama-server started through a `gpurig mcp` process, shared by the module's tests,
    stopped through MCP after them."""
    home = tmp_path_factory.mktemp("llama-home")
    env = {**ENV, "GPURIG_HOME": str(home), "GPURIG_LLAMA_SERVER": str(server_bin)}
    params = StdioServerParameters(command=GPURIG[0], args=[*GPURIG[1:], "mcp"], env=env,
                                   cwd=str(REPO))  # fmt: skip
    port = free_port()
    started = asyncio.run(asyncio.wait_for(_lifecycle(params, gguf, port), timeout=180))
    yield started
    asyncio.run(asyncio.wait_for(_stop(params), timeout=60))


async def _stop(params: StdioServerParameters) -> StopResult:
    async with Client(params, read_timeout_seconds=60) as client:
        return StopResult.model_validate(await _call(client, "stop_vllm_server", {"name": "llama"}))


def test_llama_server_lifecycle_through_mcp(llama):
    record, status, query, logs = llama
    assert record.state == "ready", record.failure
    assert record.backend == "llamacpp" and record.served_model_name == "tiny"
    assert {"-np", "--metrics", "--alias"} <= set(record.command)
    facts = record.startup_facts
    assert facts.architecture == "gemma4" and facts.slots == 2 and facts.max_context == 512
    assert facts.load_seconds and facts.load_seconds > 0
    (server,) = status.servers
    assert (server.state, server.health) == ("ready", "ok")
    assert query.completion_tokens >= 1
    assert logs.lines


def test_llama_server_greedy_tokens_match_the_engine(llama, tiny: Path):
    """Token ids in, token ids out (native /completion with return_tokens and n_probs): the f16
    GGUF of a bf16 checkpoint and the engine agree greedily."""
    import engine
    from engine.sampling import SamplingParams

    record = llama[0]
    root = record.base_url.removesuffix("/v1")
    body = {"prompt": PROMPT, "n_predict": NEW_TOKENS, "temperature": 0, "return_tokens": True,
            "n_probs": 3, "cache_prompt": False, "ignore_eos": True}  # fmt: skip
    answer = httpx.post(f"{root}/completion", json=body, timeout=60).json()
    theirs = answer["tokens"]
    eng = engine.load(tiny, device="cpu", max_context=256)
    ours = eng.generate(PROMPT, SamplingParams(max_tokens=NEW_TOKENS, stop_ids=()))
    assert theirs == ours
    # one entry per piece of text: llama.cpp folds the tokens of an incomplete UTF-8 character
    # into the entry that completes it, so the entries' ids are the tokens in order, some skipped
    probs = [e["id"] for e in answer["completion_probabilities"]]
    rest = iter(theirs)
    assert probs and all(any(t == p for t in rest) for p in probs), (probs, theirs)
    assert all(len(e["top_logprobs"]) == 3 for e in answer["completion_probabilities"])
    vocab = httpx.post(f"{root}/tokenize", json={"content": "Hello world"}, timeout=10).json()
    assert vocab["tokens"] == eng.tokenizer.encode("Hello world", add_special_tokens=False).ids
    metrics = httpx.get(f"{root}/metrics", timeout=10).text
    assert "llamacpp:tokens_predicted_total" in metrics


def test_a_sweep_by_url_alone_gets_llamacpps_vocabulary(llama, tmp_path):
    """llama-server known only by its URL: its /tokenize and /detokenize (llama.cpp's shapes)
    give the prompt vocabulary, so the prompts are exact token ids, and its counters the
    telemetry."""
    from bench.sweep import run_sweep
    from bench.sweep.store import SweepStore

    result = run_sweep(
        targets=[{"label": "llama", "base_url": llama[0].base_url}], input_lens=[24],
        output_len=4, concurrency=[2], repeats=1, prompts_per_cell=4, out_dir=str(tmp_path / "s"),
    )  # fmt: skip
    store = SweepStore(result.out_dir)
    (cell,) = store.load_cells()
    assert store.load_config().prompt_source == "server" and cell.status == "ok", cell.reason
    assert {r.prompt_tokens for r in cell.requests} == {24}
    assert cell.telemetry.metrics_after["generation_tokens"] >= 16
