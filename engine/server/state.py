"""What every handler shares: the engine's facts, the queue, the metrics, the limits; and the
small decisions every generation request makes (sampling values, how many tokens to make).

Work that grows with the request (parsing, rendering, tokenising) goes through `off_loop`, a
worker thread with a small limiter, so the event loop keeps answering /health and feeding
streams whatever a body holds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter

from engine.chat.render import ChatFormat
from engine.config import read_generation_config
from engine.errors import ContextLengthError, GpurigError
from engine.sampling import SamplingParams, bias_pairs
from engine.server.errors import ApiError, context_error, engine_error_to_api, excerpt
from engine.server.limits import Limits, ServerOptions, compute_limits
from engine.server.logprobs import TokenText
from engine.server.metrics import Metrics
from engine.server.queue import GenerationQueue, GenerationRequest, Job

if TYPE_CHECKING:
    from engine.interface import ServedEngine

T = TypeVar("T")

PREPARE_THREADS = 4  # requests parsed/rendered/tokenised at once
CAPPED_HEADER = "x-gpurig-max-tokens-capped"


class ServerState:
    """What every handler needs: the engine's facts, the queue, the metrics, the limits."""

    def __init__(
        self,
        engine: ServedEngine,
        model_name: str | None,
        aliases: tuple[str, ...],
        options: ServerOptions | None = None,
    ) -> None:
        facts = engine.facts
        self.engine = engine
        self.model_name = model_name or facts.model_name
        self.aliases = {self.model_name, *aliases}
        self.max_context = facts.max_context
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(self.tokenizer)  # token texts for logprobs, decoded once
        self.options = options or ServerOptions()
        self.limits: Limits = compute_limits(self.options, self.tokenizer, self.max_context)
        self.chat = ChatFormat.of(self.tokenizer, facts.chat_template, facts.bos_id, facts.eos_ids)
        self.vocab_size = facts.vocab_size
        self.created = int(time.time())
        self.metrics = Metrics(self.model_name)
        self.metrics.scheduler_stats = engine.stats
        self.queue = GenerationQueue(engine, self.metrics)
        self.eos_ids = list(facts.eos_ids)
        self.defaults = sampling_defaults(facts.model_dir)
        self._limiter: CapacityLimiter | None = None

    def check_model(self, requested: str | None) -> None:
        if requested and requested not in self.aliases:
            raise ApiError(
                404,
                f"The model '{excerpt(requested)}' does not exist. This server serves '{self.model_name}' "
                "(see GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread (at most PREPARE_THREADS at once)."""
        if self._limiter is None:  # made on the loop that uses it
            self._limiter = CapacityLimiter(PREPARE_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids for `text`, refusing text too long for the context without tokenising it
        (see engine/server/limits.py). Blocking."""
        size = len(text.encode("utf-8"))
        bound = self.limits.text_bytes
        if bound is not None and size > bound:
            at_least = -(-size // (self.limits.bytes_per_token or 1))
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, "
                f"your prompt is {size} bytes, which makes at least {at_least} tokens. Please "
                "reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        # the batch call lets go of the GIL while it works
        encoded = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoded[0].ids)


def sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's sampling defaults (engine/config.py's generation_config.json reader;
    greedy where it has none)."""
    return read_generation_config(model_dir).sampling_defaults()


def generation_request(
    state: ServerState,
    req: Any,
    prompt_ids: list[int],
    max_tokens: int,
    stop_ids: list[int],
    logprobs: int | None,
    skip_special_tokens: bool,
) -> GenerationRequest:
    """The engine's request for an HTTP request: its SamplingParams from the request's fields
    of the same names (temperature, top_p, top_k, seed, ...), else the checkpoint's defaults,
    so a new sampling option needs only SamplingParams and the two request schemas; then the
    endpoint's own decisions (the token budget, stop ids, logprobs k) and the text side."""
    try:
        logit_bias = req.logit_bias_ids(state.vocab_size)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="logit_bias") from None
    values: dict[str, Any] = {
        name: state.defaults[name] for name in SAMPLING_FIELDS if name in state.defaults
    }
    for name in SAMPLING_FIELDS:
        if getattr(req, name, None) is not None:
            values[name] = getattr(req, name)
    params = SamplingParams(
        **values,
        max_tokens=max_tokens,
        stop_ids=() if getattr(req, "ignore_eos", False) else tuple(stop_ids),
        logit_bias=bias_pairs(logit_bias),
        logprobs=logprobs,
    )
    return GenerationRequest(
        prompt_ids=prompt_ids,
        params=params,
        stop_strings=req.stop_strings(),
        skip_special_tokens=skip_special_tokens,
        token_ids=bool(getattr(req, "return_token_ids", False)),
    )


# SamplingParams' fields a request carries under the same name (the others are decided above)
SAMPLING_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name not in ("max_tokens", "stop_ids", "logit_bias", "logprobs")
)


async def submit(state: ServerState, request: GenerationRequest, param: str) -> Job:
    """Queue a request in the engine, which checks it once; what it refuses is the client's
    400 (naming `param`), anything else a 500."""
    try:
        return await state.queue.submit(request)
    except ContextLengthError as exc:
        raise context_error(exc.limit, exc.requested, None, param) from None
    except GpurigError as exc:
        raise engine_error_to_api(exc, param) from None


class Budget(NamedTuple):
    """How many tokens to make; `capped` is the server's limit when it cut the request down."""

    max_new: int
    capped: int | None

    def headers(self) -> dict[str, str]:
        return {CAPPED_HEADER: str(self.capped)} if self.capped is not None else {}


def token_budget(state: ServerState, prompt_len: int, asked: int | None, param: str) -> Budget:
    """A prompt (+ the asked completion) over the context is refused, as OpenAI does; then
    the server's cap applies to a request that asked for more than it, or for nothing."""
    limit = state.max_context
    if prompt_len >= limit or (asked is not None and prompt_len + asked > limit):
        raise context_error(limit, prompt_len, asked, param)
    wanted = asked if asked is not None else limit - prompt_len
    cap = state.limits.max_tokens
    if cap is not None and wanted > cap:
        return Budget(cap, cap)
    return Budget(wanted, None)
