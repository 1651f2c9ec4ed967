"""The library paths' response bodies hold bounded memory (R-SEC-1, R-SEC-9): a model server
that answers with a compressed body (gzip although the lean path asks for identity; the
libraries ask for gzip and deflate themselves) gets it inflated a bounded piece at a time,
an error body is read up to ``MAX_ERROR_BODY``, and an encoding greenroom does not read
fails the attempt with words that name it. Each through the real SDK or httpx client and
the mock model server over a real socket."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import trio

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.stream import StreamEvent, StreamFailed
from tests.support.mock_model_server import (
    ErrorReply,
    MockModelServer,
    Reply,
    SSEEvent,
    Streamed,
    Text,
    open_mock_server,
    render_anthropic,
    render_openai,
)

BOUND_S = 60.0
INFLATED = 32 << 20
"""What each compressed body below inflates to (from about 32 KiB): far above the bound."""
PEAK_BOUND = 16 << 20
"""The most the process may allocate at once while one such body is read."""

MAKERS: dict[str, Callable[[MockModelServer], Any]] = {
    "anthropic": lambda s: AnthropicProvider(base_url=s.base_url, api_key="k", lean_http=False),
    "openai": lambda s: OpenAIProvider(base_url=s.base_url + "/v1", api_key="k", lean_http=False),
}
RENDER = {
    "anthropic": lambda reply: render_anthropic(reply, message_id="msg_1", default_input_tokens=3),
    "openai": lambda reply: render_openai(reply, completion_id="cmpl_1", default_input_tokens=3),
}


def request() -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text="hi"),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


async def measured_stream(wire: str, answer: Any) -> tuple[list[StreamEvent], int]:
    """The events of one library-path attempt answered with ``answer``, and the peak of
    memory allocated while it ran."""
    events: list[StreamEvent] = []

    async def deliver(batch: list[StreamEvent]) -> None:
        events.extend(batch)

    async with open_mock_server(answer) as server:
        provider = MAKERS[wire](server)
        assert provider.lean_http is False
        task = provider.open_task()
        tracemalloc.start()
        try:
            with trio.fail_after(BOUND_S):
                await task.stream(request(), deliver)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await provider.aclose()
    return events, peak


def text_of(events: list[StreamEvent]) -> str:
    return "".join(getattr(event, "text", "") for event in events)


@pytest.mark.parametrize("wire", sorted(MAKERS))
async def test_a_compressed_stream_is_inflated_in_bounded_pieces(wire: str) -> None:
    """A gzip stream of 32 MiB of SSE comment lines, then a reply, compressed to about
    32 KiB: httpx inflated a network read of it whole and the codec held it all at once;
    it is now read a bounded piece at a time, and the reply still comes through."""
    sse = b"".join(event.data for event in RENDER[wire](Reply([Text("still here")])))
    comment = b": " + b"k" * 1021 + b"\n"
    body = gzip.compress(comment * (INFLATED // len(comment)) + sse, compresslevel=9)
    answer = Streamed(
        events=[SSEEvent(body)],
        headers=[("content-type", "text/event-stream"), ("content-encoding", "gzip")],
        paced=False,
    )
    events, peak = await measured_stream(wire, answer)
    assert not [event for event in events if isinstance(event, StreamFailed)], events
    assert text_of(events) == "still here"
    assert peak < PEAK_BOUND, f"peak {peak >> 20} MiB"


@pytest.mark.parametrize("wire", sorted(MAKERS))
async def test_a_compressed_error_body_is_read_up_to_its_bound(wire: str) -> None:
    """An error response whose gzip body inflates to 32 MiB: the SDK, and the httpx path,
    read an error body whole before classifying it; now at most ``MAX_ERROR_BODY`` of it
    is read, and the error is still classified from it."""
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    if wire == "openai":
        error = {"error": {"type": "server_error", "message": "busy", "code": None}}
    inflated = json.dumps(error).encode() + b" " * INFLATED
    answer = ErrorReply(
        500,
        gzip.compress(inflated, compresslevel=9),
        {"content-type": "application/json", "content-encoding": "gzip"},
    )
    events, peak = await measured_stream(wire, answer)
    assert len(events) == 1 and isinstance(events[0], StreamFailed), events
    assert events[0].error.status_code == 500
    assert "busy" in events[0].error.message
    assert peak < PEAK_BOUND, f"peak {peak >> 20} MiB"


@pytest.mark.parametrize("wire", sorted(MAKERS))
async def test_an_encoding_greenroom_does_not_read_fails_the_attempt(wire: str) -> None:
    """A body in an encoding neither library asked for (``br``) fails the attempt with a
    message that names it, instead of reaching the codec as it is."""
    sse = b"".join(event.data for event in RENDER[wire](Reply([Text("hidden")])))
    answer = Streamed(
        events=[SSEEvent(sse)],
        headers=[("content-type", "text/event-stream"), ("content-encoding", "br")],
        paced=False,
    )
    events, _ = await measured_stream(wire, answer)
    failed = [event for event in events if isinstance(event, StreamFailed)]
    assert len(failed) == 1, events
    assert "content-encoding 'br'" in failed[0].error.message
    assert "hidden" not in text_of(events)
