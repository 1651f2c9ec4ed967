"""R-SEC-10 on the library paths (``lean_http=False``: the anthropic SDK on httpx2, httpx
for the OpenAI providers), measured against the lean path on the same server.

A library's read timeout starts again with every byte. A response head trickled a byte at
a time, an error response's body trickled alike, or (the SDK following redirects) a 307's
body trickled so, held the library path for ever; each now ends within the read timeout
as the lean path ends it, with the same failure kind and words. A 200 stream whose real
(keep-alive-free) bytes come one at a time already fails by the no-progress deadline on
every path: checked here too.

Heads are trickled by a raw socket server (the mock model server always writes a head
whole); error and redirect bodies and 200 streams by the mock model server, one byte an
event paced by ``token_delay_ms``. Under ``MockClock`` the SDK's first request resolves
its platform in a worker thread, which an autojumping clock would race with the deadline:
every test answers one request first with no deadline running.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import httpx
import httpx2
import pytest
import trio
import trio.testing

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.lean_http import DEADLINE_SLACK
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.stream import MessageCompleted, StreamEvent, StreamFailed
from tests.support.mock_model_server import (
    ErrorReply,
    Reply,
    SSEEvent,
    Streamed,
    Text,
    open_mock_server,
    render_anthropic,
    render_openai,
    render_responses_reply,
)
from tests.support.raw_http import read_request

READ_TIMEOUT = 10.0
TRICKLE_EVERY_S = 2.0
BOUND_S = 1000.0
"""Bound on every wait (mock time): a request held for ever fails the test instead."""

WIRES = ["anthropic", "openai", "openai-responses"]


def make_provider(wire: str, base_url: str, lean: bool) -> Any:
    if wire == "anthropic":
        timeout2 = httpx2.Timeout(connect=5.0, read=READ_TIMEOUT, write=5.0, pool=5.0)
        return AnthropicProvider(base_url=base_url, api_key="k", timeout=timeout2,
                                 lean_http=lean)
    timeout = httpx.Timeout(connect=5.0, read=READ_TIMEOUT, write=5.0, pool=5.0)
    cls = OpenAIResponsesProvider if wire == "openai-responses" else OpenAIProvider
    return cls(base_url=base_url + "/v1", api_key="k", timeout=timeout, lean_http=lean)


def request() -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text="hi"),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


async def stream(task: Any, bound: float = BOUND_S) -> list[tuple[float, list[StreamEvent]]]:
    """Every batch one attempt delivers, with the (mock) time it was delivered; ``bound``
    (mock seconds) on the wait."""
    batches: list[tuple[float, list[StreamEvent]]] = []

    async def deliver(batch: list[StreamEvent]) -> None:
        batches.append((trio.current_time(), batch))

    with trio.fail_after(bound):
        await task.stream(request(), deliver)
    return batches


async def warm_then_time(provider: Any) -> tuple[float, list[tuple[float, list[StreamEvent]]]]:
    """One attempt to warm the provider up (its events ignored), then the measured one:
    when it began, and its batches. No deadline runs during the first (see the module
    docstring)."""
    try:
        await stream(provider.open_task(), math.inf)
        start = trio.current_time()
        return start, await stream(provider.open_task())
    finally:
        await provider.aclose()


def failure_of(batches: list[tuple[float, list[StreamEvent]]]) -> tuple[float, StreamFailed]:
    at, last = batches[-1]
    failure = last[-1]
    assert isinstance(failure, StreamFailed), batches
    return at, failure


# -- a trickled head -------------------------------------------------------------------------

WARM_UP = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
    b"connection: close\r\n\r\n{}"
)


async def _warm_then_trickle(
    listener: trio.SocketListener, prefix: bytes, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer the first request whole (a 400), the next with ``prefix`` then one byte
    every 2 s for ever: never silent for a read timeout, never done."""
    task_status.started()
    first = await listener.accept()
    with contextlib.suppress(trio.BrokenResourceError):
        await read_request(first)
        await first.send_all(WARM_UP)
    await first.aclose()
    stream = await listener.accept()
    with contextlib.suppress(trio.BrokenResourceError):
        await read_request(stream)
        await stream.send_all(prefix)
        while True:
            await trio.sleep(TRICKLE_EVERY_S)
            await stream.send_all(b"x")


@pytest.mark.parametrize("wire", WIRES)
async def test_a_head_trickled_byte_by_byte_ends_at_the_read_timeout_on_both_paths(
    autojump_clock: trio.testing.MockClock, wire: str
) -> None:
    """A status line, then a header byte every 2 s with a 10 s read timeout: each path
    fails the attempt as ``timeout``, ``no response from the server within 10 s (read
    timeout)``, one read timeout after the head was awaited (before, the library path's
    read timeout started again with each byte and the request was held for ever)."""
    failures = {}
    for lean in (True, False):
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(_warm_then_trickle, listener, b"HTTP/1.1 200 OK\r\n")
            provider = make_provider(wire, f"http://127.0.0.1:{port}", lean)
            start, batches = await warm_then_time(provider)
            nursery.cancel_scope.cancel()
        await listener.aclose()
        at, failure = failure_of(batches)
        assert READ_TIMEOUT <= at - start <= READ_TIMEOUT + 0.1, (lean, at - start)
        failures[lean] = failure.error
    assert failures[False].kind == failures[True].kind == "timeout"
    assert failures[False].message == failures[True].message
    assert failures[True].message == "no response from the server within 10 s (read timeout)"


