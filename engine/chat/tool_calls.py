"""Turn a Gemma 4 reply into OpenAI fields: content, reasoning_content and tool_calls.

Gemma 4 writes tool calls in its own notation, not JSON:
`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flags:[true,null],obj:{a:1}}<tool_call|>`.
Strings sit between `<|"|>` delimiters so they may hold quotes, braces and newlines unescaped;
keys are bare. Thinking goes in a channel, `<|channel>thought\\n...<channel|>`, which must never
leak into `content`.

A call that does not parse is left in `content` as the model wrote it: the client sees what
the model said and nothing crashes. `parse_reply` handles a finished reply;
`StreamingReplyParser` does the same incrementally for server-sent events, holding back only
the few characters that could be the start of a marker.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

STRING_DELIM = '<|"|>'
CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
# Characters that end a bare (unquoted) value.
_BARE_END = ",}]"


class ToolCallSyntaxError(ValueError):
    """The text between the call markers is not a well-formed Gemma 4 call."""


@dataclass
class ToolCall:
    """One call in OpenAI's shape: `arguments` is a JSON string, as the API defines it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedReply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]


class _ValueParser:
    """Recursive-descent parser for Gemma 4's value notation (a small superset of JSON's data
    model: bare keys, `<|"|>` strings, and bare words read as strings when they are not a
    number, true, false or null)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, what: str) -> ToolCallSyntaxError:
        return ToolCallSyntaxError(f"{what} at offset {self.pos}")

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def expect(self, token: str) -> None:
        self.skip_ws()
        if not self.text.startswith(token, self.pos):
            raise self.error(f"expected {token!r}")
        self.pos += len(token)

    def value(self) -> Any:
        self.skip_ws()
        if self.pos >= len(self.text):
            raise self.error("unexpected end")
        if self.text.startswith(STRING_DELIM, self.pos):
            return self.string()
        ch = self.text[self.pos]
        if ch == "{":
            return self.obj()
        if ch == "[":
            return self.array()
        if ch == '"':  # tolerate a JSON string
            return self.json_string()
        return self.bare()

    def string(self) -> str:
        self.pos += len(STRING_DELIM)
        end = self.text.find(STRING_DELIM, self.pos)
        if end < 0:
            raise self.error("unterminated string")
        out = self.text[self.pos : end]
        self.pos = end + len(STRING_DELIM)
        return out

    def json_string(self) -> str:
        try:
            out, end = json.JSONDecoder().raw_decode(self.text, self.pos)
        except json.JSONDecodeError as exc:
            raise self.error("bad quoted string") from exc
        self.pos = end
        return out

    def bare(self) -> Any:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _BARE_END:
            if self.text.startswith(STRING_DELIM, self.pos) or self.text[self.pos] in "{[":
                raise self.error("unexpected delimiter inside a bare value")
            self.pos += 1
        word = self.text[start : self.pos].strip()
        if not word:
            raise self.error("missing value")
        if word == "true":
            return True
        if word == "false":
            return False
        if word == "null":
            return None
        if _NUMBER.fullmatch(word):
            number = float(word)
            return int(word) if number.is_integer() and re.fullmatch(r"-?\d+", word) else number
        return word

    def key(self) -> str:
        self.skip_ws()
        if self.text.startswith(STRING_DELIM, self.pos):
            return self.string()
        if self.pos < len(self.text) and self.text[self.pos] == '"':
            return self.json_string()
        end = self.text.find(":", self.pos)
        if end < 0:
            raise self.error("expected ':' after a key")
        key = self.text[self.pos : end].strip()
        if not key or any(c in key for c in "{}[],\n") or STRING_DELIM in key:
            raise self.error("bad key")
        self.pos = end
        return key

    def obj(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.skip_ws()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            k = self.key()
            self.expect(":")
            out[k] = self.value()
            self.skip_ws()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                continue
            self.expect("}")
            return out

    def array(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        self.skip_ws()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            self.skip_ws()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                continue
            self.expect("]")
            return out


def parse_value(text: str) -> Any:
    """Parse one complete Gemma 4 value (the whole text must be consumed)."""
    p = _ValueParser(text)
    out = p.value()
    p.skip_ws()
    if p.pos != len(text):
        raise p.error("trailing text")
    return out


def parse_call(body: str) -> ToolCall:
    """Parse the text between `<|tool_call>` and `<tool_call|>`: `call:NAME{...}`."""
    text = body.strip()
    if not text.startswith("call:"):
        raise ToolCallSyntaxError("a call starts with 'call:'")
    m = _NAME.match(text, len("call:"))
    if not m:
        raise ToolCallSyntaxError("missing function name")
    rest = text[m.end() :]
    if not rest.lstrip().startswith("{"):
        raise ToolCallSyntaxError("arguments must be an object {...}")
    try:
        args = parse_value(rest)
    except RecursionError:
        raise ToolCallSyntaxError("arguments nested too deeply") from None
    return ToolCall(name=m.group(0), arguments=json.dumps(args, ensure_ascii=False))


def _split_thinking(text: str) -> tuple[str, str | None]:
    """Remove every channel block; return (visible text, reasoning or None). An unterminated
    block (generation cut off while thinking) is all reasoning."""
    visible: list[str] = []
    reasoning: list[str] = []
    pos = 0
    while True:
        start = text.find(CHANNEL_OPEN, pos)
        if start < 0:
            visible.append(text[pos:])
            break
        visible.append(text[pos:start])
        body_start = start + len(CHANNEL_OPEN)
        end = text.find(CHANNEL_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        reasoning.append(_strip_channel_name(body))
        if end < 0:
            break
        pos = end + len(CHANNEL_CLOSE)
    thought = "".join(reasoning)
    return "".join(visible), (thought if thought else None)


def _strip_channel_name(body: str) -> str:
    """`thought\\n...`: drop the channel's name line."""
    nl = body.find("\n")
    if nl >= 0 and _NAME.fullmatch(body[:nl] or "_"):
        return body[nl + 1 :]
    if _NAME.fullmatch(body):  # just the name, nothing thought yet
        return ""
    return body


