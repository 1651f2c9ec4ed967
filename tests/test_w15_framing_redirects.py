"""The lean wire and the anthropic SDK's path answer the same server the same way
(R-SEC-1, R-SEC-10), each against a real loopback server:

- A chunked body whose chunk is not closed by exactly CRLF (no CRLF at all, a bare LF, a
  blank line more) or whose size line h11 does not read is bad HTTP on both paths (the
  lean decoder read the next bytes as a size line, and streamed a body h11 refuses).
- The SDK path follows a redirect as the lean path does: only 307 and 308 (a 301, 302 or
  303 is the answer, where httpx2 followed it as a GET without the body), at most
  ``MAX_REDIRECTS`` of them (httpx2: 20), no credential header sent on to another origin
  (httpx2 dropped ``authorization`` only: an ``x-api-key`` from ``ANTHROPIC_CUSTOM_HEADERS``
  went along).
"""

from __future__ import annotations

import pytest
import trio

from greenroom.actors.providers.lean_http import (
    ConnectionPool,
    RemoteProtocolError,
    Timeouts,
    parse_url,
)
from greenroom.actors.providers.lean_wire import MAX_REDIRECTS
from greenroom.protocols.stream import MessageCompleted, StreamEvent, StreamFailed
from tests.support.mock_model_server import ErrorReply, Reply, Text, open_mock_server
from tests.test_s14_streams import (
    BOUND_S,
    CHUNKED,
    PATHS,
    SSE,
    TYPE,
    _serve,
    both_paths,
    one_stream,
    provider_for,
    text_of,
)

HEAD = b"HTTP/1.1 200 OK\r\n" + TYPE + b"\r\n" + CHUNKED + b"\r\n\r\n"
PAYLOAD = SSE["anthropic"]
HALF = len(PAYLOAD) // 2
FIRST, SECOND = PAYLOAD[:HALF], PAYLOAD[HALF:]


def _size(piece: bytes) -> bytes:
    return b"%x" % len(piece)


REFUSED_BODIES: dict[str, bytes] = {
    # The flaw after the first half of the stream: what came before it is streamed alike.
    "no CRLF after a chunk": b"",
    "a bare LF after a chunk": b"\n",
    "a CR alone after a chunk": b"\r",
    "a blank line more after a chunk": b"\r\n\r\n",
    "a blank before the next size": b"\r\n ",
    "a size of 21 digits next": b"\r\n" + b"0" * 20,
}


def _refused(flaw: bytes) -> bytes:
    first = _size(FIRST) + b"\r\n" + FIRST
    return first + flaw + _size(SECOND) + b"\r\n" + SECOND + b"\r\n0\r\n\r\n"


def _chunk(piece: bytes, size_line: bytes) -> bytes:
    return size_line + b"\r\n" + piece + b"\r\n"


LAST = b"0\r\n\r\n"
ACCEPTED_BODIES: dict[str, bytes] = {
    "two chunks": _chunk(FIRST, _size(FIRST)) + _chunk(SECOND, _size(SECOND)) + LAST,
    "blanks after the size": _chunk(PAYLOAD, _size(PAYLOAD) + b" \t") + LAST,
    "leading zeros and an extension": _chunk(PAYLOAD, b"000" + _size(PAYLOAD) + b";a=b") + LAST,
}


@pytest.mark.parametrize("case", sorted(REFUSED_BODIES))
async def test_a_chunk_h11_refuses_is_refused_on_the_lean_path_alike(case: str) -> None:
    """A chunk not closed by exactly CRLF, or a size line h11 does not read: both paths
    fail the attempt as bad HTTP from the server (``malformed``: the stream was cut), after
    the same events
    (before, the lean path read what followed the payload as a size line and completed
    the stream, or skipped the blank and leading blanks)."""
    results = await both_paths("anthropic", HEAD + _refused(REFUSED_BODIES[case]))
    kinds = set()
    for lean, events in results.items():
        failure = events[-1]
        assert isinstance(failure, StreamFailed), (lean, events)
        kinds.add(failure.error.kind)
        assert "; bad HTTP from the server (" in failure.error.message, (lean, failure.error)
    assert kinds == {"malformed"}
    assert results[True][:-1] == results[False][:-1]
    assert len(results[True]) > 1


@pytest.mark.parametrize("case", sorted(ACCEPTED_BODIES))
async def test_a_chunked_body_h11_reads_is_read_on_the_lean_path_alike(case: str) -> None:
    results = await both_paths("anthropic", HEAD + ACCEPTED_BODIES[case])
    for lean, events in results.items():
        assert isinstance(events[-1], MessageCompleted), (lean, events)
    assert results[True] == results[False]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"3\r\nabc0\r\n\r\n", "malformed chunk footer"),
        (b"3\r\nabc\n0\r\n\r\n", "malformed chunk footer"),
        (b"3\r\nabc\r\n\r\n0\r\n\r\n", "illegal chunk size"),
    ],
)
async def test_a_chunk_without_its_crlf_is_a_protocol_error(body: bytes, words: str) -> None:
    """The lean client itself: reading the body raises ``RemoteProtocolError`` (before,
    it returned ``abc``), also when the footer arrives one byte at a time."""
    answer = b"HTTP/1.1 200 OK\r\n" + CHUNKED + b"\r\n\r\n" + body
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    pool = ConnectionPool()
    async with trio.open_nursery() as nursery:
        await nursery.start(_serve, listener, answer)
        response = await pool.request(
            b"POST", parse_url(f"http://127.0.0.1:{port}/"), [], b"x", Timeouts(read=5.0)
        )
        with trio.fail_after(BOUND_S), pytest.raises(RemoteProtocolError, match=words):
            await response.aread()
        nursery.cancel_scope.cancel()
    await pool.aclose()
    await listener.aclose()


