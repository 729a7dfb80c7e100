"""What the correctness gate records: each probe's greedy answer (saved in its cell) and, at
report time, each cell's verdict against the reference target (which probe departed, where, and
both continuations). Kept apart from the gate's code so that the cell and result models can hold
these without importing a client.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Verdict = Literal["same", "departs", "not compared"]


class ProbeAnswer(BaseModel):
    """One probe's greedy continuation, as the server gave it: token ids where it returns them
    (vLLM's `return_token_ids`, the engine server, llama-server's native endpoint), its text
    where it returns that."""

    probe: int
    tokens: list[int] | None = None
    text: str | None = None
    error: str | None = None


class GateDeparture(BaseModel):
    """Where a target's answer to one probe first differs from the reference's."""

    probe: int
    unit: Literal["token", "character"] = Field(
        description="token ids where both sides returned them, else the text's characters"
    )
    position: int = Field(description="the first differing token (or character), from 0")
    reference: str = Field(description="the reference's continuation from that position")
    target: str = Field(description="the target's continuation from that position")


class CellGate(BaseModel):
    """One cell's verdict: every probe the same as the reference's, or the departures."""

    target: str
    input_len: int
    concurrency: int
    rate: float | None = None
    repeat: int
    verdict: Verdict
    compared: int = Field(0, description="probes compared with the reference's")
    departures: list[GateDeparture] = Field(default_factory=list)
    reason: str | None = Field(None, description="why probes were not compared")


class GateReport(BaseModel):
    reference: str = Field(description="the target whose answers are the reference")
    reference_cell: str | None = Field(
        None, description="the reference's first cell that answered every probe: its answers"
    )
    probes: list[str] = Field(default_factory=list, description="the probes, as sent")
    max_tokens: int = 0
    cells: list[CellGate] = Field(default_factory=list)
    departed: int = Field(0, description="cells whose target departed from the reference")
    reason: str | None = Field(None, description="why nothing could be compared")
