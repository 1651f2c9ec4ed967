"""The two paths of a model stream — the lean wire (greenroom's own HTTP/1.1 client) and the
library path (httpx for the OpenAI providers, the anthropic SDK on httpx2) — answer the same
server the same way (R-SEC-1, R-SEC-10), each against a real loopback server:

- A 307 or 308 from an OpenAI-compatible base URL is followed on both paths, at most
  ``MAX_REDIRECTS`` times, the key not sent on to another origin (httpx, the library path,
  followed none: the attempt failed where the lean path streamed the answer).
- A response head with bare-LF line breaks, or an obsolete folded header line, is read as
  h11 (the library paths' parser) reads it; a CR left inside a header line is refused
  alike; a chunked body's trailers may end with bare LFs.
- A body in a content coding greenroom does not read (``br``, ``zstd``, several stacked)
  fails the attempt naming the coding on both paths (the lean path handed it to the codec
  as it was: ``malformed``, saying nothing of why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.providers.lean_http import ConnectionPool, Timeouts, parse_url
from greenroom.actors.providers.lean_wire import MAX_REDIRECTS
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
)
from tests.support.raw_http import serve_answer as _serve
from tests.test_codecfix_stream import one_stream as one_attempt
from tests.test_codecfix_stream import provider_for

BOUND_S = 20.0
"""Bound on every wait: a hang fails the test instead of the suite."""
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PATHS = (True, False)
"""``lean_http`` of the two paths."""


async def one_stream(provider: Any) -> list[StreamEvent]:
    """One attempt's events on one of the two paths; an exception out of ``stream`` fails
    the test as such."""
    assert provider.lean_http in PATHS
    return await one_attempt(provider)


async def answered_by(wire: str, answer: Any, lean: bool) -> list[StreamEvent]:
    """One attempt's events on the ``lean`` path, against a mock server whose one
    response is ``answer``."""
    async with open_mock_server(answer) as server:
        return await one_stream(provider_for(wire, server.base_url, lean=lean))


async def lone_failure(answer: ErrorReply, lean: bool) -> tuple[list[StreamEvent], StreamFailed]:
    """The events of one OpenAI attempt on the ``lean`` path answered by ``answer``, which
    are one failure alone, and that failure."""
    events = await answered_by("openai", answer, lean)
    [failure] = events
    assert isinstance(failure, StreamFailed)
    return events, failure


def text_of(events: list[StreamEvent]) -> str:
    return "".join(getattr(event, "text", "") for event in events)


# -- redirects ------------------------------------------------------------------------------


ENDPOINT = {
    "anthropic": "/v1/messages",
    "openai": "/v1/chat/completions",
    "openai-responses": "/v1/responses",
}


@pytest.mark.parametrize("wire", sorted(ENDPOINT))
@pytest.mark.parametrize("status", [307, 308])
async def test_a_redirect_to_another_origin_is_followed_on_both_paths(
    wire: str, status: int
) -> None:
    """A base URL answered by a 307 or 308 to another server: both paths post again there
    and stream its answer, without the key (before, the OpenAI providers' httpx path took
    the redirect for the answer and failed the attempt; the anthropic SDK followed it)."""
    results = {}
    for lean in PATHS:
        async with open_mock_server(Reply([Text("moved here")])) as moved:
            location = moved.base_url + ENDPOINT[wire]
            redirect = ErrorReply(status, b"", {"location": location})
            async with open_mock_server(redirect) as origin:
                events = await one_stream(provider_for(wire, origin.base_url, lean=lean))
                assert len(origin.requests) == 1
            assert len(moved.requests) == 1, (lean, events)
            [followed] = moved.requests
            assert followed.method == "POST" and followed.body["model"] == "m"
            assert "authorization" not in followed.headers, lean
            assert "x-api-key" not in followed.headers, lean
        assert isinstance(events[-1], MessageCompleted), (lean, events)
        assert text_of(events) == "moved here"
        results[lean] = events
    assert results[True] == results[False]


@pytest.mark.parametrize("lean", PATHS)
async def test_a_redirect_within_the_origin_keeps_the_key(lean: bool) -> None:
    """A 308 to another path of the same server: the key goes with the request again."""
    async with open_mock_server() as server:
        server.push(
            ErrorReply(308, b"", {"location": "/v1/chat/completions?moved=1"}),
            Reply([Text("same place")]),
        )
        events = await one_stream(provider_for("openai", server.base_url, lean=lean))
        assert [r.api_key for r in server.requests] == ["k", "k"]
    assert text_of(events) == "same place"


async def test_redirects_are_followed_a_bounded_number_of_times_alike() -> None:
    """A server that redirects for ever: each path posts ``MAX_REDIRECTS`` + 1 times, then
    takes the last redirect for the answer and fails the attempt, in the same words."""
    results = {}
    for lean in PATHS:
        async with open_mock_server() as server:
            loop = ErrorReply(307, b"", {"location": "/v1/chat/completions"})
            server.push(*[loop] * (MAX_REDIRECTS + 3))
            events = await one_stream(provider_for("openai", server.base_url, lean=lean))
            assert len(server.requests) == MAX_REDIRECTS + 1, lean
        assert isinstance(events[-1], StreamFailed), (lean, events)
        results[lean] = events
    assert results[True] == results[False]


async def test_a_redirect_to_no_http_url_fails_alike() -> None:
    """A 307 to an ``ftp://`` URL: both paths fail the attempt as an unsupported URL
    scheme, in the same words (the httpx path took the redirect for the answer)."""
    results = {}
    for lean in PATHS:
        redirect = ErrorReply(307, b"", {"location": "ftp://127.0.0.1/v1/chat/completions"})
        events, failure = await lone_failure(redirect, lean)
        assert failure.error.kind == "timeout"
        assert failure.error.message.startswith("unsupported URL scheme"), failure.error.message
        results[lean] = events
    assert results[True] == results[False]


# -- response heads -------------------------------------------------------------------------


def _chunked(body: bytes, end: bytes = b"0\r\n\r\n") -> bytes:
    return b"%x\r\n%s\r\n%s" % (len(body), body, end)


SSE = {
    "anthropic": (FIXTURES / "anthropic" / "text_only.sse").read_bytes(),
    "openai": (FIXTURES / "openai" / "text_only.sse").read_bytes(),
}
TYPE = b"content-type: text/event-stream"
CHUNKED = b"transfer-encoding: chunked"

ACCEPTED_HEADS: dict[str, bytes] = {
    "bare LF line breaks": b"HTTP/1.1 200 OK\n" + TYPE + b"\n" + CHUNKED + b"\n\n",
    "CRLF and bare LF mixed": b"HTTP/1.1 200 OK\r\n" + TYPE + b"\n" + CHUNKED + b"\r\n\n",
    "blank line of LF CRLF": b"HTTP/1.1 200 OK\r\n" + TYPE + b"\r\n" + CHUNKED + b"\n\r\n",
    "folded transfer-encoding": (
        b"HTTP/1.1 200 OK\r\n" + TYPE + b"\r\ntransfer-encoding:\r\n chunked\r\n\r\n"
    ),
    "folded header with tabs": (
        b"HTTP/1.1 200 OK\r\n" + TYPE + b"\r\nx-note: one\r\n\t two\r\n" + CHUNKED + b"\r\n\r\n"
    ),
}
REFUSED_HEADS: dict[str, bytes] = {
    "continuation line first": (
        b"HTTP/1.1 200 OK\r\n folded\r\n" + TYPE + b"\r\n" + CHUNKED + b"\r\n\r\n"
    ),
    "CR inside a header line": (
        b"HTTP/1.1 200 OK\r\n" + TYPE + b"\r\nx-note: a\rb\r\n" + CHUNKED + b"\r\n\r\n"
    ),
}


async def both_paths(wire: str, answer: bytes) -> dict[bool, list[StreamEvent]]:
    """The events of one attempt on each path against a server that answers ``answer``."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    results = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(_serve, listener, answer)
        for lean in PATHS:
            results[lean] = await one_stream(
                provider_for(wire, f"http://127.0.0.1:{port}", lean=lean)
            )
        nursery.cancel_scope.cancel()
    await listener.aclose()
    return results