async def test_a_footer_split_across_reads_is_still_read() -> None:
    """The CRLF after a chunk arriving as CR, then LF, in two network reads."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    sent_cr = trio.Event()
    read_first = trio.Event()

    async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        stream = await listener.accept()
        data = b""
        while not data.endswith(b"x"):
            data += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\n" + CHUNKED + b"\r\n\r\n3\r\nabc\r")
        sent_cr.set()
        await read_first.wait()
        await stream.send_all(b"\n2\r\nde\r\n0\r\n\r\n")
        await stream.aclose()

    pool = ConnectionPool()
    got = b""
    async with trio.open_nursery() as nursery:
        await nursery.start(serve)
        response = await pool.request(
            b"POST", parse_url(f"http://127.0.0.1:{port}/"), [], b"x", Timeouts(read=5.0)
        )
        with trio.fail_after(BOUND_S):
            async for piece in response.body:
                got += piece
                read_first.set()
    await pool.aclose()
    await listener.aclose()
    assert sent_cr.is_set() and got == b"abcde"


# -- redirects on the SDK path --------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303])
async def test_a_redirect_that_may_change_the_method_is_the_answer_alike(status: int) -> None:
    """A 301, 302 or 303 to another server: neither path follows it; the attempt fails with
    the status it is, in the same words (before, the SDK's client followed it as a GET
    without the body)."""
    results = {}
    for lean in PATHS:
        async with open_mock_server(Reply([Text("moved here")])) as moved:
            redirect = ErrorReply(status, b"", {"location": moved.base_url + "/v1/messages"})
            async with open_mock_server(redirect) as origin:
                events = await one_stream(provider_for("anthropic", origin.base_url, lean=lean))
                assert len(origin.requests) == 1
            assert moved.requests == [], lean
        [failure] = events
        assert isinstance(failure, StreamFailed), (lean, events)
        assert failure.error.status_code == status, (lean, failure.error)
        results[lean] = events
    assert results[True] == results[False]


async def test_sdk_redirects_are_followed_a_bounded_number_of_times_alike() -> None:
    """A server that redirects for ever: each path posts ``MAX_REDIRECTS`` + 1 times, then
    takes the last 307 for the answer (before, the SDK path posted 21 times and failed
    with a connection error)."""
    results = {}
    for lean in PATHS:
        async with open_mock_server() as server:
            loop = ErrorReply(307, b"", {"location": "/v1/messages"})
            server.push(*[loop] * 25)
            events = await one_stream(provider_for("anthropic", server.base_url, lean=lean))
            assert len(server.requests) == MAX_REDIRECTS + 1, lean
            assert all(r.method == "POST" for r in server.requests)
        [failure] = events
        assert isinstance(failure, StreamFailed), (lean, events)
        assert failure.error.status_code == 307, (lean, failure.error)
        results[lean] = events
    assert results[True] == results[False]


async def test_a_chain_of_redirects_within_the_bound_is_followed_alike() -> None:
    """``MAX_REDIRECTS`` redirects, then the answer: both paths stream it."""
    results = {}
    for lean in PATHS:
        async with open_mock_server() as server:
            loop = ErrorReply(308, b"", {"location": "/v1/messages"})
            server.push(*[loop] * MAX_REDIRECTS, Reply([Text("at last")]))
            events = await one_stream(provider_for("anthropic", server.base_url, lean=lean))
            assert len(server.requests) == MAX_REDIRECTS + 1, lean
        assert isinstance(events[-1], MessageCompleted), (lean, events)
        assert text_of(events) == "at last"
        results[lean] = events
    assert results[True] == results[False]


async def test_a_custom_key_header_stays_home_on_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``x-api-key`` from ``ANTHROPIC_CUSTOM_HEADERS`` goes to the base URL's server,
    not to another origin a 307 names, nor to any server after it (before, the SDK path
    sent it on: httpx2 drops only ``authorization``)."""
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", "x-api-key: gateway-secret")
    results: dict[bool, list[StreamEvent]] = {}
    for lean in PATHS:
        async with open_mock_server() as moved:
            moved.push(
                ErrorReply(307, b"", {"location": "/v1/messages?again=1"}),
                Reply([Text("moved here")]),
            )
            redirect = ErrorReply(307, b"", {"location": moved.base_url + "/v1/messages"})
            async with open_mock_server(redirect) as origin:
                events = await one_stream(provider_for("anthropic", origin.base_url, lean=lean))
                [first] = origin.requests
            assert "gateway-secret" in first.headers.get("x-api-key", ""), (lean, first.headers)
            assert len(moved.requests) == 2, (lean, events)
            for followed in moved.requests:
                assert followed.method == "POST" and followed.body["model"] == "m"
                assert "x-api-key" not in followed.headers, (lean, followed.headers)
                assert "authorization" not in followed.headers, (lean, followed.headers)
        assert isinstance(events[-1], MessageCompleted), (lean, events)
        results[lean] = events
    assert results[True] == results[False]
