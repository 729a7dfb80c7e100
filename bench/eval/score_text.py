"""Scoring a text reply: exact match, or the last number (GSM8K's `#### N` answers).

The last number rather than the first: a model that reasons out loud writes intermediate numbers
before its result, and GSM8K's own answers end with `#### N`. Numbers compare as decimals after
dropping thousands separators, a trailing period and a leading `$`, so `1,186.` equals `1186`
and `72.0` equals `72`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
GSM8K_MARK = "####"


def last_number(text: str | None) -> Decimal | None:
    """The last number written in `text`, or None where there is none."""
    if not text:
        return None
    for raw in reversed(NUMBER.findall(text)):
        try:
            return Decimal(raw.replace(",", ""))
        except InvalidOperation:
            continue
    return None


def expected_number(answer: object) -> Decimal | None:
    """The number an answer stands for: the part after `####` (GSM8K), else its last number."""
    text = str(answer)
    if GSM8K_MARK in text:
        text = text.rsplit(GSM8K_MARK, 1)[1]
    return last_number(text)


def looks_numeric(answer: object) -> bool:
    """Whether `auto` scoring should compare numbers: a GSM8K answer, or a bare number."""
    if isinstance(answer, bool):
        return False
    if isinstance(answer, int | float):
        return True
    text = str(answer).strip()
    return GSM8K_MARK in text or bool(NUMBER.fullmatch(text))


def score_last_number(reply: str | None, answer: object) -> tuple[bool, str]:
    """(right, why): the reply's last number against the answer's number."""
    want = expected_number(answer)
    if want is None:
        return False, f"the expected answer {str(answer)[-40:]!r} holds no number"
    got = last_number(reply)
    if got is None:
        return False, "no number in the reply"
    if got == want:
        return True, f"last number {got}"
    return False, f"last number {got}, expected {want}"


def normalise(text: str) -> str:
    """Whitespace runs to one space, ends stripped: the only slack exact match allows."""
    return " ".join(text.split())


def score_exact(reply: str | None, answer: object) -> tuple[bool, str]:
    """(right, why): the whole reply equals the answer (whitespace normalised)."""
    if reply is None:
        return False, "no text in the reply"
    if normalise(reply) == normalise(str(answer)):
        return True, "exact match"
    return False, f"expected {normalise(str(answer))[:40]!r}"
