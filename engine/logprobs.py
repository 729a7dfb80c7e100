"""Log-probabilities of the tokens a generation makes, for the requests that ask for them.

What they are: `log_softmax` in float32 of the logits the model produced for that step, before
anything the request does to them (logit_bias, temperature, top-k, top-p): the "raw_logprobs" of
vLLM's default `logprobs_mode`, so the two servers report the same numbers for the same model.
They are computed from the very logits the token was sampled from (the same step, no second
forward pass). For a greedy request without logit_bias the sampled token is therefore the top-1
and its log-probability the top-1's.

`top` lists the sampled token first, then the `k` most likely tokens in rank order, the sampled
one not repeated, as vLLM's per-step dictionary does (so the OpenAI server can shape completions
(k + 1 entries at most) and chat (the first k) exactly as vLLM does).

Cost: nothing for a step in which no request asks (the scheduler computes only the rows that
do); a step with askers adds one log_softmax, gather and top-k over the vocabulary and one copy
(measured in lab/journal.md: +0.14 ms of host time per step on the H200, tiny preset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit and vLLM's default max_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token: its id, its log-probability and the step's top alternatives
    ((id, log-probability) pairs: the sampled token first, then the top k in rank order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepLogprobs:
    """One step's log-probabilities for some of its rows, in one float32 tensor [R, 1 + 2k]:
    the sampled token's log-probability, the top k values, the top k ids (exact in float32
    below 2^24, which every vocabulary here is). On CUDA it is a pinned host copy queued behind
    the step, so reading it after the step's event costs no further wait."""

    rows: list[int]  # the rows of the step these belong to
    ks: list[int]  # each row's k
    k: int  # the k computed (the largest asked)
    packed: torch.Tensor

    @classmethod
    def compute(
        cls, logits: torch.Tensor, ids: torch.Tensor, rows: list[int], ks: list[int]
    ) -> StepLogprobs:
        """logits [B, V] as the model made them, ids [B] the sampled tokens; rows: the rows
        that asked, ks: how many alternatives each wants (0: only its own token)."""
        lo, hi = rows[0], rows[-1] + 1
        if hi - lo == len(rows):  # consecutive rows (one request, or all): views, no index copy
            picked, picked_ids = logits[lo:hi], ids[lo:hi]
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            picked, picked_ids = logits.index_select(0, index), ids.index_select(0, index)
        lp = torch.log_softmax(picked.float(), dim=-1)
        packed = lp.gather(1, picked_ids.view(-1, 1))
        k = min(max(ks), lp.shape[-1])
        if k > 0:
            values, top = torch.topk(lp, k, dim=-1)
            packed = torch.cat([packed, values, top.float()], dim=1)
        if logits.device.type == "cuda":
            packed = _pinned(packed)
        return cls(rows, ks, k, packed)

    def to_host(self, ids: list[int]) -> dict[int, TokenLogprobs]:
        """{row: TokenLogprobs}; ids: every row's sampled token (the step's host copy). On
        CUDA call it after the event recorded behind `compute` has completed."""
        k, out = self.k, {}
        for values, row, want in zip(self.packed.tolist(), self.rows, self.ks, strict=True):
            token, own = ids[row], values[0]
            pairs = [(token, own)]
            if want:
                tops = values[1 + k : 1 + k + want]
                pairs += [(int(t), v) for t, v in zip(tops, values[1 : 1 + want], strict=True)
                          if int(t) != token]  # fmt: skip
            out[row] = TokenLogprobs(token, own, tuple(pairs))
        return out


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy, queued behind the work that makes `t`: reading it later waits for
    nothing but that work (a plain `.tolist()` would wait for every step queued since, and the
    scheduler's one step of look-ahead would be lost for the whole batch)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def one_row(logits: torch.Tensor, token: torch.Tensor, k: int) -> StepLogprobs:
    """The single-sequence loop's step: logits [V], token [1]."""
    return StepLogprobs.compute(logits.view(1, -1), token.view(1), [0], [k])
