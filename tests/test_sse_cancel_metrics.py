"""A stream whose client leaves still counts its generation: the reply's loop stops at the next
event, possibly a token already buffered, and the job's last event (the engine's end of the
cancelled sequence) is read all the same, so the metrics count it as cancelled with its tokens.

CI once saw `cancelled_total` stay at 0 on a loaded host (tests/test_server_api.py's disconnect
test): tokens were waiting in the job's queue when the client left, the reply broke out at the
first of them and closed the events before the last one."""

from __future__ import annotations

import asyncio

from engine.sampling import SamplingParams
from engine.sequence import Output, Sequence
from engine.server.metrics import Metrics
from engine.server.queue import GenerationRequest, Job
from engine.server.sse import SSEResponse
from engine.tokenizer_synth import build_tokenizer


def test_a_client_leaving_with_tokens_buffered_still_counts_a_cancelled_generation() -> None:
    async def scenario() -> tuple[Metrics, list[bytes]]:
        loop = asyncio.get_running_loop()
        metrics = Metrics("tiny")
        params = SamplingParams(max_tokens=100)
        job = Job(GenerationRequest([2, 3, 4], params), build_tokenizer(512), metrics, loop,
                  lambda: None)  # fmt: skip
        seq = Sequence([2, 3, 4], params, frozenset(), chunk=16, score_budget=None)
        job.seq = seq
        sent: list[bytes] = []
        left = asyncio.Event()

        async def payloads():
            async for event in job.events():
                yield {"text": event.text}

        async def send(message: dict) -> None:
            sent.append(message.get("body", b""))
            if len(sent) == 2:  # the first token is out: the client goes away
                left.set()
            await asyncio.sleep(0)  # a write gives the loop a turn (the watcher sees it leave)

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        for token in (10, 11, 12, 13):  # the engine made four tokens before the reply ran
            job.sink(seq, Output([token]))

        def engine_ends_the_cancelled_sequence() -> None:
            # the engine's next step after the cancel: the sequence ends, no reason
            job.sink(seq, Output([], finished=True, finish_reason=None))

        async def engine() -> None:
            await left.wait()
            await asyncio.sleep(0.05)  # a step later
            assert seq.cancelled  # the watcher passed the client's leaving to the engine
            engine_ends_the_cancelled_sequence()

        engine_task = asyncio.create_task(engine())
        response = SSEResponse(job, payloads())
        await response(scope={}, receive=receive, send=send)
        await engine_task
        return metrics, sent

    metrics, sent = asyncio.run(scenario())
    assert metrics.cancelled == 1 and metrics.generations == 1
    assert metrics.completion_tokens == 4  # every token the engine made for it
    assert b"[DONE]" not in b"".join(sent)  # nothing more went to a client that left
