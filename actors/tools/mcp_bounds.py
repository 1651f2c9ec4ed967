"""How much of one message an MCP server over streamable HTTP can make greenroom read
(R-SEC-1, R-MCP-4).

The SDK reads an SSE event up to its bound (``DEFAULT_MAX_SSE_EVENT_SIZE``, 1 MiB) and then
fails that request, but it reads a JSON response body (a server's ``json_response`` mode)
whole before greenroom sees it: a tool result of 100 MB was held whole, then cut. A response
hook on the client greenroom builds for the SDK (:func:`bound_messages`) gives a JSON body
the same bound: reading stops there and the SDK answers that request with an error naming
it; the connection and its other calls go on. A gzip or deflate body is inflated a bounded
piece at a time on the way (:func:`~greenroom.actors.providers.library_bodies.bounded_body`).

stdio is not bounded here: the SDK's ``stdio_client`` joins what the server writes until a
newline, with no limit and no place to put one short of a transport of greenroom's own.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator

import httpx2
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE
from mcp.shared._httpx_utils import create_mcp_http_client

from greenroom.actors.providers.library_bodies import body_encoding, bounded_body

MAX_MESSAGE_BYTES = DEFAULT_MAX_SSE_EVENT_SIZE
"""The most of one JSON message body that is read: the SDK's own bound for an SSE event."""


class _BoundedMessage(httpx2.AsyncByteStream):
    """A JSON message body that fails once it has given ``limit`` bytes and more follow."""

    def __init__(self, inner: httpx2.AsyncByteStream, encoding: str, limit: int) -> None:
        self._inner = inner
        self._pieces = bounded_body(inner, encoding, limit + 1, httpx2.RemoteProtocolError)
        self._limit = limit

    @property
    def elapsed(self) -> datetime.timedelta | None:
        """The library's own body's ``elapsed``, which ``httpx2.Response.elapsed`` reads."""
        elapsed: datetime.timedelta | None = getattr(self._inner, "elapsed", None)
        return elapsed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for piece in self._pieces:
            size += len(piece)
            if size > self._limit:
                # The SDK answers the request with this error (a StreamError is what it
                # catches around reading a JSON body); nothing more of it is read.
                raise httpx2.StreamError(
                    f"the MCP server's message is larger than {self._limit >> 20} MiB "
                    "(greenroom reads no more of one message)"
                )
            yield piece

    async def aclose(self) -> None:
        """Stop reading and give the connection back (closed when the body was cut)."""
        await self._pieces.aclose()
        await self._inner.aclose()


async def bound_messages(response: httpx2.Response) -> None:
    """A response hook (``event_hooks={"response": [bound_messages]}``): a JSON body is
    read up to :data:`MAX_MESSAGE_BYTES`, inflated here when compressed."""
    stream = response.stream
    json = response.headers.get("content-type", "").startswith("application/json")
    if not json or not isinstance(stream, httpx2.AsyncByteStream):
        return
    encoding = body_encoding(response)
    if "content-encoding" in response.headers:
        del response.headers["content-encoding"]
    response.stream = _BoundedMessage(stream, encoding, MAX_MESSAGE_BYTES)


def bounded_http_client(
    *, headers: dict[str, str] | None, auth: httpx2.Auth | None
) -> httpx2.AsyncClient:
    """The SDK's client for streamable HTTP (``create_mcp_http_client``: its timeouts), with
    :func:`bound_messages` among its response hooks."""
    client = create_mcp_http_client(headers=headers, auth=auth)
    hooks = client.event_hooks
    client.event_hooks = {**hooks, "response": [*hooks.get("response", []), bound_messages]}
    return client


__all__ = ["MAX_MESSAGE_BYTES", "bound_messages", "bounded_http_client"]
