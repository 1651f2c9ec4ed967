"""The lean wire (greenroom's own HTTP client, the default of the anthropic, openai and
openai-responses providers) against each provider's library path (the anthropic SDK on
httpx2; httpx): for every wire fixture of the three APIs, split at the server's natural
chunks, at random offsets and one byte per chunk, for every error fixture and for the
failure modes the mock server can inject or a test can cause (stalls, a slow first byte,
refused connections, connect, write and pool timeouts, compressed bodies), both paths
deliver the same stream events — the same ModelError kinds and messages (R-RETRY-1,
R-SEC-10, R-PERF-1) — in fewer batches on the lean one. Then what only the lean client
does: reusing kept-alive connections, dropping one the server closed, its chunked-body
errors, TLS, and its one read deadline per body."""

from __future__ import annotations

import contextlib
import gzip
import math
import ssl
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from greenroom.actors.providers import lean_http
from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.lean_http import ConnectionPool, Timeouts, parse_url
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.stream import StreamEvent, StreamFailed, coalesce_deltas
from tests.support.mock_model_server import (
    DropAfter,
    Fixture,
    Hang,
    MalformedJSON,
    MidStreamError,
    Reply,
    SlowFirstByte,
    Text,
    ToolUse,
    Workload,
    error_fixture,
    open_mock_server,
)
from tests.support.raw_http import read_request
from tests.support.tls import self_signed

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BOUND_S = 15.0
SHORT = httpx2.Timeout(connect=5.0, read=0.5, write=5.0, pool=5.0)

WIRES: dict[str, Callable[..., Any]] = {
    "anthropic": lambda url, **options: AnthropicProvider(base_url=url, api_key="k", **options),
    "openai": lambda url, **options: OpenAIProvider(base_url=url + "/v1", api_key="k", **options),
    "openai-responses": lambda url, **options: OpenAIResponsesProvider(
        base_url=url + "/v1", api_key="k", **options
    ),
}


def _fixtures(wire: str, folder: str, pattern: str) -> list[tuple[str, str]]:
    root = FIXTURES / folder
    return [(wire, str(p.relative_to(FIXTURES))) for p in sorted(root.glob(pattern))]


STREAM_FIXTURES = [
    *_fixtures("anthropic", "anthropic", "*.sse"),
    *_fixtures("openai", "openai", "*.sse"),
    *_fixtures("openai", "openai/local", "*.sse"),
    *_fixtures("openai-responses", "openai_responses", "*.sse"),
]
ERROR_FIXTURES = [
    *_fixtures("anthropic", "anthropic/errors", "*.json"),
    *_fixtures("openai", "openai/errors", "*.json"),
    *_fixtures("openai", "openai/local", "*.json"),
    *_fixtures("openai-responses", "openai/errors", "*.json"),
]


def request(text: str = "hi") -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text=text),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


async def stream_with(
    provider: Any, the_request: ModelRequest | None = None
) -> tuple[list[StreamEvent], int]:
    """The events one request through ``provider`` delivers, and in how many batches; the
    provider is closed afterwards."""
    events: list[StreamEvent] = []
    batches = 0

    async def deliver(batch: list[StreamEvent]) -> None:
        nonlocal batches
        batches += 1
        events.extend(batch)

    try:
        with trio.fail_after(BOUND_S):
            await provider.open_task().stream(the_request or request(), deliver)
    finally:
        await provider.aclose()
    return events, batches


async def stream_once(
    response: Any,
    *,
    lean: bool,
    wire: str = "anthropic",
    rechunk: Any = None,
    limits: Any = None,
) -> tuple[list[StreamEvent], int]:
    """The events one request to the mock server delivers on one path, and in how many
    batches."""
    async with open_mock_server(response, rechunk=rechunk, seed=7) as server:
        options: dict[str, Any] = {} if limits is None else {"timeout": limits}
        provider = WIRES[wire](server.base_url, lean_http=lean, **options)
        assert provider.lean_http is lean
        return await stream_with(provider)


