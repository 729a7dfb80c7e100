"""From a stream of token ids to a stream of text that is safe to send.

Two things make that harder than `decode(id)`: a byte-level tokenizer can split one UTF-8
character over several tokens (so a token alone may decode to U+FFFD), and a stop string may
arrive split over several tokens (so text that could be the start of a stop string must be held
back until it is known not to be one).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decode ids one at a time, emitting text only once it is complete. Only a short window of
    recent ids is re-decoded per step (the prefix/read offsets idea), so the cost stays flat."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopMatcher:
    """Find the first stop string in a growing text; release only text that cannot be the
    start of one."""

    def __init__(self, stops: list[str]) -> None:
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
