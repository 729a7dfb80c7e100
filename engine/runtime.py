"""The `Engine`: a loaded checkpoint, its tokenizer, its KV block pool, and one step loop.

One design for every caller (nano-vllm's, vLLM v1's): a request becomes a `Sequence` in the
scheduler's waiting line (engine/scheduler.py decides each step, engine/runner.py runs it over
the pool), and `step()` advances every open request by one decode step. A single sequence is a
batch of one row. `stream` returns a `Generation` that steps the engine while its consumer
waits for a token, so the CLI and the benchmarks need no thread; for the OpenAI server the
engine is a `ServedEngine` (engine/interface.py), stepped by one thread of its own while it has
work (engine/process/local.py). Steps are serialised by a lock, so `stream` is safe from any
thread.
See the package docstring (engine/__init__.py) for the public surface.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine import batching
from engine.batching import BatchingPlan
from engine.chat.render import read_template
from engine.checkpoint import CheckpointReader
from engine.config import TextConfig, load_config
from engine.errors import CheckpointError, EngineError
from engine.generation import Generation
from engine.interface import EngineFacts
from engine.kernels.tuning import tuning_settings
from engine.kv_pool import KVPool
from engine.memory import MemoryReport, PromptPlanner, apply_memory_cap, build_report
from engine.model import Gemma4Model
from engine.options import EngineConfig, EngineOptions, default_dtype, triton_interpreted
from engine.process.local import StepThread
from engine.runner import Launched, ModelRunner, make_kernels, prefill_chunk_for
from engine.sampling import SamplingParams, check_prompt
from engine.scheduler import Scheduler, SchedulerStats
from engine.sequence import Sequence, Sink
from engine.warmup import WarmUpReport
from engine.warmup import warm_up as run_warm_up

log = logging.getLogger(__name__)


class Engine:
    """A Gemma 4 model in packed 4-bit on one device, ready to generate."""

    def __init__(
        self,
        model_dir: Path,
        cfg: TextConfig,
        model: Gemma4Model,
        tokenizer: Tokenizer,
        chat_template: str | None,
        prefill_chunk: int,
        memory_cap_mib: int | None,
        options: EngineOptions,
        plan: BatchingPlan,
        warm_up: bool = True,
    ) -> None:
        self.model_dir = model_dir
        self.model_name = model_name_of(model_dir)
        self.config = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.prefill_chunk = prefill_chunk
        self.memory_cap_mib = memory_cap_mib
        self.prompt_planner = PromptPlanner(model, memory_cap_mib)  # each request's reading
        self.device = model.device
        self.dtype = model.dtype
        self.max_context = plan.geometry.max_context
        self.bos_id: int | None = cfg.bos_token_id
        self.eos_ids: list[int] = list(cfg.eos_token_ids)
        self.facts = EngineFacts(model_dir, self.model_name, self.max_context, cfg.vocab_size,
                                 self.bos_id, tuple(self.eos_ids), chat_template,
                                 str(self.device))  # fmt: skip
        self.options = options
        self.batching = plan
        self.pool = KVPool(cfg, plan.geometry, model.device, model.dtype)
        self.runner = ModelRunner(model, self.pool, options, plan.max_num_seqs,
                                  prefill_budget=plan.prefill_budget,
                                  memory_cap_mib=memory_cap_mib)  # fmt: skip
        self.scheduler = self._new_scheduler()
        self._lock = threading.Lock()
        self._launched: Launched | None = None
        self._closed = False
        self._stepper = StepThread(self)  # the server's stepping thread, once started
        # engine/warmup.py: kernels compiled, graphs captured, each kind of prompt read once
        self.warm_up_report: WarmUpReport | None = None
        if warm_up:  # under the engine's tuning settings (its cache directory, engine/warmup.py)
            with tuning_settings(self.runner.tuning):
                self.warm_up_report = run_warm_up(self, options.compile_threads)
        if warm_up:  # a fresh scheduler: the warm-up's steps stay out of the engine's stats
            self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        plan = self.batching
        return Scheduler(self.pool.blocks, plan.max_num_seqs, plan.prefill_budget, self.max_context,
                         whole_prompts=self.runner.passes_captured,
                         landed=self.runner.landed if self.runner.prompts else None)  # fmt: skip

    def reset_stats(self) -> bool:
        """Start the scheduler's counters (steps, rows) from zero again, if idle (after a
        server's in-process first requests; the scheduler also holds the requests): whether
        it did."""
        with self._lock:
            if self.has_work:
                return False
            self.scheduler = self._new_scheduler()
            return True

    @property
    def max_num_seqs(self) -> int:
        return self.batching.max_num_seqs

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self, token_ids: list[int], params: SamplingParams, sink: Sink | None = None
    ) -> Sequence:
        """Check a request once and queue it; its output goes to `sink` (called on the thread
        that steps the engine). Bad arguments raise here, before anything runs."""
        seq = self._sequence(token_ids, params)
        seq.sink = sink
        self.scheduler.add(seq)
        return seq

    def _sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        if self._closed:
            raise EngineError("the engine is closed", "load it again")
        prompt = [int(t) for t in token_ids]
        vocab = self.config.vocab_size
        params.check(vocab)
        check_prompt(prompt, vocab, self.max_context)
        stops = frozenset(self.eos_ids if params.stop_ids is None else params.stop_ids)
        chunk = min(self.prefill_chunk, self.batching.prefill_budget)
        score_budget = None
        if params.max_tokens:  # refused now, not as an out-of-memory error halfway through
            memory = self.prompt_planner.plan(len(prompt), chunk)
            chunk, score_budget = memory.chunk, memory.score_budget
        return Sequence(prompt, params, stops, chunk, score_budget)

    def stream(self, token_ids: list[int], params: SamplingParams | None = None) -> Generation:
        """The new token ids as they are made: a `Generation` (engine/generation.py), which
        also carries finish_reason, the token counts, timings and log-probabilities."""
        seq = self._sequence(token_ids, params or SamplingParams())
        gen = Generation(self, seq)  # its sink, before any output can come
        self.scheduler.add(seq)
        return gen

    def generate(self, token_ids: list[int], params: SamplingParams | None = None) -> list[int]:
        """The new token ids (the ending stop id excluded). For the finish reason, counts and
        timings, iterate `stream` and read its `Generation`."""
        return list(self.stream(token_ids, params))

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._launched is not None

    def step(self) -> bool:
        """One step: the scheduler's plan run by the runner, then the previous step's tokens
        delivered (while this one runs on the device). True while work remains. A failing
        step ends every open request with its error (Ctrl-C and exit propagate)."""
        with self._lock:
            clock = self.runner.clock  # the host's phases, for steps launched late
            clock.note("stepping")
            try:
                plan = self.scheduler.schedule()
                clock.note("scheduled")
                launched = self.runner.execute(plan)
                if self._launched is not None:
                    delivered = self.runner.collect(self._launched)
                    clock.note("collected")
                    self.scheduler.deliver(delivered)
                    clock.note("delivered")
                self._launched = launched
            except BaseException as exc:
                self._launched = None
                self.runner.reset()
                self.scheduler.fail_all(exc)
                if not isinstance(exc, Exception):
                    raise
                log.exception("engine step failed")
            return self.has_work

    def note(self, mark: str) -> None:
        """A caller's own loop reached `mark` ("sent", "received": the engine process's, see
        engine/process/core.py) now: timed as host phases before late steps (step_clock)."""
        self.runner.clock.note(mark)

    # ---- served: engine/interface.py's ServedEngine (the OpenAI server's view) ---------------
    @property
    def ended(self) -> EngineError | None:
        """None: an engine in the server's process ends only with it."""
        return None

    async def add_request_async(
        self, token_ids: list[int], params: SamplingParams, sink: Sink | None = None
    ) -> Sequence:
        """`add_request` from the server's event loop: queued, and the stepping thread woken."""
        seq = self.add_request(token_ids, params, sink)
        self._stepper.wake()
        return seq

    def start(self) -> None:
        """Step this engine on a thread of its own while it has work (the server's)."""
        self._stepper.start()

    def wake(self) -> None:
        self._stepper.wake()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop that thread, then close: open requests end with the shutdown error."""
        self._stepper.stop(timeout)
        self.close()

    def stats(self) -> SchedulerStats:
        """The scheduler's counters with the decode stream's GPU time (engine/step_clock.py)."""
        t = self.runner.clock.times()
        return replace(self.scheduler.stats(), decode_busy_ms=t.busy_ms,
                       decode_idle_ms=t.idle_ms, starved_steps=t.starved_steps,
                       decode_plain_idle_ms=t.plain_idle_ms, late_host_ms=t.late_host_ms,
                       late_timed_steps=t.late_timed)  # fmt: skip

    def close(self) -> None:
        """End every open request with an error; the engine takes no more."""
        with self._lock:
            self._closed = True
            self._launched = None
            self.scheduler.fail_all(EngineError("the engine is shutting down", "retry later"))

    def memory_report(self) -> MemoryReport:
        return build_report(
            self.model.nbytes_by_part(),
            self.pool.nbytes(),
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


def load(path: str | Path, config: EngineConfig | None = None, **fields: object) -> Engine:
    """Load a Gemma 4 W4A16 checkpoint directory as `config` says (engine.options.EngineConfig;
    its fields may be given as keywords instead: `load(path, max_context=4096)`)."""
    if config is None:
        config = EngineConfig(**fields)  # type: ignore[arg-type]
    elif fields:
        config = replace(config, **fields)  # type: ignore[arg-type]
    options = config.options
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory", "pass a checkpoint directory")
    dev = _device(config.device)
    if options.fast == "force" and dev.type == "cpu" and not triton_interpreted():
        raise EngineError(
            "fast='force' (GPURIG_FAST=force) runs the Triton kernels on the CPU, which only "
            "Triton's interpreter can, and TRITON_INTERPRET=1 is not set",
            "set TRITON_INTERPRET=1 in the environment before starting (Triton reads it when "
            "the kernels are imported), or leave GPURIG_FAST at its default on the CPU",
        )
    compute_dtype = config.dtype or default_dtype(dev.type, _capability(dev))
    cfg = load_config(model_dir)
    limit = cfg.max_position_embeddings
    ctx = limit if config.max_context is None else int(config.max_context)
    if ctx > limit:
        raise EngineError(
            f"max_context {ctx} is outside [1, {limit}] (the model's max_position_embeddings)",
            f"pass a max_context between 1 and {limit}",
        )
    chunk = prefill_chunk_for(dev) if config.prefill_chunk is None else config.prefill_chunk
    tokenizer = load_tokenizer(model_dir)
    apply_memory_cap(dev, config.memory_cap_mib)
    reader = CheckpointReader(model_dir)
    try:
        model = Gemma4Model.load(reader, cfg, dev, compute_dtype, make_kernels(options, dev))
    finally:
        reader.close()
    budget = config.prefill_budget if config.prefill_budget is not None else min(chunk, 2048)
    plan = batching.plan(
        model, ctx, config.max_num_seqs, budget, config.memory_cap_mib, config.kv_cache_mib
    )
    return Engine(model_dir, cfg, model, tokenizer, read_template(model_dir), chunk,
                  config.memory_cap_mib, options, plan, warm_up=config.warm_up)  # fmt: skip


def _device(name: str | torch.device | None) -> torch.device:
    try:
        dev = torch.device(name) if name is not None else default_device()
    except (RuntimeError, TypeError) as exc:
        raise EngineError(
            f"device {name!r} is not a device name", "use cpu, cuda or cuda:N"
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
    return dev


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability (None on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def load_tokenizer(model_dir: Path) -> Tokenizer:
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