async def same_events(
    response: Any, *, wire: str = "anthropic", **options: Any
) -> list[StreamEvent]:
    library, _ = await stream_once(response, lean=False, wire=wire, **options)
    lean, _ = await stream_once(response, lean=True, wire=wire, **options)
    # The paths read the body in different pieces, which decide only where a block's
    # deltas are cut (R-RUN-2): joined, every event is the same.
    assert coalesce_deltas(lean) == coalesce_deltas(library)
    return lean


@pytest.mark.parametrize("rechunk", [None, "random", 1])
@pytest.mark.parametrize(("wire", "name"), STREAM_FIXTURES)
async def test_every_stream_fixture_decodes_the_same(wire: str, name: str, rechunk: Any) -> None:
    events = await same_events(Fixture(name), wire=wire, rechunk=rechunk)
    assert events


@pytest.mark.parametrize(("wire", "name"), ERROR_FIXTURES)
async def test_every_error_fixture_fails_the_same(wire: str, name: str) -> None:
    """HTTP error statuses, retry-after and retry-after-ms headers included: the codec's
    classification of the same status, body and headers on both paths."""
    [failure] = await same_events(error_fixture(name), wire=wire)
    assert isinstance(failure, StreamFailed)


REPLY = Reply([Text("one two three four five"), ToolUse("toolu_1", "lookup", {"key": "1"})])

FAULTS = {
    "drop": DropAfter(REPLY, 4),
    "drop-at-once": DropAfter(REPLY, 0),
    "mid-stream-error": MidStreamError(REPLY, 3),
    "malformed-json": MalformedJSON(2),
}


