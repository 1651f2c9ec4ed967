"""How much of one message an MCP server over streamable HTTP can make greenroom read
(R-SEC-1, R-MCP-4).

The SDK reads an SSE event up to its bound (``DEFAULT_MAX_SSE_EVENT_SIZE``, 1 MiB) and then
fails that request, but it reads a JSON response body (a server's ``json_response`` mode)
whole before greenroom sees it: a tool result of 100 MB was held whole, then cut. A response
hook on the client greenroom builds for the SDK (:func:`bound_messages`) gives a JSON body
the same bound: reading stops there and the SDK answers that request with an error naming
it; the connection and its other calls go on. A gzip or deflate body is inflated a bounded
piece at a time on the way (:func:`~greenroom.actors.providers.library_bodies.bounded_body`).

The client of a login (:func:`login_http_client`, R-MCP-5) bounds more: the SDK's OAuth
flow reads each answer of the authorization server whole, whatever its type (metadata,
registration, token, and their errors), so :func:`bound_answers` gives every body but an
event stream's (whose events the SDK bounds) the same bound. So does a session's token
refresh (:class:`~greenroom.actors.tools.mcp_auth.StoredTokenAuth`), over either transport.

Over the legacy HTTP+SSE transport the SDK's ``sse_client`` reads the answer to each POST
of a message whole, whatever its type, and a failed POST (an HTTP error status, a refused
connection, a body past the bound) only ends its writer, silently: the calls then wait out
their timeouts. :func:`bounded_sse_client` gives it a client whose every body but the event
stream is bounded by :func:`bound_answers`, and that sees each POST fail: it ends the whole
connection with that failure as its error (its later messages could no longer be sent), so
the calls in flight fail at once and the next use connects again.

Over stdio the SDK's ``stdio_client`` joins what the server writes until a newline, with no
limit and no place to put one: greenroom's own transport
(:func:`~greenroom.actors.tools.mcp_stdio.bounded_stdio_client`) keeps at most
:data:`MAX_MESSAGE_BYTES` of a line, with the same outcome: that call gets an error naming
the bound and the connection goes on.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2
import trio
from mcp.client.sse import sse_client
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE
from mcp.shared._httpx_utils import (
    MCP_DEFAULT_SSE_READ_TIMEOUT,
    MCP_DEFAULT_TIMEOUT,
    create_mcp_http_client,
    next_request_within_origin,
)

from greenroom.actors.providers.httpx2_bodies import BoundedStream
from greenroom.actors.providers.library_bodies import body_encoding, bounded_body

MAX_MESSAGE_BYTES = DEFAULT_MAX_SSE_EVENT_SIZE
"""The most of one JSON message body that is read: the SDK's own bound for an SSE event."""


def too_large(limit: int) -> str:
    """What a call whose answer passed ``limit`` bytes is told (over HTTP and stdio)."""
    return (
        f"the MCP server's message is larger than {limit >> 20} MiB "
        "(greenroom reads no more of one message)"
    )


Refused = Callable[[str], None]
"""Told the refusal when a body passes the bound (before the read fails with it)."""


async def _message_pieces(
    pieces: AsyncGenerator[bytes, None], limit: int, refusal: str, refused: Refused | None
) -> AsyncGenerator[bytes, None]:
    """``pieces`` of a body, failing with ``refusal`` once they pass ``limit`` bytes."""
    size = 0
    try:
        async for piece in pieces:
            size += len(piece)
            if size > limit:
                if refused is not None:
                    refused(refusal)
                # The SDK answers the request with this error (a StreamError is what it
                # catches around reading a JSON body); nothing more of it is read.
                raise httpx2.StreamError(refusal)
            yield piece
    finally:
        await pieces.aclose()


def _bound_body(response: httpx2.Response, refusal: str, refused: Refused | None = None) -> None:
    """Read ``response``'s body up to :data:`MAX_MESSAGE_BYTES` (inflated here when
    compressed), failing with ``refusal`` past it (told to ``refused`` first)."""
    stream = response.stream
    if not isinstance(stream, httpx2.AsyncByteStream):
        return
    encoding = body_encoding(response)
    if "content-encoding" in response.headers:
        del response.headers["content-encoding"]
    pieces = bounded_body(stream, encoding, MAX_MESSAGE_BYTES + 1, httpx2.RemoteProtocolError)
    bounded = _message_pieces(pieces, MAX_MESSAGE_BYTES, refusal, refused)
    response.stream = BoundedStream(stream, bounded)


async def bound_messages(response: httpx2.Response) -> None:
    """A response hook (``event_hooks={"response": [bound_messages]}``): a JSON body is
    read up to :data:`MAX_MESSAGE_BYTES`, inflated here when compressed."""
    if response.headers.get("content-type", "").startswith("application/json"):
        _bound_body(response, too_large(MAX_MESSAGE_BYTES))


