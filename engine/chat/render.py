"""Render OpenAI-style messages and tools into a prompt with the checkpoint's own template.

The template is the checkpoint's (chat_template.jinja, else tokenizer_config.json's
"chat_template"), rendered the way transformers renders it (sandboxed jinja2, trim_blocks,
lstrip_blocks, a `tojson` filter and `raise_exception`), so a real checkpoint's template gives the
same prompt here as under transformers. Before rendering, OpenAI wire quirks are smoothed out the
way chat templates expect them (as vLLM does): tool-call arguments arrive as JSON strings but
templates want mappings; a tool message names its call only by id, so the function name is
looked up. A tool message's content stays as the client sent it (Google's Gemma 4 template
tests `content is string` and fails on a mapping); when it is a JSON object, the parsed object
rides along under `content_object`, which gpurig's own template renders in Gemma 4 notation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
CONTENT_OBJECT = "content_object"  # a tool result's JSON object, parsed (see the docstring)
BUNDLED_TEMPLATE = Path(__file__).with_name("gemma4_chat_template.jinja")
# A chat turn ends on these even if generation_config.json forgot them.
CHAT_STOP_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or it is broken)."""


def read_template(model_dir: str | Path) -> str | None:
    """The checkpoint's chat template, where transformers looks: chat_template.jinja, else
    chat_template.json (a processor's save: {"chat_template": ...}), else tokenizer_config.json's
    "chat_template" (a string, or a list of named templates: "default" wins). An unreadable
    JSON file counts as naming none."""
    model_dir = Path(model_dir)
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
            if template:
                return template
    return None


def bundled_template() -> str:
    """gpurig's own Gemma 4 template (what make_checkpoint writes into test checkpoints)."""
    return BUNDLED_TEMPLATE.read_text(encoding="utf-8")


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def _text(content: Any) -> Any:
    """OpenAI content parts -> plain text (templates for text models expect a string)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def _json_object_or(value: Any) -> Any:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, dict):
            return parsed
    return value


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages into the shape chat templates expect (see the module docstring)."""
    names_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        m["content"] = _text(message.get("content"))
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                fn["arguments"] = _json_object_or(fn.get("arguments"))
                if tc.get("id") and fn.get("name"):
                    names_by_id[tc["id"]] = fn["name"]
                calls.append({**tc, "function": fn})
            m["tool_calls"] = calls
        if m.get("role") == "tool":
            if not m.get("name"):
                m["name"] = names_by_id.get(m.get("tool_call_id") or "", "unknown")
            parsed = _json_object_or(m["content"])
            if isinstance(parsed, dict):
                m[CONTENT_OBJECT] = parsed
        out.append(m)
    return out


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    bos_token: str = "<bos>",
    eos_token: str = "<eos>",
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` (+ `tools`, OpenAI shape) under `template`."""
    context = {
        **(extra or {}),
        "messages": normalize_messages(messages),
        "tools": tools or None,
        "add_generation_prompt": add_generation_prompt,
        "enable_thinking": enable_thinking,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    try:
        return _compile(template).render(**context)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateError("the messages or tools are nested too deeply to render") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids for rendered prompt text. The template already wrote `<bos>`, so the
    tokenizer must not add special tokens of its own."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True)
class ChatFormat:
    """How one served model turns a chat into prompt text: its template (the checkpoint's,
    else gpurig's bundled Gemma 4 one) and the text of its BOS token (the tokenizer's, else
    "<bos>"); and the ids a reply ends on (the eos ids and the end-of-turn markers). The CLI's
    `--chat` and the server's /v1/chat/completions both render with it."""

    template: str
    bos_token: str = "<bos>"
    stop_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer,
        template: str | None = None,
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
    ) -> ChatFormat:
        """The format of a served model: its tokenizer, the checkpoint's template (None: it has
        none, gpurig's Gemma 4 one is used), its BOS id and eos ids (engine/interface.py's
        EngineFacts carries all three)."""
        bos = tokenizer.id_to_token(int(bos_id)) if bos_id is not None else None
        markers = (tokenizer.token_to_id(t) for t in CHAT_STOP_TOKENS)
        stops = tuple(sorted({*(int(i) for i in eos_ids), *(i for i in markers if i is not None)}))
        return cls(template or bundled_template(), bos or "<bos>", stops)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> str:
        """The prompt text (see `render_chat`); raises ChatTemplateError."""
        return render_chat(
            self.template,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self.bos_token,
        )