@pytest.mark.parametrize("rechunk", [None, "random"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_injected_faults_end_the_same(wire: str, fault: str, rechunk: Any) -> None:
    events = await same_events(FAULTS[fault], wire=wire, rechunk=rechunk)
    assert events


@pytest.mark.parametrize("rechunk", [None, "random"])
async def test_the_benchmark_workload_decodes_the_same(rechunk: Any) -> None:
    sdk, _ = await stream_once(Workload(text_tokens=20), lean=False, rechunk=rechunk)
    lean, _ = await stream_once(Workload(text_tokens=20), lean=True, rechunk=rechunk)
    assert coalesce_deltas(lean) == coalesce_deltas(sdk)


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_stalled_stream_times_out_the_same(wire: str) -> None:
    [failure] = await same_events(Hang(), wire=wire, limits=SHORT)
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_slow_first_byte_times_out_the_same(wire: str) -> None:
    [failure] = await same_events(SlowFirstByte(REPLY, 2.0), wire=wire, limits=SHORT)
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message == "no response from the server within 0.5 s (read timeout)"


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_refused_connection_fails_the_same(wire: str) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        results = []
        for lean in (False, True):
            provider = WIRES[wire](f"http://127.0.0.1:{port}", lean_http=lean)
            events, _ = await stream_with(provider)
            results.append(events)
    assert results[0] == results[1]
    [failure] = results[1]
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message.startswith(f"connection refused by 127.0.0.1:{port} (")


CONNECT_WORDS = {
    "anthropic": "timed out connecting to the server",
    "openai": "timed out connecting to the server (http://127.0.0.1:9/v1/chat/completions)",
    "openai-responses": "timed out connecting to the server (http://127.0.0.1:9/v1/responses)",
}


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_connect_timeout_fails_the_same(wire: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that does not open within the connect timeout (every stack here opens
    its TCP connections with ``trio.open_tcp_stream``, made to hang)."""

    async def never_connects(*args: Any, **kwargs: Any) -> Any:
        await trio.sleep_forever()

    monkeypatch.setattr(trio, "open_tcp_stream", never_connects)
    limits = httpx2.Timeout(connect=0.2, read=5.0, write=5.0, pool=5.0)
    results = []
    for lean in (False, True):
        provider = WIRES[wire]("http://127.0.0.1:9", lean_http=lean, timeout=limits)
        events, _ = await stream_with(provider)
        results.append(events)
    assert results[0] == results[1]
    [failure] = results[1]
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message == CONNECT_WORDS[wire]


async def _listen() -> tuple[trio.SocketListener, int]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    return listener, listener.socket.getsockname()[1]


async def _answer_once(listener: trio.SocketListener, response: bytes) -> None:
    """Accept one connection, read its request, send ``response`` whole and close."""
    stream = await listener.accept()
    await stream.receive_some(65536)
    await stream.send_all(response)
    await stream.aclose()


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_write_timeout_fails_the_same(wire: str) -> None:
    """A server that accepts the connection and never reads: a request larger than the
    socket buffers cannot be sent within the write timeout."""
    listener, port = await _listen()
    held: list[trio.SocketStream] = []

    async def accept_and_ignore() -> None:
        while True:
            held.append(await listener.accept())

    big = request("x" * (32 << 20))
    limits = httpx2.Timeout(connect=5.0, read=5.0, write=0.3, pool=5.0)
    results = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_and_ignore)
        for lean in (False, True):
            provider = WIRES[wire](f"http://127.0.0.1:{port}", lean_http=lean, timeout=limits)
            events, _ = await stream_with(provider, big)
            results.append(events)
        nursery.cancel_scope.cancel()
    for stream in held:
        await stream.aclose()
    await listener.aclose()
    assert results[0] == results[1]
    [failure] = results[1]
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message == "timed out sending the request"


POOL_WORDS = {
    "anthropic": "timed out waiting for a free connection (too many requests in flight)",
    "openai": "timed out waiting for a free connection",
    "openai-responses": "timed out waiting for a free connection",
}


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_a_pool_timeout_fails_the_same(wire: str) -> None:
    """One connection allowed and held by a stream that hangs: the next request waits for
    it no longer than the pool timeout."""
    limits = httpx2.Timeout(connect=5.0, read=30.0, write=5.0, pool=0.3)
    results = []
    for lean in (False, True):
        async with open_mock_server(Hang()) as server:
            options: dict[str, Any] = {"lean_http": lean, "timeout": limits, "max_connections": 1}
            if wire == "anthropic":
                options["shards"] = 1
            provider = WIRES[wire](server.base_url, **options)
            second: list[StreamEvent] = []

            async def deliver(batch: list[StreamEvent], into: list[StreamEvent] = second) -> None:
                into.extend(batch)

            async def ignore(batch: list[StreamEvent]) -> None:
                pass

            try:
                with trio.fail_after(BOUND_S):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(provider.open_task().stream, request(), ignore)
                        while server.request_count < 1:
                            await trio.testing.wait_all_tasks_blocked()
                        await provider.open_task().stream(request(), deliver)
                        nursery.cancel_scope.cancel()
            finally:
                await provider.aclose()
            results.append(second)
    assert results[0] == results[1]
    [failure] = results[1]
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message == POOL_WORDS[wire]


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_the_lean_path_batches_per_read(wire: str) -> None:
    """A body the server writes in one go, as many small HTTP chunks, reaches the decoder
    in far fewer batches than it has chunks (the library stacks hand on one at a time)."""
    reply = Reply([Text(" ".join(f"w{i}" for i in range(200)))])
    _, library_batches = await stream_once(reply, lean=False, wire=wire, rechunk=16)
    _, lean_batches = await stream_once(reply, lean=True, wire=wire, rechunk=16)
    assert lean_batches < library_batches / 4


def _compress(encoding: str, data: bytes) -> bytes:
    if encoding == "gzip":
        return gzip.compress(data)
    if encoding == "deflate":
        return zlib.compress(data)
    if encoding == "raw-deflate":
        packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return packer.compress(data) + packer.flush()
    return data


@pytest.mark.parametrize("encoding", ["identity", "gzip", "deflate", "raw-deflate"])
async def test_a_compressed_body_is_decoded_the_same(encoding: str) -> None:
    """A server that compresses the stream although the lean client asked for
    ``identity``: gzip and deflate (with or without its zlib wrapper) are decoded, and both
    paths give the fixture's events."""
    text = (FIXTURES / "anthropic" / "ping_interleaved.sse").read_bytes()
    payload = _compress(encoding, text)
    label = "deflate" if encoding == "raw-deflate" else encoding
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"content-encoding: " + label.encode() + b"\r\n"
        b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n"
    )
    listener, port = await _listen()

    async def answer() -> None:
        while True:
            stream = await listener.accept()
            await stream.receive_some(65536)
            await stream.send_all(head + payload)
            await stream.aclose()

    results = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        for lean in (False, True):
            provider = AnthropicProvider(
                base_url=f"http://127.0.0.1:{port}", api_key="k", lean_http=lean
            )
            events, _ = await stream_with(provider)
            results.append(events)
        nursery.cancel_scope.cancel()
    await listener.aclose()
    if encoding != "raw-deflate":  # httpx2 reads only zlib-wrapped deflate
        assert results[1] == results[0]
    assert results[1] == await same_events(Fixture("anthropic/ping_interleaved.sse"))


async def test_a_compressed_body_is_inflated_a_bounded_piece_at_a_time() -> None:
    """R-SEC-9: a gzip body inflates a thousandfold, and one read of it was inflated whole
    and handed on as one piece (64 MiB from a read of 64 KiB, its lines then all held at
    once by the decoder: a 256 KiB body took 600 MiB). Each piece is now at most
    ``MAX_INFLATED``; the body is all there."""
    inflated = b"\n" * (16 << 20)
    payload = gzip.compress(inflated, compresslevel=9)
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\n"
        b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n"
    )
    listener, port = await _listen()

    answer = partial(_answer_once, listener, head + payload)
    pool = ConnectionPool()
    sizes: list[int] = []
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            target = parse_url(f"http://127.0.0.1:{port}/")
            response = await pool.request(b"POST", target, [], b"x", Timeouts(read=5.0))
            try:
                async for piece in response.body:
                    sizes.append(len(piece))
            finally:
                await response.aclose()
    await pool.aclose()
    await listener.aclose()
    assert sum(sizes) == len(inflated)
    assert max(sizes) <= lean_http.MAX_INFLATED


async def _serve_raw(
    listener: trio.SocketListener, answer: Callable[[bytes], bytes], seen: list[bytes]
) -> None:
    """Answer each request on ``listener`` with ``answer(request head)``, recording the
    heads, one connection at a time."""
    while True:
        stream = await listener.accept()
        with contextlib.suppress(trio.BrokenResourceError):
            head = await read_request(stream)
            seen.append(head)
            await stream.send_all(answer(head))
        await stream.aclose()


def _sse_response() -> bytes:
    body = (FIXTURES / "anthropic" / "text_only.sse").read_bytes()
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


@pytest.mark.parametrize("status", [307, 308])
async def test_a_redirect_that_keeps_the_method_is_followed_the_same(status: int) -> None:
    """A base URL answered by a 307 or 308: both paths post again where it points (as the
    SDK's client follows redirects) and stream the answer; the credentials do not follow
    to another origin."""
    moved_to, moved_port = await _listen()
    origin, port = await _listen()
    redirected: list[bytes] = []
    answered: list[bytes] = []

    def redirect(head: bytes) -> bytes:
        return (
            b"HTTP/1.1 %d Moved\r\nlocation: http://127.0.0.1:%d/v1/messages\r\n"
            b"content-length: 0\r\nconnection: close\r\n\r\n" % (status, moved_port)
        )

    results = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_raw, origin, redirect, redirected)
        nursery.start_soon(_serve_raw, moved_to, lambda head: _sse_response(), answered)
        for lean in (False, True):
            provider = AnthropicProvider(
                base_url=f"http://127.0.0.1:{port}", api_key="k", lean_http=lean
            )
            events, _ = await stream_with(provider)
            results.append(events)
        nursery.cancel_scope.cancel()
    assert results[1] == results[0]
    assert type(results[1][-1]).__name__ == "MessageCompleted"
    assert len(redirected) == len(answered) == 2
    assert all(head.startswith(b"POST /v1/messages ") for head in answered)
    lean_head = answered[1].lower()
    assert b"x-api-key" not in lean_head and b"authorization" not in lean_head


