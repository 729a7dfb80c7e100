"""The options of the engine server (`python -m engine.server`, `gpurig engine serve`), defined
once: names, flags, types, defaults, help, checks.

The server builds its argparse flags from `OPTIONS` (engine/server/main.py: for both commands),
and the serving tools read the accepted flags from `flags()` (tools/serving refuses an unknown
one in extra_args before starting a server), so neither walks the other's parser. The module imports no web
framework and no torch (the standard library and engine.errors only): `gpurig --help` and the
serving tools import it.

Each option's value is parsed by its `type` (a ValueError says why a text is not a value: the CLI
shows it as a usage error), and `check(values)` refuses the values that parse but cannot be
served, with a message naming the argument through `arg()` (the front door renders the flag).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidInputError, arg

DEFAULT_PORT = 8100
DEFAULT_MAX_CTX = 131072
DEFAULT_MAX_TOKENS_LIMIT = 4096  # engine/server/limits.py reads these two
DEFAULT_MAX_BODY_MIB = 8
MOST_NUM_SEQS = 64  # the KV pool's limit (engine/batching.py)
API_KEY_ENV = "GPURIG_ENGINE_API_KEY"
ENGINE_PROCESS_ENV = "GPURIG_ENGINE_PROCESS"
ENGINE_PROCESS_MODES = ("auto", "on", "off")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def positive_int(text: str) -> int:
    """A whole number of at least 1; ValueError says why `text` is not one."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def num_seqs(text: str) -> int | str:
    """'auto', or a whole number from 1 to MOST_NUM_SEQS."""
    if text == "auto":
        return text
    value = positive_int(text)
    if value > MOST_NUM_SEQS:
        raise ValueError(f"{value} is more than {MOST_NUM_SEQS}; use 1-{MOST_NUM_SEQS} or auto")
    return value


@dataclass(frozen=True)
class ServeOption:
    """One option: `name` is the argument's name (the flag is it with dashes, then `aliases`);
    `type` parses its text (None: kept as text); `switch` is a flag that takes no value."""

    name: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    aliases: tuple[str, ...] = ()
    required: bool = False
    choices: tuple[str, ...] | None = None
    switch: bool = False

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--" + self.name.replace("_", "-"), *self.aliases)


# `{here}` and `{max_threads}` in a help text are filled in by the CLI when the help is shown
OPTIONS: tuple[ServeOption, ...] = (
    ServeOption("model", "checkpoint directory", required=True),
    ServeOption(
        "host",
        "bind address (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network, "
        "use --api-key then)",
        default="127.0.0.1",
    ),
    ServeOption("port", f"port (default {DEFAULT_PORT})", int, DEFAULT_PORT),
    ServeOption(
        "max_context",
        f"context length in tokens (default {DEFAULT_MAX_CTX}, capped at the model's "
        "max_position_embeddings; --max-ctx is an alias)",
        int,
        DEFAULT_MAX_CTX,
        aliases=("--max-ctx",),
    ),
    ServeOption("device", "cuda, cuda:1 or cpu (default: cuda if present)"),
    ServeOption(
        "threads",
        "CPU threads for torch (default: OMP_NUM_THREADS if set, else the idle cores less one, "
        "1..{max_threads}: {here} here)",
        int,
    ),
    ServeOption(
        "api_key",
        f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; /health and "
        "/metrics stay open)",
    ),
    ServeOption(
        "max_tokens_limit",
        f"most tokens one request may generate (default {DEFAULT_MAX_TOKENS_LIMIT}; 0: up to the "
        "context); a request asking more, or nothing, is cut to it and its reply says so "
        "(header X-Gpurig-Max-Tokens-Capped, field max_tokens_capped)",
        int,
        DEFAULT_MAX_TOKENS_LIMIT,
    ),
    ServeOption(
        "max_body_mib",
        f"largest request body in MiB (default {DEFAULT_MAX_BODY_MIB}; bodies that cannot fit "
        "the context are refused below it)",
        float,
        DEFAULT_MAX_BODY_MIB,
    ),
    ServeOption(
        "max_num_seqs",
        f"most requests decoded together (1-{MOST_NUM_SEQS}; default auto: 16, or fewer when the "
        "memory left after the weights cannot give each 4,096 tokens of KV cache)",
        num_seqs,
        "auto",
    ),
    ServeOption(
        "memory_cap_mib",
        "cap this process's CUDA memory (MiB), e.g. 3732 to act as a 4 GB card; the KV pool is "
        "sized within it",
        positive_int,
    ),
    ServeOption(
        "kv_cache_mib",
        "KV block pool size in MiB (default: what is left after the weights, less room for "
        "reading prompts)",
        positive_int,
    ),
    ServeOption(
        "prefill_budget",
        "most prompt tokens read between two decode steps (default 2048 on CUDA): lower keeps "
        "streams smoother while long prompts arrive, higher reads them faster",
        positive_int,
    ),
    ServeOption("model_name", "name clients use in 'model' (default: directory name)"),
    ServeOption(
        "no_warmup",
        "skip the warm-up (kernel compiles, graph capture, a prompt of each kind) before serving",
        switch=True,
    ),
    ServeOption(
        "engine_process",
        "on: the engine runs in a process of its own, so the server's threads never hold up its "
        "launches (vLLM's engine-core split); off: in the server's process; auto: on for a "
        f"CUDA device (default: ${ENGINE_PROCESS_ENV}, else auto)",
        choices=ENGINE_PROCESS_MODES,
    ),
    ServeOption(
        "log_level",
        "uvicorn log level (info shows one line per request)",
        default="info",
        choices=LOG_LEVELS,
    ),
)


_BY_NAME = {option.name: option for option in OPTIONS}


def flag(name: str) -> str:
    """The flag of option `name`: max_context -> --max-context (KeyError for no such option)."""
    return _BY_NAME[name].flags[0]


def flags() -> frozenset[str]:
    """Every flag `gpurig engine serve` accepts (aliases included)."""
    return frozenset(f for option in OPTIONS for f in option.flags)


def check(values: Mapping[str, Any], threads_hint: int) -> None:
    """Refuse the parsed values that cannot be served (InvalidInputError); `threads_hint` is
    the thread count a remedy suggests (the default here)."""
    if values["max_context"] < 1:
        raise InvalidInputError(
            f"{arg('max_context')} {values['max_context']} must be at least 1", "use e.g. 8192"
        )
    if values["threads"] is not None and values["threads"] < 1:
        raise InvalidInputError(
            f"{arg('threads')} {values['threads']} must be at least 1", f"use e.g. {threads_hint}"
        )
    process = values.get("engine_process")
    if process is not None and process not in ENGINE_PROCESS_MODES:
        raise InvalidInputError(
            f"{arg('engine_process')} (or ${ENGINE_PROCESS_ENV}) is {process!r}",
            "use auto, on or off",
        )
    if values["max_tokens_limit"] < 0:
        raise InvalidInputError(
            f"{arg('max_tokens_limit')} {values['max_tokens_limit']} is negative",
            f"use e.g. {DEFAULT_MAX_TOKENS_LIMIT}, or 0 for no limit",
        )
    if not 0 < values["max_body_mib"] <= 1024:
        raise InvalidInputError(
            f"{arg('max_body_mib')} {values['max_body_mib']} is out of range",
            f"use 1 to 1024 (default {DEFAULT_MAX_BODY_MIB})",
        )
