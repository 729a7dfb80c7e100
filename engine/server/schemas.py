"""The OpenAI wire shapes the server accepts and returns, as pydantic models.

Requests validate strictly on types (a wrong type is a 422 naming the field) but ignore OpenAI
fields this server has no use for (`user`, `logprobs: false`, ...), so stock clients work
unchanged. Responses follow OpenAI's shapes plus two fields of our own: `timings` (where the
time went) and, on chat messages, `reasoning_content` (the model's thinking, never in
`content`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt


class RequestModel(BaseModel):
    # Unknown OpenAI fields are accepted and ignored; NaN/inf are refused. Numbers and flags are
    # strict (as OpenAI's API is): `true` is not a token count, "0.5" not a temperature.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# OpenAI fields this server cannot honour, with the value that means "not used": a request that
# sets one to anything else is refused (400) rather than silently answered without it.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,),  # vLLM's: log-probabilities of the prompt's tokens
    "logprob_token_ids": (None, []),  # vLLM's: log-probabilities of chosen ids at every step
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "response_format": (None, {"type": "text"}),
}


# ---- errors ------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# ---- chat requests -----------------------------------------------------------------------------


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(RequestModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(RequestModel):
    include_usage: StrictBool = False


class ChatTemplateKwargs(RequestModel):
    enable_thinking: StrictBool | None = None


class _SamplingFields(RequestModel):
    model: str | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=1)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1, le=1, description="one choice per request")
    ignore_eos: StrictBool = False
    # vLLM's: the reply carries prompt_token_ids and token_ids (per stream chunk: the new ones)
    return_token_ids: StrictBool | None = None
    # vLLM's: logprobs name tokens "token_id:N" instead of their text
    return_tokens_as_token_ids: StrictBool | None = None
    # OpenAI's {"token id": bias in [-100, 100]}; the ids are checked against the vocabulary
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with int keys; ValueError naming a key that is no token id."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            token = int(key) if key.strip().lstrip("-").isdigit() else None
            if token is None or not 0 <= token < vocab_size:
                shown = repr(key) if len(key) <= 40 else repr(key[:40]) + "..."
                raise ValueError(f"logit_bias key {shown} is not a token id in [0, {vocab_size})")
            out[token] = bias
        return out

    def unsupported_field(self) -> str | None:
        """The first field set to a value this server cannot honour (see UNSUPPORTED_FIELDS)."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED_FIELDS.items():
            value = extra.get(name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                return name
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    enable_thinking: StrictBool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # OpenAI's: each content token's log-probability; top_logprobs: the most likely alternatives
    # (at most 20; checked in engine/server/logprobs.py for a 400 that names the limit)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def thinking(self) -> bool:
        if self.enable_thinking is not None:
            return self.enable_thinking
        if self.chat_template_kwargs and self.chat_template_kwargs.enable_thinking is not None:
            return self.chat_template_kwargs.enable_thinking
        return False


class CompletionRequest(_SamplingFields):
    # text, token ids, or a batch of exactly one of either
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    echo: StrictBool = False
    # OpenAI's legacy completions: the token's log-probability and the top `logprobs` (0-20)
    logprobs: StrictInt | None = None


# ---- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """Where a request's time went. prompt_ms: reading the prompt up to the first new token;
    decode_ms: from the first new token to the last; decode_tok_per_s: tokens made in decode_ms
    per second; queue_ms: waiting behind other requests."""

    prompt_ms: float
    decode_ms: float
    decode_tok_per_s: float
    queue_ms: float


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """OpenAI's `choices[i].logprobs` of a chat completion."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's `choices[i].logprobs` of a (legacy) completion."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    # vLLM's, with return_token_ids (null otherwise, as vLLM sends it); the prompt's ids are on
    # the response (ChatCompletion.prompt_token_ids), where vLLM puts them for chat
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's, with return_token_ids (null otherwise, as vLLM sends them)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gpurig"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