async def test_an_endless_error_body_is_cut() -> None:
    """A 500 whose body never ends: the lean path reads at most ``MAX_ERROR_BODY`` of it,
    closes the connection and reports the failure (a server cannot make a failed request
    hold unbounded memory, nor hang it)."""
    from greenroom.actors.providers.lean_wire import MAX_ERROR_BODY

    listener, port = await _listen()

    async def answer() -> None:
        stream = await listener.accept()
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 500 Oops\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        with contextlib.suppress(trio.BrokenResourceError):
            while True:
                await stream.send_all(piece)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        provider = AnthropicProvider(
            base_url=f"http://127.0.0.1:{port}", api_key="k", lean_http=True
        )
        [failure], _ = await stream_with(provider)
        nursery.cancel_scope.cancel()
    await listener.aclose()
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message.startswith("server error (HTTP 500)")
    assert len(failure.error.message) <= MAX_ERROR_BODY + 100


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_connections_are_kept_alive_and_reused(wire: str) -> None:
    async with open_mock_server(*[Reply([Text("again")])] * 5) as server:
        provider = WIRES[wire](server.base_url, lean_http=True)
        try:
            for _ in range(5):
                events: list[StreamEvent] = []

                async def deliver(
                    batch: list[StreamEvent], events: list[StreamEvent] = events
                ) -> None:
                    events.extend(batch)

                with trio.fail_after(BOUND_S):
                    await provider.open_task().stream(request(), deliver)
                assert not isinstance(events[-1], StreamFailed)
        finally:
            await provider.aclose()
        assert server.request_count == 5
        assert server.connections_total == 1


