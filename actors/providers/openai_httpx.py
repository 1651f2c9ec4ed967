"""The OpenAI providers' library path: httpx's client (httpx → httpcore → h11), parsed by
greenroom's codecs.

Used when the lean path is turned off (``lean_http=False``, ``GREENROOM_LEAN_HTTP=0``,
``--no-lean-http``) and when a proxy from the environment applies to the base URL (httpx
honours ``HTTPS_PROXY`` and its kin; greenroom's own client does not). Library errors are
translated to ``StreamFailed`` in one place, :meth:`HTTPStreamTask.stream`, in the words
the lean path uses for the same failure. Redirects are followed as the lean path follows
them (307 and 308 only, a bounded number, the credentials kept from another origin).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, ClassVar

import httpx

from greenroom.actors.providers.base import (
    Deliver,
    connect_failure,
    transport_failure,
)
from greenroom.actors.providers.lean_http import (
    RemoteProtocolError,
    TimeoutSettings,
    TransportError,
    parse_url,
)
from greenroom.actors.providers.lean_wire import (
    CREDENTIALS,
    MAX_REDIRECTS,
    REDIRECTS,
    ErrorClassifier,
    RequestBuilder,
    StreamDecoder,
    redirect_target,
    same_origin,
)
from greenroom.actors.providers.library_bodies import BodyBounds
from greenroom.actors.providers.media import TaskImages
from greenroom.actors.providers.stalls import (
    HeadDeadline,
    no_response_message,
    read_library_body,
    time_heads,
)
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.stream import ModelError, StreamFailed


def make_client(
    headers: dict[str, str], timeout: TimeoutSettings, max_connections: int
) -> httpx.AsyncClient:
    """One httpx client (and connection pool) for a provider; its response bodies are read
    within bounds (:mod:`~greenroom.actors.providers.library_bodies`), its response heads
    within the read timeout inside a :class:`~greenroom.actors.providers.stalls.HeadDeadline`."""
    bounds = BodyBounds(BoundedStream, httpx.RemoteProtocolError, read_timeout=timeout.read)
    return httpx.AsyncClient(
        headers=headers,
        event_hooks={"request": [time_heads], "response": [bounds]},
        timeout=httpx.Timeout(
            connect=timeout.connect, read=timeout.read, write=timeout.write, pool=timeout.pool
        ),
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
    )


class BoundedStream(httpx.AsyncByteStream):
    """A response body read through :func:`~greenroom.actors.providers.library_bodies.
    bounded_body`: yields ``pieces``, and closing it closes the library's own ``inner``."""

    def __init__(self, inner: httpx.AsyncByteStream, pieces: AsyncGenerator[bytes, None]) -> None:
        self._inner = inner
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._pieces:
            yield piece

    async def aclose(self) -> None:
        """Stop reading and give the connection back (closed when the body was cut)."""
        await self._pieces.aclose()
        await self._inner.aclose()


class HTTPStreamTask:
    """Streams one attempt over httpx through a sans-IO codec; every library error becomes
    a ``StreamFailed`` here."""

    __slots__ = (
        "_classify", "_client", "_decoder", "_encoder", "_images", "_read_timeout", "_url"
    )

    usage_at_end: ClassVar[bool] = True
    """As :attr:`~greenroom.actors.providers.openai.LeanStreamTask.usage_at_end`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        encoder: RequestBuilder,
        decoder: Callable[[], StreamDecoder],
        classify: ErrorClassifier,
        images: TaskImages | None = None,
    ) -> None:
        self._client = client
        self._url = url
        self._encoder = encoder
        self._decoder = decoder
        self._classify = classify
        self._images = images
        self._read_timeout: float | None = client.timeout.read

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """POST the encoded ``request`` and deliver the decoded events, one batch per read.
        An HTTP error status is classified by the codec (from what of its body came
        within the read timeout and its slack), a connection failure or timeout becomes a
        ``StreamFailed`` (a response head not whole within the read timeout, however it
        trickles in, is one), a body that sends only keep-alives for longer than the read
        timeout fails as ``timeout`` (R-SEC-10), and a body cut short ends as
        :func:`cut_short` judges what arrived: no httpx error escapes. The request's images
        are read first, off the event loop, when the encoder has a :class:`TaskImages`
        loader."""
        if self._images is not None:
            await self._images.prepare(request)
        body = self._encoder.build(request)
        decoder = self._decoder()
        timeout = self._read_timeout
        try:
            with HeadDeadline(timeout, httpx.ReadTimeout):
                response = await _post(self._client, self._url, body)
                try:
                    if response.status_code >= 400:
                        content = await response.aread()
                        error = self._classify(
                            response.status_code, content, response.headers, now=time.time()
                        )
                        await deliver([StreamFailed(error=error)])
                        return
                    if await read_library_body(
                        response.aiter_bytes(), decoder, deliver, timeout,
                        timeout_error=httpx.TimeoutException,
                        transport_error=httpx.TransportError,
                    ):
                        return
                finally:
                    await response.aclose()
            await deliver(decoder.end_of_stream())
        except httpx.ConnectTimeout:
            await deliver([_failed(f"timed out connecting to the server ({self._url})")])
        except httpx.ReadTimeout:
            await deliver([_failed(no_response_message(timeout))])
        except httpx.TimeoutException as exc:
            await deliver([_failed(transport_failure(exc))])
        except httpx.ConnectError as exc:
            await deliver([_failed(connect_failure(self._url, exc))])
        except (httpx.TransportError, TransportError) as exc:
            # TransportError: a redirect's location that is no http(s) URL (_post).
            await deliver([_failed(transport_failure(exc))])


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` as JSON to ``url`` and return the response once its head is read
    (its body streamed; the caller closes it), following a 307 or 308 as the lean path
    does (:meth:`~greenroom.actors.providers.lean_wire.LeanEndpoint.stream`): at most
    :data:`~greenroom.actors.providers.lean_wire.MAX_REDIRECTS` of them, the credentials
    not sent to another origin, a location that is not an http(s) URL a failure in the
    lean path's words. httpx follows no redirect by default, and following every kind
    would turn a 301-303 into a GET the lean path does not send."""
    request = client.build_request("POST", url, json=body)
    target = parse_url(url)
    hops = 0
    foreign = False  # once another origin was reached, the credentials stay behind
    while True:
        response = await client.send(request, stream=True)
        if response.status_code not in REDIRECTS or hops == MAX_REDIRECTS:
            return response
        location = next((v for k, v in response.headers.raw if k.lower() == b"location"), b"")
        if not location:
            return response
        hops += 1
        await response.aclose()
        following = redirect_target(target, location)
        foreign = foreign or not same_origin(following, target)
        try:
            # Built by the client, for its timeouts (its default headers come with it).
            moved = client.build_request("POST", following.text, content=request.content)
        except httpx.InvalidURL as exc:
            raise RemoteProtocolError(f"Invalid URL in location header: {exc}") from None
        for key, value in request.headers.multi_items():
            if key.lower() not in ("host", "content-length"):
                moved.headers[key] = value
        if foreign:
            for credential in CREDENTIALS:
                moved.headers.pop(credential.decode(), None)
        request, target = moved, following


def _failed(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))


__all__ = ["HTTPStreamTask", "make_client"]
