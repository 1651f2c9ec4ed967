"""What the LLM streamer costs per model request and per streamed batch, with nothing on the
wire: a provider that delivers its batches at once. Run it on two versions of the code (a
``PYTHONPATH`` tree for the older one) to see what a change on the streamer's path costs;
the admission point of R-SHARE-1 was measured this way (no limits configured, no pause).

    .venv/bin/python -m tests.benchmarks.admission_hot_path [--requests N] [--batches N]

Prints the medians of 7 runs: µs per request (one batch of content and the end) and µs
per batch of a long stream (``--batches`` batches in one request); where the code has an
admission point, also what its fast path alone costs per request (admit, the first and the
last batch observed, release)."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import trio

from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.messages import StartAttempt
from greenroom.protocols.stream import BlockStarted, MessageCompleted, TextDelta, TokenUsage

REQUEST = ModelRequest(
    model="m", system=None, tools=(),
    messages=(UserMessage(content=(TextBlock(text="hi"),)),), max_tokens=64,
)
USAGE = TokenUsage(input=10, output=10)


class InstantProvider:
    """Delivers ``batches`` one-delta batches, then the end, without waiting."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    async def stream(self, request: ModelRequest, deliver: Any) -> None:
        await deliver([BlockStarted(index=0, kind="text")])
        delta = [TextDelta(index=0, text="x")]
        for _ in range(self.batches):
            await deliver(delta)
        await deliver([MessageCompleted(stop_reason="end_turn", usage=USAGE)])


async def timed(requests: int, batches: int) -> float:
    """Seconds for ``requests`` attempts of ``batches`` batches each, one after another."""
    # Unbounded: the streamer sends with send_nowait, and this loop drains every batch.
    inbox_send, inbox = trio.open_memory_channel[Any](math.inf)
    # Unbounded: one command at a time is ever queued.
    commands_send, commands = trio.open_memory_channel[Any](math.inf)
    streamer = LLMStreamer(InstantProvider(batches), inbox_send)
    expected = batches + 2
    async with trio.open_nursery() as nursery:
        await nursery.start(streamer.run, commands)
        start = time.perf_counter()
        for number in range(requests):
            commands_send.send_nowait(
                StartAttempt(request=REQUEST, attempt=1, delay_ms=0, number=number)
            )
            for _ in range(expected):
                await inbox.receive()
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return elapsed


async def admission_alone(requests: int) -> float | None:
    """Seconds for ``requests`` passes through an admission point's fast path; None when
    the code has none."""
    try:
        from greenroom.actors.runtime.admission import EndpointAdmission, Requester
    except ImportError:
        return None
    requester = Requester(EndpointAdmission(), "", "s")
    first: list[Any] = [BlockStarted(index=0, kind="text")]
    last: list[Any] = [MessageCompleted(stop_reason="end_turn", usage=USAGE)]
    start = time.perf_counter()
    for _ in range(requests):
        permit = requester.admit_now()
        if permit is None:
            permit = await requester.admit(REQUEST)
        permit.observe(first)
        permit.observe(last)
        permit.release()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    per_request = [
        trio.run(timed, args.requests, 0) / args.requests * 1e6 for _ in range(args.runs)
    ]
    per_batch = [
        trio.run(timed, 1, args.batches) / args.batches * 1e6 for _ in range(args.runs)
    ]
    alone = [trio.run(admission_alone, args.requests) for _ in range(args.runs)]
    if alone[0] is not None:
        costs = [a / args.requests * 1e6 for a in alone if a is not None]
        print(f"admission fast path alone: {statistics.median(costs):.3f} µs per request")
    print(f"per request: {statistics.median(per_request):.2f} µs "
          f"(runs {min(per_request):.2f} to {max(per_request):.2f})")
    print(f"per batch:   {statistics.median(per_batch):.3f} µs "
          f"(runs {min(per_batch):.3f} to {max(per_batch):.3f})")


if __name__ == "__main__":
    main()