@pytest.mark.parametrize("wire", sorted(SSE))
@pytest.mark.parametrize("case", sorted(ACCEPTED_HEADS))
async def test_a_head_h11_reads_is_read_on_the_lean_path_alike(wire: str, case: str) -> None:
    """A head with bare-LF line breaks or obsolete folding, which h11 reads: the lean path
    streams the answer too (before, it waited for a CRLF blank line until the read
    timeout, or refused the folded line as bad HTTP)."""
    results = await both_paths(wire, ACCEPTED_HEADS[case] + _chunked(SSE[wire]))
    for lean, events in results.items():
        assert isinstance(events[-1], MessageCompleted), (lean, events)
    assert results[True] == results[False]


@pytest.mark.parametrize("case", sorted(REFUSED_HEADS))
async def test_a_head_h11_refuses_is_refused_on_the_lean_path_alike(case: str) -> None:
    """A folded line with no header before it, a CR inside a header line: h11 refuses the
    head, and so does the lean path (a CR one parser breaks a line at and another does
    not splits a response differently): bad HTTP from the server, ``timeout``."""
    results = await both_paths("anthropic", REFUSED_HEADS[case] + _chunked(SSE["anthropic"]))
    for lean, events in results.items():
        [failure] = events
        assert isinstance(failure, StreamFailed), (lean, events)
        assert failure.error.kind == "timeout"
        words = failure.error.message
        assert words.startswith("bad HTTP from the server"), (lean, words)


