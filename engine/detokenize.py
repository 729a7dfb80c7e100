"""From a stream of token ids to a stream of text that is safe to show or send.

The one incremental detokeniser, used by engine/textgen.py (the CLI) and the OpenAI server
alike. Two things make this harder than `decode(id)`:

- a byte-level tokenizer can split one UTF-8 character over several tokens, so a token alone
  may decode to U+FFFD: text is released only once it cannot change;
- a stop string may arrive split over several tokens, so text that could be the start of one is
  held back until it is known not to be one (`StopMatcher`).

Cost: each token decodes a short window of recent ids (the prefix/read offsets of
transformers' and vLLM's incremental detokenisers), never the whole output. Their version lets
the window grow while the text keeps ending in U+FFFD, which a run of invalid bytes (a random or
confused model) makes quadratic; here a window holding more than `MAX_HELD` undecided ids
releases what can no longer change (an incomplete character is at most 3 bytes, so it lies in
the last 3 ids), which keeps the work per token bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

REPLACEMENT = "\ufffd"
TAIL_IDS = 3  # an incomplete UTF-8 character is at most 3 bytes: it lies in the last 3 ids
MAX_HELD = 6  # undecided ids held before releasing what is settled


class Detokenizer:
    """Decode ids one at a time; `push` returns the text that is settled, `flush` the rest.

    The pieces joined equal `tokenizer.decode(all ids)` for decoders that read bytes left to
    right (byte-level BPE; byte fallback with valid UTF-8)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self._ids: list[int] = []  # the window: ids[prefix:] of the whole output
        self._read = 0  # ids of the window whose text was released
        self._base = ""  # decode(window[:read]): the context new text is measured against

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _release(self, cut: int, text: str) -> str:
        """Release decode(window[:cut]) = `text` beyond the base; the window then starts at
        the old read offset (one piece of context, as decoders treat a first token apart)."""
        out = text[len(self._base) :]
        self._ids = self._ids[self._read :]
        self._read = cut - self._read
        self._base = self._decode(self._ids[: self._read])
        return out

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        full = self._decode(self._ids)
        if len(full) > len(self._base) and not full.endswith(REPLACEMENT):
            return self._release(len(self._ids), full)
        if len(self._ids) - self._read <= MAX_HELD:
            return ""
        # Many ids undecided: release up to a cut before the last TAIL_IDS ids whose text is
        # already part of the full text (a cut inside a character would decode differently)
        for cut in range(len(self._ids) - TAIL_IDS, self._read, -1):
            text = self._decode(self._ids[:cut])
            if len(text) > len(self._base) and full.startswith(text):
                return self._release(cut, text)
        return ""

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete character decodes as U+FFFD)."""
        full = self._decode(self._ids)
        out = full[len(self._base) :] if len(full) > len(self._base) else ""
        self._ids, self._read, self._base = [], 0, ""
        return out


class StopMatcher:
    """Find the first stop string in a growing text; release only text that cannot be the
    start of one."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        """Add text; return what may be sent now. After a hit, everything from the stop string
        on is dropped and `hit` is set."""
        if self.hit is not None:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            i, stop = min(found)
            self.hit = stop
            out, self.pending = self.pending[:i], ""
            return out
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit is not None else self.pending), ""
        return out


class TextAssembler:
    """Token ids in, text out: the detokeniser and the stop strings together, pushed one
    token at a time (the OpenAI server feeds it as tokens arrive; TextStream pulls through it).
    Once a stop string is found, `stopped` is True and nothing more is released."""

    def __init__(self, tokenizer: Any, stop_strings: list[str] | tuple[str, ...] = (),
                 skip_special_tokens: bool = False) -> None:  # fmt: skip
        self._detok = Detokenizer(tokenizer, skip_special_tokens)
        self._stops = StopMatcher(stop_strings)
        self._pieces: list[str] = []

    @property
    def stop_hit(self) -> str | None:
        return self._stops.hit

    @property
    def stopped(self) -> bool:
        return self._stops.hit is not None

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._pieces)

    def _keep(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def push(self, token: int) -> str:
        """The text this token settles ("" while a character or a possible stop string is
        incomplete, and after a stop string)."""
        if self.stopped:
            return ""
        return self._keep(self._stops.push(self._detok.push(token)))

    def push_all(self, tokens: list[int]) -> str:
        return "".join(self.push(t) for t in tokens)

    def flush(self) -> str:
        """The held tail, at the end."""
        if self.stopped:
            return ""
        tail = self._stops.push(self._detok.flush())
        if not self.stopped:
            tail += self._stops.flush()
        return self._keep(tail)


class TextStream:
    """A `Generation` (or any iterator of ids) as text: one piece per token (often "", while a
    character or a possible stop string is incomplete), then the held tail at the end.

    A stop string ends it: the text stops before the stop string, the generation is closed and
    `stop_hit` names it. `text` is everything released so far."""

    def __init__(
        self,
        generation: Any,
        tokenizer: Any,
        stop_strings: list[str] | tuple[str, ...] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self.generation = generation
        self._text = TextAssembler(tokenizer, stop_strings, skip_special_tokens)

    @property
    def stop_hit(self) -> str | None:
        return self._text.stop_hit

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def finish_reason(self) -> str | None:
        """A stop string makes it "stop"; else the generation's own (None when closed early)."""
        if self._text.stopped:
            return "stop"
        return self.generation.finish_reason

    def __iter__(self) -> Iterator[str]:
        try:
            for token in self.generation:
                yield self._text.push(token)
                if self._text.stopped:
                    return
            tail = self._text.flush()
            if tail:
                yield tail
        finally:
            self.close()

    def close(self) -> None:
        """Stop the generation now (whether it finished, broke off or failed)."""
        self.generation.close()
