"""The `Engine`: a loaded checkpoint, its tokenizer and KV cache, and the generate/stream calls.

Two ways to hold the KV cache, chosen at load:
* one sequence (the default): a `KVCache` for the whole context; one generation at a time (not
  thread-safe), as the CLI and the benchmarks use it;
* many sequences (`max_num_seqs`, what the OpenAI server loads): a block pool shared by every
  sequence and a scheduler thread (engine/scheduler.py) that batches their decode steps;
  `stream` is then safe from any thread and every open stream advances in the same steps.
See the package docstring (engine/__init__.py) for the public surface.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.backend import Backend, make_kernels, prefill_chunk_for
from engine.cache import KVCache
from engine.chat.render import read_template
from engine.checkpoint import CheckpointReader
from engine.config import TextConfig, load_config
from engine.errors import CheckpointError, EngineError, GenerationError
from engine.generate import (
    GenerationState,
    SamplingParams,
    check_prompt,
    generate_stream,
)
from engine.generation import Generation
from engine.kernels.tuning import configure as configure_tuning
from engine.memory import MemoryReport, apply_memory_cap, build_report, plan_prompt
from engine.model import Gemma4Model
from engine.options import EngineOptions, default_dtype


class Engine:
    """A Gemma 4 model in packed 4-bit on one device, ready to generate."""

    def __init__(
        self,
        model_dir: Path,
        cfg: TextConfig,
        model: Gemma4Model,
        cache: KVCache | None,
        tokenizer: Tokenizer,
        chat_template: str | None,
        prefill_chunk: int,
        memory_cap_mib: int | None,
        options: EngineOptions | None = None,
        max_context: int | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.model_name = model_name_of(model_dir)
        self.config = cfg
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.prefill_chunk = prefill_chunk
        self.memory_cap_mib = memory_cap_mib
        self.device = model.device
        self.dtype = model.dtype
        self.max_context = cache.max_context if cache is not None else int(max_context or 0)
        self.bos_id: int | None = cfg.bos_token_id
        self.eos_ids: list[int] = list(cfg.eos_token_ids)
        self.options = options or EngineOptions()
        # how this engine computes, chosen once: it owns the fused weights and the decoder
        self.backend = Backend(model, cache, self.options)
        self._run_id = 0
        # set by `load(max_num_seqs=...)`: the pool, the scheduler and how they were sized
        self.pool = None
        self.scheduler = None
        self.batching = None

    def close(self) -> None:
        """Stop the scheduler thread of a multi-sequence engine (open streams end with an
        error); nothing to do for a single-sequence one."""
        if self.scheduler is not None:
            self.scheduler.close()

    def stream(
        self,
        token_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_ids: list[int] | None = None,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
    ) -> Generation:
        """The new token ids as they are made: a `Generation` (engine/generation.py), which
        also carries finish_reason, the token counts and timings. logprobs k (0 or more): each
        token's log-probability and the step's top k in `Generation.logprobs`
        (engine/logprobs.py: of the raw logits, before logit_bias and temperature). stop_ids None means the
        checkpoint's eos ids (generation_config.json); pass [] to stop only at max_new_tokens.
        The stop id that ends the generation is not yielded. logit_bias {token id: bias} is
        added to the logits before sampling (greedy too). Bad arguments raise before the
        first token."""
        stops = set(self.eos_ids if stop_ids is None else stop_ids)
        sampling = SamplingParams(
            temperature=temperature or 0.0,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            logit_bias=tuple((int(t), float(b)) for t, b in (logit_bias or {}).items()),
        )
        sampling.validate(self.config.vocab_size)
        check_prompt(list(token_ids), self.config.vocab_size, self.max_context)
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens {max_new_tokens} is negative", "use 0 or more")
        if logprobs is not None and not 0 <= logprobs <= self.config.vocab_size:
            raise GenerationError(
                f"logprobs {logprobs} is outside [0, {self.config.vocab_size}]",
                "ask for 0 (the token's own) up to the vocabulary's size",
            )
        chunk = self.prefill_chunk
        if self.batching is not None:
            chunk = min(chunk, self.batching.prefill_budget)
        plan = None
        if max_new_tokens:  # refused now, not as an out-of-memory error halfway through reading
            plan = plan_prompt(self.model, len(token_ids), chunk, self.memory_cap_mib)
        if self.scheduler is not None:
            return self.scheduler.submit(
                list(token_ids), max_new_tokens, sampling, stops,
                plan.chunk if plan is not None else chunk,
                plan.score_budget if plan is not None else None, logprobs,
            )  # fmt: skip
        return self._run(list(token_ids), max_new_tokens, sampling, stops, logprobs)

    def _run(
        self, prompt: list[int], max_new: int, sampling: SamplingParams, stops: set[int],
        logprobs: int | None = None,
    ) -> Generation:  # fmt: skip
        """One generation; a newer one on this engine reuses the cache, so this one then stops
        with an error instead of yielding tokens from a cache that is no longer its own."""
        self._run_id += 1
        run_id, state = self._run_id, GenerationState()
        logprob_list = [] if logprobs is not None else None
        steps = generate_stream(
            self.model, self.cache, prompt, max_new, sampling, stops, self.prefill_chunk, state,
            self.memory_cap_mib, self.backend, logprobs, logprob_list,
        )  # fmt: skip

        def guarded() -> Iterator[int]:
            try:
                while True:
                    if self._run_id != run_id:  # checked before touching the cache again
                        raise EngineError(
                            "another generation started on this engine while this one was open",
                            "run one generation at a time (close or finish a stream before the "
                            "next)",
                        )
                    tok = next(steps, None)
                    if tok is None:
                        return
                    yield tok
            finally:
                steps.close()

        device = self.device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        return Generation(guarded(), state, len(prompt), sync, logprob_list)

    def generate(
        self,
        token_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_ids: list[int] | None = None,
        logit_bias: dict[int, float] | None = None,
    ) -> list[int]:
        """The new token ids (the ending stop id excluded). For the finish reason, counts and
        timings, iterate `stream` (same arguments) and read its `Generation`."""
        return list(
            self.stream(
                token_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids, logit_bias
            )
        )

    def memory_report(self) -> MemoryReport:
        kv = self.cache if self.cache is not None else self.pool
        return build_report(
            self.model.nbytes_by_part(),
            kv.nbytes() if kv is not None else 0,
            self.max_context,
            self.device,
            self.dtype,
            self.memory_cap_mib,
        )


def model_name_of(model_dir: Path) -> str:
    """The name to serve a checkpoint under: its directory's name, or for a Hugging Face cache
    snapshot (.../models--ORG--NAME/snapshots/HASH) the repo id ORG/NAME, not the hash."""
    hub = model_dir.parent.parent.name
    if model_dir.parent.name == "snapshots" and hub.startswith("models--"):
        return hub.removeprefix("models--").replace("--", "/")
    return model_dir.name


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    max_context: int | None = None,
    memory_cap_mib: int | None = None,
    prefill_chunk: int | None = None,
    dtype: torch.dtype | None = None,
    options: EngineOptions | None = None,
    max_num_seqs: int | str | None = None,
    prefill_budget: int | None = None,
    kv_cache_mib: float | None = None,
    warm_up: bool = True,
) -> Engine:
    """Load a Gemma 4 W4A16 checkpoint directory onto `device` (default: cuda if present).

    max_context: positions the KV cache holds (default the model's max_position_embeddings).
    prefill_chunk: the most prompt tokens read per forward pass (default 4,096 on CUDA, 256 on
    the CPU; each prompt's chunk is lowered to what the memory left holds). dtype: compute dtype
    (default `engine.options.default_dtype`: bfloat16 on CUDA from capability 8.0, float16 on
    older GPUs, float32 on the CPU). memory_cap_mib: cap this process's CUDA memory.
    options: every other switch (EngineOptions; default: the defaults, not the environment;
    front doors pass `EngineOptions.from_env()`).

    max_num_seqs (an int, or "auto"): serve many sequences at once from a shared KV block pool
    with continuous batching (engine/batching.py sizes it: the memory left after the weights,
    or `kv_cache_mib`); prefill_budget: the most prompt tokens read between two decode steps
    (default: the prompt chunk, at most 2,048 on CUDA); warm_up: capture the batch graphs now.
    """
    options = options or EngineOptions()
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory", "pass a checkpoint directory")
    try:
        dev = torch.device(device) if device is not None else default_device()
    except (RuntimeError, TypeError) as exc:
        raise EngineError(
            f"device {device!r} is not a device name", "use cpu, cuda or cuda:N"
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(
            "CUDA was asked for but no CUDA device is available", "use the cpu device"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise EngineError(
            f"{dev} does not exist: this host has {torch.cuda.device_count()} CUDA device(s)",
            "use cuda:0 .. cuda:N-1, or cuda",
        )
    if dev.type not in ("cpu", "cuda"):
        raise EngineError(f"device {dev} is not supported", "use cpu or cuda")
    compute_dtype = dtype or default_dtype(dev.type, _capability(dev))
    cfg = load_config(model_dir)
    limit = cfg.max_position_embeddings
    ctx = limit if max_context is None else int(max_context)
    if not 1 <= ctx <= limit:
        raise EngineError(
            f"max_context {ctx} is outside [1, {limit}] (the model's max_position_embeddings)",
            f"pass a max_context between 1 and {limit}",
        )
    chunk = prefill_chunk_for(dev) if prefill_chunk is None else int(prefill_chunk)
    if chunk < 1:
        raise EngineError(f"prefill_chunk {chunk} must be at least 1", "use e.g. 256")
    tokenizer = _load_tokenizer(model_dir)
    apply_memory_cap(dev, memory_cap_mib, options.expandable_segments)
    configure_tuning(options.autotune, options.tuning_cache_dir)
    reader = CheckpointReader(model_dir)
    try:
        model = Gemma4Model.load(reader, cfg, dev, compute_dtype, make_kernels(options, dev))
    finally:
        reader.close()
    if max_num_seqs is None:
        return Engine(model_dir, cfg, model, KVCache(cfg, ctx, dev, compute_dtype), tokenizer,
                      read_template(model_dir), chunk, memory_cap_mib, options)  # fmt: skip
    from engine import batching

    budget = prefill_budget if prefill_budget is not None else min(chunk, 2048)
    if budget < 1:
        raise EngineError(f"prefill_budget {budget} must be at least 1", "use e.g. 512")
    plan = batching.plan(model, ctx, max_num_seqs, budget, memory_cap_mib, kv_cache_mib)
    engine = Engine(model_dir, cfg, model, None, tokenizer, read_template(model_dir), chunk,
                    memory_cap_mib, options, max_context=ctx)  # fmt: skip
    engine.batching = plan
    engine.pool, engine.scheduler = batching.start(
        model, engine.backend, options, plan, ctx, warm_up=warm_up
    )
    return engine


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability (None on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _load_tokenizer(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir} has no tokenizer.json",
            "copy the model's tokenizer.json into the checkpoint directory",
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise CheckpointError(f"{path} is not a readable tokenizer: {exc}", "restore it") from exc