@pytest.mark.parametrize("wire", sorted(SSE))
async def test_an_error_status_with_a_folded_retry_after_is_classified_alike(wire: str) -> None:
    """A 429 whose ``retry-after`` is folded onto a second line: both paths classify it
    with the wait it gives (before, the lean path called the head bad HTTP)."""
    body = json.dumps({"error": {"type": "rate_limit_error", "message": "slow down"}}).encode()
    answer = (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"retry-after:\r\n 7\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    results = await both_paths(wire, answer)
    for lean, events in results.items():
        [failure] = events
        assert isinstance(failure, StreamFailed), (lean, events)
        assert failure.error.status_code == 429
        assert failure.error.retry_after_s == 7.0, (lean, failure.error)
    assert results[True] == results[False]


async def test_chunked_trailers_may_end_with_bare_line_feeds() -> None:
    """A chunked body whose trailers end with bare LFs (h11 reads them): the lean client
    reads the body to its end and keeps the connection for the next request (before, it
    waited for a CRLF blank line, and the server's close cut the body short)."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    answer = b"HTTP/1.1 200 OK\r\n" + CHUNKED + b"\r\n\r\n" + _chunked(b"hello", b"0\r\nx: y\n\n")
    pool = ConnectionPool()
    async with trio.open_nursery() as nursery:
        await nursery.start(_serve, listener, answer)
        response = await pool.request(
            b"POST", parse_url(f"http://127.0.0.1:{port}/"), [], b"x", Timeouts(read=5.0)
        )
        with trio.fail_after(BOUND_S):
            body = await response.aread()
        nursery.cancel_scope.cancel()
    await pool.aclose()
    await listener.aclose()
    assert body == b"hello"


# -- content codings ------------------------------------------------------------------------


RENDER = {
    "anthropic": lambda reply: render_anthropic(reply, message_id="msg_1", default_input_tokens=3),
    "openai": lambda reply: render_openai(reply, completion_id="cmpl_1", default_input_tokens=3),
}


@pytest.mark.parametrize("wire", sorted(RENDER))
@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip, br"])
async def test_a_body_in_an_encoding_greenroom_does_not_read_is_named_on_both_paths(
    wire: str, encoding: str
) -> None:
    """A stream in a content coding neither path reads: the attempt fails with a message
    that names the coding, the same on both paths (before, the lean path handed the bytes
    to the codec as they were: ``malformed``, without a word of why)."""
    sse = b"".join(event.data for event in RENDER[wire](Reply([Text("hidden")])))
    results = {}
    for lean in PATHS:
        answer = Streamed(
            events=[SSEEvent(sse)],
            headers=[("content-type", "text/event-stream"), ("content-encoding", encoding)],
            paced=False,
        )
        events = await answered_by(wire, answer, lean)
        failed = [event for event in events if isinstance(event, StreamFailed)]
        assert len(failed) == 1, (lean, events)
        assert f"content-encoding {encoding!r}" in failed[0].error.message, (lean, failed)
        assert "not read" in failed[0].error.message
        assert "hidden" not in text_of(events)
        results[lean] = events
    assert results[True] == results[False]


async def test_an_error_body_in_an_encoding_greenroom_does_not_read_is_named_alike() -> None:
    """A 500 whose body is ``br``: both paths fail the attempt naming the coding."""
    results = {}
    for lean in PATHS:
        answer = ErrorReply(500, b"\x8b\x02\x80", {"content-encoding": "br"})
        events, failure = await lone_failure(answer, lean)
        assert "content-encoding 'br'" in failure.error.message, (lean, failure.error)
        results[lean] = events
    assert results[True] == results[False]