async def bound_answers(response: httpx2.Response, refused: Refused | None = None) -> None:
    """A response hook, as :func:`bound_messages`, for every body but an event stream's
    (the SDK bounds each of its events): the answers of an authorization server too.
    ``refused`` is told the refusal of a body that passes the bound."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        answered = f"{response.url.host} answered with more than {MAX_MESSAGE_BYTES >> 20} MiB"
        _bound_body(response, f"{answered} (greenroom reads no more of one answer)", refused)


def bounded_http_client(
    *,
    headers: dict[str, str] | None,
    auth: httpx2.Auth | None,
    timeout: httpx2.Timeout | None = None,
    bound: Callable[[httpx2.Response], Awaitable[None]] = bound_messages,
) -> httpx2.AsyncClient:
    """The SDK's client for streamable HTTP (``create_mcp_http_client``: its timeouts,
    unless ``timeout``), with ``bound`` among its response hooks."""
    client = create_mcp_http_client(headers=headers, timeout=timeout, auth=auth)
    hooks = client.event_hooks
    client.event_hooks = {**hooks, "response": [*hooks.get("response", []), bound]}
    return client


def login_http_client(
    headers: dict[str, str] | None = None,
    timeout: httpx2.Timeout | None = None,
    auth: httpx2.Auth | None = None,
) -> httpx2.AsyncClient:
    """The client of a login's connection, whatever its transport (a factory as the SDK's
    ``sse_client`` takes one): every answer bounded by :func:`bound_answers`."""
    return bounded_http_client(headers=headers, auth=auth, timeout=timeout, bound=bound_answers)


class PostFailed(Exception):
    """A message could not be sent over the legacy HTTP+SSE transport: its POST was
    answered with an HTTP error status, or failed on the way (the message says which)."""


class _WatchedPosts(httpx2.AsyncClient):
    """A client that tells ``failed`` why a POST failed, whatever the caller then does
    with the failure (the SDK's ``sse_client`` drops it)."""

    def __init__(self, failed: Callable[[Exception], None], **options: Any) -> None:
        super().__init__(**options)
        self.failed = failed
        # How many redirects the SDK followed to each request it is to send next: it
        # follows at most ``max_redirects``, and raises for the redirect after those.
        self._followed: weakref.WeakKeyDictionary[httpx2.Request, int] = weakref.WeakKeyDictionary()

    async def send(self, request: httpx2.Request, **options: Any) -> httpx2.Response:
        """``AsyncClient.send``, telling ``failed`` of a failed POST."""
        if request.method != "POST":
            return await super().send(request, **options)
        try:
            response = await super().send(request, **options)
        except httpx2.HTTPError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            self.failed(PostFailed(f"a message could not be sent to {request.url.host}: {reason}"))
            raise
        except Exception as exc:  # the OAuth flow's McpLoginNeeded: it says what to do
            self.failed(exc)
            raise
        followed = self._followed.pop(request, 0)
        if response.is_success:
            return response
        # A redirect the SDK follows is not the end; any other answer is one it raises for
        # (``raise_for_status``), which stops its writer: so is the redirect past its budget.
        next_request = next_request_within_origin(response)
        if next_request is not None and followed < self.max_redirects:
            self._followed[next_request] = followed + 1
            return response
        status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
        after = f" after {followed} redirects" if followed else ""
        self.failed(PostFailed(f"{request.url.host} answered a message with {status}{after}"))
        return response


@contextlib.asynccontextmanager
async def bounded_sse_client(
    url: str,
    *,
    headers: dict[str, str] | None,
    auth: httpx2.Auth | None,
    failed: Callable[[Exception], None] | None = None,
) -> AsyncIterator[Any]:
    """The SDK's ``sse_client`` (the legacy HTTP+SSE transport) with a client whose every
    answer but the event stream is bounded by :func:`bound_answers`: yields its
    ``(read_stream, write_stream)``. A POST of a message that fails ends the connection:
    the caller's block is cancelled and leaving raises the failure (the SDK's writer has
    stopped on it, so no later message could be sent): ``httpx2.StreamError`` with the
    refusal of a body past the bound, :class:`PostFailed` naming the HTTP status or what
    failed on the way, or what the OAuth flow raised. ``failed`` is told the failure
    first, before the caller's requests in flight see the connection closed."""
    failures: list[Exception] = []
    with trio.CancelScope() as connection:

        async def refuse(response: httpx2.Response) -> None:
            await bound_answers(response, lambda refusal: end(httpx2.StreamError(refusal)))

        def end(failure: Exception) -> None:
            if not failures and failed is not None:
                failed(failure)
            failures.append(failure)
            connection.cancel()

        def client(
            headers: dict[str, str] | None = None,
            timeout: httpx2.Timeout | None = None,
            auth: httpx2.Auth | None = None,
        ) -> httpx2.AsyncClient:
            # As the SDK's create_mcp_http_client builds it, with the bound and the watch.
            default = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
            return _WatchedPosts(
                end,
                headers=headers,
                auth=auth,
                timeout=timeout or default,
                event_hooks={"response": [refuse]},
            )

        async with sse_client(
            url, headers=headers, auth=auth, httpx_client_factory=client
        ) as streams:
            yield streams
    if failures:
        raise failures[0]


__all__ = [
    "MAX_MESSAGE_BYTES",
    "PostFailed",
    "bound_answers",
    "bound_messages",
    "bounded_http_client",
    "bounded_sse_client",
    "login_http_client",
    "too_large",
]