# -- a trickled error body, a trickled redirect body --------------------------------------------


def trickled(data: bytes, status: int, headers: list[tuple[str, str]]) -> Streamed:
    """A response whose body comes a byte every ``token_delay_ms``."""
    events = [SSEEvent(bytes([b]), delta=True) for b in data]
    return Streamed(events, status=status, headers=headers)


ERROR_HEADERS = [("content-type", "application/json")]


@pytest.mark.parametrize("wire", WIRES)
async def test_an_error_body_trickled_byte_by_byte_ends_at_the_read_timeout_on_both_paths(
    autojump_clock: trio.testing.MockClock, wire: str
) -> None:
    """A 500 whose body comes a byte every 2 s (1,000 of them) with a 10 s read timeout:
    each path classifies the bytes that came within the read timeout and its slack, the
    same on both (before, the library path waited the 2,000 s of the whole body)."""
    failures = {}
    for lean in (True, False):
        async with open_mock_server(ErrorReply(400, b"{}"),
                                    trickled(b"x" * 1000, 500, ERROR_HEADERS),
                                    token_delay_ms=TRICKLE_EVERY_S * 1000) as server:
            provider = make_provider(wire, server.base_url, lean)
            start, batches = await warm_then_time(provider)
        at, failure = failure_of(batches)
        assert at - start <= READ_TIMEOUT * (1 + DEADLINE_SLACK) + 0.1, (lean, at - start)
        failures[lean] = failure.error
    assert failures[False].kind == failures[True].kind
    assert failures[False].message == failures[True].message
    assert "(HTTP 500): xxxxxxx" in failures[True].message, failures[True].message


async def test_a_redirect_body_trickled_byte_by_byte_holds_the_sdk_no_longer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The SDK follows a 307 after reading its body whole: a body that comes a byte every
    2 s is read for the read timeout and its slack at most, then the redirect is followed
    and answered (the lean path follows without reading it). Before, the SDK read it for
    the 2,000 s it lasted."""
    for lean in (True, False):
        async with open_mock_server(
            ErrorReply(400, b"{}"), token_delay_ms=TRICKLE_EVERY_S * 1000
        ) as server:
            location = [("location", server.base_url + "/v1/messages"), *ERROR_HEADERS]
            server.push(trickled(b"x" * 1000, 307, location), Reply([Text("Recovered.")]))
            provider = make_provider("anthropic", server.base_url, lean)
            start, batches = await warm_then_time(provider)
        at, last = batches[-1]
        assert isinstance(last[-1], MessageCompleted), (lean, batches)
        assert at - start <= READ_TIMEOUT * (1 + DEADLINE_SLACK) + 0.1, (lean, at - start)


# -- a trickled 200 stream -------------------------------------------------------------------

WHOLE_EVENTS = 2


def trickled_stream(wire: str) -> Streamed:
    """A real reply of the wire: its first events whole, then every byte of the rest (no
    keep-alive among them) one every ``token_delay_ms``."""
    reply = Reply([Text("a reply that comes one byte at a time " * 4)])
    if wire == "anthropic":
        events = render_anthropic(reply, message_id="msg_1", default_input_tokens=5)
    elif wire == "openai":
        events = render_openai(reply, completion_id="chatcmpl-1", default_input_tokens=5)
    else:
        events = render_responses_reply(reply, 1, 5)
    whole = [SSEEvent(e.data) for e in events[:WHOLE_EVENTS]]
    rest = b"".join(e.data for e in events[WHOLE_EVENTS:])
    return Streamed([*whole, *(SSEEvent(bytes([b]), delta=True) for b in rest)])


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "library"])
@pytest.mark.parametrize("wire", WIRES)
async def test_a_stream_trickled_byte_by_byte_stalls_on_both_paths(
    autojump_clock: trio.testing.MockClock, wire: str, lean: bool
) -> None:
    """After two whole events, the real bytes of the rest a byte every 2 s: no event
    completes within a read timeout, so the no-progress deadline ends the attempt as
    ``timeout`` between 10 and 12.5 s after the last event, as for keep-alives (the bytes
    that decoded to nothing are reported as keep-alives, on both paths alike)."""
    async with open_mock_server(ErrorReply(400, b"{}"), trickled_stream(wire),
                                token_delay_ms=TRICKLE_EVERY_S * 1000) as server:
        provider = make_provider(wire, server.base_url, lean)
        _, batches = await warm_then_time(provider)
    *progress, _ = batches
    assert progress, "the whole events must arrive before the trickle"
    at, failure = failure_of(batches)
    assert failure.error.kind == "timeout"
    assert failure.error.message == "stream stalled: no progress for 10 s (only keep-alives)"
    stalled = at - progress[-1][0]
    assert READ_TIMEOUT <= stalled <= READ_TIMEOUT * (1 + DEADLINE_SLACK) + 0.1