def parse_reply(text: str, parse_calls: bool = True) -> ParsedReply:
    """Split a finished reply into content, reasoning and tool calls. With `parse_calls`
    False (no tools were offered), call markers stay in the content as written."""
    visible, reasoning = _split_thinking(text)
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    while True:
        start = visible.find(CALL_OPEN, pos) if parse_calls else -1
        if start < 0:
            kept.append(visible[pos:])
            break
        kept.append(visible[pos:start])
        body_start = start + len(CALL_OPEN)
        end = visible.find(CALL_CLOSE, body_start)
        body = visible[body_start:] if end < 0 else visible[body_start:end]
        stop = len(visible) if end < 0 else end + len(CALL_CLOSE)
        try:
            calls.append(parse_call(body))
        except ToolCallSyntaxError:
            kept.append(visible[start:stop])  # malformed: the client gets the raw text
        pos = stop
    content = "".join(kept)
    if calls:
        content = content.strip()
    elif reasoning is not None:
        content = content.lstrip()
    return ParsedReply(content=content or None, reasoning_content=reasoning, tool_calls=calls)


@dataclass
class StreamEvent:
    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


class StreamingReplyParser:
    """Incremental `parse_reply`: feed text deltas, get content/reasoning deltas and whole tool
    calls. A call is emitted once its closing marker arrives (OpenAI allows a call's fields in
    one delta); a malformed one is emitted as content."""

    def __init__(self, parse_calls: bool = True) -> None:
        self.markers = (CHANNEL_OPEN, CALL_OPEN) if parse_calls else (CHANNEL_OPEN,)
        self.buf = ""
        self.state = "text"  # "text" | "channel_name" | "thinking" | "call"
        self.saw_call = False
        self.saw_thinking = False
        self.emitted_content = False

    def feed(self, delta: str) -> list[StreamEvent]:
        self.buf += delta
        out: list[StreamEvent] = []
        while True:
            progressed = self._step(out, final=False)
            if not progressed:
                return out

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        while self._step(out, final=True):
            pass
        return out

    def _emit_content(self, out: list[StreamEvent], text: str) -> None:
        if not self.emitted_content and self.saw_thinking:
            text = text.lstrip()
        if text:
            self.emitted_content = True
            out.append(StreamEvent("content", text))

    def _step(self, out: list[StreamEvent], final: bool) -> bool:
        if not self.buf and not (final and self.state == "call"):
            return False
        if self.state == "text":
            hits = [(i, m) for m in self.markers if (i := self.buf.find(m)) >= 0]
            if hits:
                i, marker = min(hits)
                self._emit_content(out, self.buf[:i])
                self.buf = self.buf[i + len(marker) :]
                self.state = "channel_name" if marker == CHANNEL_OPEN else "call"
                if marker == CHANNEL_OPEN:
                    self.saw_thinking = True
                return True
            hold = 0 if final else _partial_suffix(self.buf, self.markers)
            self._emit_content(out, self.buf[: len(self.buf) - hold])
            self.buf = self.buf[len(self.buf) - hold :]
            return False
        if self.state == "channel_name":
            nl = self.buf.find("\n")
            close = self.buf.find(CHANNEL_CLOSE)
            if nl < 0 and close < 0 and not final and len(self.buf) <= 64:
                return False  # the channel's name line is not complete yet
            if nl >= 0 and (close < 0 or nl < close) and _NAME.fullmatch(self.buf[:nl] or "_"):
                self.buf = self.buf[nl + 1 :]
            elif close >= 0 and (nl < 0 or close < nl) and _NAME.fullmatch(self.buf[:close]):
                self.buf = self.buf[close:]
            elif final and _NAME.fullmatch(self.buf):
                self.buf = ""
            self.state = "thinking"
            return True
        if self.state == "thinking":
            i = self.buf.find(CHANNEL_CLOSE)
            if i >= 0:
                if i:
                    out.append(StreamEvent("reasoning", self.buf[:i]))
                self.buf = self.buf[i + len(CHANNEL_CLOSE) :]
                self.state = "text"
                return True
            hold = 0 if final else _partial_suffix(self.buf, (CHANNEL_CLOSE,))
            if len(self.buf) > hold:
                out.append(StreamEvent("reasoning", self.buf[: len(self.buf) - hold]))
            self.buf = self.buf[len(self.buf) - hold :]
            return False
        # state == "call": wait for the whole call
        i = self.buf.find(CALL_CLOSE)
        if i < 0 and not final:
            return False
        body = self.buf if i < 0 else self.buf[:i]
        raw = CALL_OPEN + body + ("" if i < 0 else CALL_CLOSE)
        self.buf = "" if i < 0 else self.buf[i + len(CALL_CLOSE) :]
        self.state = "text"
        try:
            call = parse_call(body)
        except ToolCallSyntaxError:
            self._emit_content(out, raw)
            return True
        self.saw_call = True
        out.append(StreamEvent("tool_call", call=call))
        return True