async def test_a_connection_the_server_closed_is_not_reused() -> None:
    """``close_after_body`` fixtures end their body with the connection: the next request
    opens another one instead of failing on the dead one."""
    responses = [Fixture("anthropic/text_only.sse", close_after_body=True)] * 2
    async with open_mock_server(*responses) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="k", lean_http=True)
        try:
            for _ in range(2):
                events: list[StreamEvent] = []

                async def deliver(
                    batch: list[StreamEvent], events: list[StreamEvent] = events
                ) -> None:
                    events.extend(batch)

                with trio.fail_after(BOUND_S):
                    await provider.open_task().stream(request(), deliver)
                assert not isinstance(events[-1], StreamFailed)
        finally:
            await provider.aclose()
        assert server.connections_total == 2


@pytest.mark.parametrize("socket_takes", ["seven bytes", "nothing"])
async def test_a_request_the_socket_takes_in_part_is_sent_whole(
    socket_takes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain TCP connection is written straight to its descriptor; what the socket does
    not take at once (part of the request, or nothing: it would block) follows through
    the stream, and the server reads one whole request."""
    original = lean_http._write

    def write(fd: int, data: bytes) -> int:
        if socket_takes == "nothing":
            raise BlockingIOError
        return original(fd, data[:7])

    monkeypatch.setattr(lean_http, "_write", write)
    async with open_mock_server(Reply([Text("whole")])) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="k", lean_http=True)
        with trio.fail_after(BOUND_S):
            events, _ = await stream_with(provider, request("a prompt of some length"))
    assert server.request_count == 1
    assert not isinstance(events[-1], StreamFailed)
    texts = [e for e in coalesce_deltas(events) if getattr(e, "text", None)]
    assert "whole" in "".join(getattr(e, "text", "") for e in texts)


CHUNKED_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
    b'"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
)
TEXT_START = (
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
)
TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"more"}}\n\n'
)


async def stream_lean(
    listener: trio.SocketListener,
    port: int,
    answer: Any,
    deliver: Any,
    read_timeout: float,
) -> None:
    """One request through the lean client with ``read_timeout``, answered by the task
    ``answer`` on ``listener``; the server task is cancelled once the stream has ended."""
    timeout = httpx2.Timeout(connect=5.0, read=read_timeout, write=5.0, pool=5.0)
    provider = AnthropicProvider(
        base_url=f"http://127.0.0.1:{port}", api_key="k", lean_http=True, timeout=timeout
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            await provider.open_task().stream(request(), deliver)
            nursery.cancel_scope.cancel()
    finally:
        await provider.aclose()
        await listener.aclose()


async def stream_until_failed(
    listener: trio.SocketListener, port: int, answer: Any, read_timeout: float
) -> tuple[StreamEvent, float]:
    """:func:`stream_lean`: the stream's last event (its failure, when it failed) and
    when the failure was delivered (``inf`` if it was not)."""
    failed_at = math.inf
    events: list[StreamEvent] = []

    async def deliver(batch: list[StreamEvent]) -> None:
        nonlocal failed_at
        events.extend(batch)
        if failed_at == math.inf and any(isinstance(e, StreamFailed) for e in batch):
            failed_at = trio.current_time()

    await stream_lean(listener, port, answer, deliver, read_timeout)
    return events[-1], failed_at


async def post(pool: ConnectionPool, url: str, *, timeouts: Any = None) -> bytes:
    """One POST through ``pool``; the whole body."""
    response = await pool.request(b"POST", parse_url(url), [], b"x", timeouts or Timeouts(read=5.0))
    try:
        return await response.aread()
    finally:
        await response.aclose()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"zz\r\nabc\r\n0\r\n\r\n", "illegal chunk size"),
        (b"5\r\nab", "incomplete chunked read"),
        (b"-5\r\nabc\r\n0\r\n\r\n", "illegal chunk size"),
    ],
)
async def test_bad_chunked_bodies_are_protocol_errors(body: bytes, error: str) -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    listener, port = await _listen()

    answer = partial(_answer_once, listener, head + body)
    pool = ConnectionPool()
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            with pytest.raises(lean_http.RemoteProtocolError, match=error):
                await post(pool, f"http://127.0.0.1:{port}/")
    await pool.aclose()
    await listener.aclose()


@pytest.mark.parametrize(
    ("body", "error"),
    [(b"f" * 65536, "chunk size line too long"), (b"0\r\nx: " + b"y" * 65536, "trailers too long")],
    ids=["size-line", "trailers"],
)
async def test_a_chunk_line_without_end_is_a_protocol_error(body: bytes, error: str) -> None:
    """R-SEC-9: a chunk size line (or trailers) that never ended was held for as long as
    the server sent it, growing with every read until the read timeout: past the bound of
    a response head it is a protocol error at once."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    listener, port = await _listen()
    served = trio.Event()

    async def answer() -> None:
        stream = await listener.accept()
        await stream.receive_some(65536)
        await stream.send_all(head + body + b"x")
        await served.wait()  # the connection stays open: only the bound ends the read
        await stream.aclose()

    pool = ConnectionPool()
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            with pytest.raises(lean_http.RemoteProtocolError, match=error):
                await post(pool, f"http://127.0.0.1:{port}/", timeouts=Timeouts(read=BOUND_S))
            served.set()
    await pool.aclose()
    await listener.aclose()


async def test_chunk_extensions_and_trailers_are_accepted() -> None:
    body = b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nx-trailer: y\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    listener, port = await _listen()

    async def answer() -> None:
        stream = await listener.accept()
        await stream.receive_some(65536)
        for i in range(0, len(head + body), 3):  # arbitrary read boundaries
            await stream.send_all((head + body)[i : i + 3])
            await trio.testing.wait_all_tasks_blocked()
        await stream.aclose()

    pool = ConnectionPool()
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            got = await post(pool, f"http://127.0.0.1:{port}/")
    await pool.aclose()
    assert got == b"abcde"
    await listener.aclose()


async def test_https_through_the_lean_client_matches_httpx2(tmp_path: Path) -> None:
    """TLS with a given SSL context: the same body as httpx2's own client, over one
    kept-alive connection for two requests."""
    cert, key = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(cert))
    body = (FIXTURES / "anthropic" / "text_only.sse").read_bytes()
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in body.split(b"\n\n") if p)
    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n"
    )
    listener, port = await _listen()
    connections = 0

    async def serve_one(tcp: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        tls = trio.SSLStream(tcp, server_context, server_side=True)
        try:
            while True:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = await tls.receive_some(65536)
                    if not data:
                        return
                    request += data
                head, _, rest = request.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(rest) < length:
                    rest += await tls.receive_some(65536)
                await tls.send_all(response)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await trio.aclose_forcefully(tls)

    async def serve() -> None:
        async with trio.open_nursery() as conns:
            while True:
                conns.start_soon(serve_one, await listener.accept())

    url = f"https://localhost:{port}/v1/messages"
    bodies: dict[str, list[bytes]] = {}
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            async with httpx2.AsyncClient(verify=client_context) as client:
                for _ in range(2):
                    async with client.stream("POST", url, content=b"{}") as r:
                        assert r.status_code == 200
                        got = b"".join([chunk async for chunk in r.aiter_bytes()])
                    bodies.setdefault("httpx2", []).append(got)
            pool = ConnectionPool(ssl_context=client_context)
            for _ in range(2):
                bodies.setdefault("lean", []).append(await post(pool, url))
            await pool.aclose()
            nursery.cancel_scope.cancel()
    await listener.aclose()
    assert bodies["lean"] == bodies["httpx2"]
    assert bodies["lean"][0].replace(b"\n\n", b"") == body.replace(b"\n\n", b"")
    assert connections == 2  # one per client: each kept its connection for both requests


async def test_the_default_tls_context_verifies_against_the_system_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a context of its own the pool makes :func:`default_ssl_context` on its first
    https connection: a certificate the store does not know is refused (a connect error,
    not a silent connection), and ``SSL_CERT_FILE`` naming it makes it trusted."""
    cert, key = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    listener, port = await _listen()

    async def serve_one(tcp: trio.SocketStream) -> None:
        tls = trio.SSLStream(tcp, server_context, server_side=True)
        with contextlib.suppress(trio.BrokenResourceError, ssl.SSLError):
            await tls.receive_some(65536)
            await tls.send_all(ok)
        await trio.aclose_forcefully(tls)

    async def serve() -> None:
        async with trio.open_nursery() as conns:
            while True:
                conns.start_soon(serve_one, await listener.accept())

    url = f"https://localhost:{port}/"
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            monkeypatch.delenv("SSL_CERT_FILE", raising=False)
            monkeypatch.delenv("SSL_CERT_DIR", raising=False)
            pool = ConnectionPool()
            with pytest.raises(lean_http.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await post(pool, url)
            await pool.aclose()
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            pool = ConnectionPool()
            assert await post(pool, url) == b"ok"
            await pool.aclose()
            nursery.cancel_scope.cancel()
    await listener.aclose()


async def test_a_raw_body_times_out_after_a_read_timeout_of_silence_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The raw body's reads share one cancel scope, moved on lazily instead of one scope
    per read: a stream that keeps making progress outlives many read timeouts, and once it
    falls silent it fails after between one read timeout and ``1 + DEADLINE_SLACK`` of
    them, as a read timeout."""
    read_timeout = 10.0
    gap = 6.0  # below the read timeout: each piece must keep the stream alive
    listener, port = await _listen()
    last_sent = 0.0

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def answer() -> None:
        nonlocal last_sent
        stream = await listener.accept()
        await stream.receive_some(65536)
        await stream.send_all(CHUNKED_SSE_HEAD + chunk(MESSAGE_START + TEXT_START))
        for _ in range(8):
            await trio.sleep(gap)
            await stream.send_all(chunk(TEXT_DELTA))
            last_sent = trio.current_time()
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.receive_some(65536)  # until the client gives up

    failure, failed_at = await stream_until_failed(listener, port, answer, read_timeout)
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert "read timed out" in failure.error.message
    silence = failed_at - last_sent
    assert last_sent >= 8 * gap > 4 * read_timeout
    assert read_timeout <= silence <= read_timeout * (1 + lean_http.DEADLINE_SLACK) + 0.1


@pytest.mark.parametrize(
    "keepalive",
    [b'event: ping\ndata: {"type":"ping"}\n\n', b": keep-alive\n\n", b"\n"],
    ids=["ping", "comment", "blank"],
)
async def test_a_raw_body_of_keepalives_times_out_like_a_silent_one(
    autojump_clock: trio.testing.MockClock, keepalive: bytes
) -> None:
    """R-SEC-10 on the lean path: keep-alives well inside the read timeout do not move the
    shared read deadline (only reads that decode to events do), so after the last event
    the stream fails within ``1 + DEADLINE_SLACK`` read timeouts, as a ``timeout`` that
    says it saw only keep-alives."""
    read_timeout = 10.0
    gap = 2.0
    listener, port = await _listen()
    progress_at = 0.0

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def answer() -> None:
        nonlocal progress_at
        stream = await listener.accept()
        await stream.receive_some(65536)
        await stream.send_all(CHUNKED_SSE_HEAD + chunk(MESSAGE_START + TEXT_START))
        await trio.sleep(gap)
        await stream.send_all(chunk(TEXT_DELTA))
        progress_at = trio.current_time()
        with contextlib.suppress(trio.BrokenResourceError):
            for _ in range(int(10 * read_timeout / gap)):  # without R-SEC-10: a cut stream
                await trio.sleep(gap)
                await stream.send_all(chunk(keepalive))
        await stream.aclose()

    failure, failed_at = await stream_until_failed(listener, port, answer, read_timeout)
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert failure.error.message == "stream stalled: no progress for 10 s (only keep-alives)"
    stalled = failed_at - progress_at
    assert read_timeout <= stalled <= read_timeout * (1 + lean_http.DEADLINE_SLACK) + 0.1


async def test_a_body_read_without_waiting_never_times_out(
    mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared read deadline is moved on before every point where it could strike,
    the reader's periodic checkpoint after reads that found data at once included: a body
    that keeps ahead of the reader streams for many read timeouts without failing. (The
    checkpoint comes after every such read here instead of every 16th: loopback buffers
    hold a few full reads, not 16.) Time moves only as ``deliver`` says: an autojumping
    clock would also jump while both ends wait for the loopback socket on a loaded
    machine, a stall the test does not mean."""
    monkeypatch.setattr(lean_http, "_UNWAITED_READS", 1)
    read_timeout = 10.0
    text_event = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"' + b"x" * 400 + b'"}}\n\n'
    )
    events = [
        MESSAGE_START,
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        *[text_event] * 3000,  # about 1.4 MB: 20 or more full reads
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"end_turn"},"usage":{"output_tokens":9}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    listener, port = await _listen()

    async def answer() -> None:
        stream = await listener.accept()
        await stream.receive_some(65536)
        with contextlib.suppress(trio.BrokenResourceError):  # a client that gave up
            await stream.send_all(CHUNKED_SSE_HEAD + body)
            await stream.receive_some(65536)

    got: list[StreamEvent] = []
    start = trio.current_time()

    async def deliver(batch: list[StreamEvent]) -> None:
        got.extend(batch)
        mock_clock.jump(read_timeout)  # each read's events take a read timeout

    await stream_lean(listener, port, answer, deliver, read_timeout)
    assert not any(isinstance(e, StreamFailed) for e in got), got[-1]
    assert type(got[-1]).__name__ == "MessageCompleted"
    assert trio.current_time() - start > 2 * read_timeout * (1 + lean_http.DEADLINE_SLACK)


async def test_informational_responses_alone_time_out_like_silence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SEC-10 on the lean path: a server that answers only ``100 Continue``, one every
    2 s, never the response, fails the attempt within a read timeout and a read of the
    request's start (it was read on for as long as the server went on before)."""
    read_timeout = 10.0
    gap = 2.0
    listener, port = await _listen()
    asked_at = 0.0

    async def answer() -> None:
        nonlocal asked_at
        stream = await listener.accept()
        await stream.receive_some(65536)
        asked_at = trio.current_time()
        with contextlib.suppress(trio.BrokenResourceError):
            for _ in range(int(10 * read_timeout / gap)):
                await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                await trio.sleep(gap)
        await stream.aclose()

    failure, failed_at = await stream_until_failed(listener, port, answer, read_timeout)
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout", failure
    assert failed_at - asked_at <= read_timeout + gap + 0.1
