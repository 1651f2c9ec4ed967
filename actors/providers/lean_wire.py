"""One streamed model request over greenroom's own HTTP client, for every HTTP provider.

The request is built here (JSON body, the provider's headers), sent through a
:class:`~greenroom.actors.providers.lean_http.ConnectionPool`, and its body handed to the
provider's sans-IO codec once per network read. Every failure becomes the one
``StreamFailed`` the runtime expects (R-RETRY-1), worded as the provider's library path
words it (:class:`Wording`): an HTTP error status is classified by the codec, a connection
that cannot be opened names the host and the operating system's reason, a timeout says
which phase ran out of time, a body cut short is judged by what arrived (``cut_short``),
and a body that makes no progress for the read timeout — silence or keep-alives alone —
fails as ``timeout`` (R-SEC-10). Nothing here imports an HTTP library or an SDK.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from greenroom.actors.providers.base import (
    Deliver,
    connect_failure,
    cut_short,
    transport_failure,
)
from greenroom.actors.providers.lean_http import (
    URL,
    ConnectError,
    ConnectionPool,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    TimeoutException,
    TimeoutSettings,
    TransportError,
    parse_url,
)
from greenroom.actors.providers.stalls import stalled_message
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.stream import ModelError, StreamEvent, StreamFailed


class RequestBuilder(Protocol):
    """A codec's request encoder for one task."""

    def build(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body of the request for ``request``."""


class StreamDecoder(Protocol):
    """A codec's sans-IO stream decoder for one attempt."""

    @property
    def finished(self) -> bool:
        """True once the terminal event has been returned (the rest of the body is not read)."""

    def feed(self, data: bytes) -> list[StreamEvent]:
        """The events completed by the next bytes of the body; none after the terminal event."""

    def end_of_stream(self) -> list[StreamEvent]:
        """The body ended: the remaining events, ending with the terminal event unless it
        was already returned (a body cut short ends with a ``StreamFailed``)."""


class ErrorClassifier(Protocol):
    """A codec's ``classify_error``: ``now`` (the wall clock) turns an HTTP-date
    ``retry-after`` into a wait."""

    def __call__(
        self, status: int, body: bytes, headers: Mapping[str, str], *, now: float | None = None
    ) -> ModelError: ...


@attrs.frozen(kw_only=True)
class Wording:
    """How a provider's library path reports a request that failed before its body began,
    so that its lean path reports it alike. ``is_error_status``: which statuses are
    classified as errors (their body read whole and given to the codec) instead of
    streamed. ``timed_out(exc, url, read_timeout)``: the message for a timeout."""

    is_error_status: Callable[[int], bool]
    timed_out: Callable[[TimeoutException, str, float | None], str]


MAX_ERROR_BODY = 1 << 20
"""The most of an error response's body that is read (and given to the codec): a server
cannot make a failed request hold unbounded memory."""

MAX_REDIRECTS = 5
"""307 and 308 redirects followed for one request before its last response counts."""

REDIRECTS = (307, 308)
"""The redirects followed, on the lean path and the library paths alike: those that keep
the method and the body."""

CREDENTIALS = (b"authorization", b"x-api-key")
"""The headers (lower case) not sent on once a redirect leads to another origin."""


def redirect_target(url: URL, location: bytes) -> URL:
    """Where a redirect from ``url`` whose ``location`` header says ``location`` leads:
    :class:`~greenroom.actors.providers.lean_http.RemoteProtocolError` when it is no URL,
    :class:`~greenroom.actors.providers.lean_http.UnsupportedProtocol` when it is not an
    http or https one."""
    try:
        joined = urllib.parse.urljoin(url.text, location.decode("latin-1"))
    except ValueError as exc:
        # The server's own words are not a URL ("http://[::1"): bad HTTP, as httpx
        # reports it, never an exception out of the request.
        raise RemoteProtocolError(f"Invalid URL in location header: {exc}") from None
    return parse_url(joined)


def same_origin(one: URL, other: URL) -> bool:
    """Whether ``one`` and ``other`` have the same scheme, host and port (an upgrade from
    http to https is another origin: the credentials do not follow it either)."""
    return (one.scheme, one.host, one.port) == (other.scheme, other.host, other.port)


def lean_by_default() -> bool:
    """What a provider given no ``lean_http`` uses: ``GREENROOM_LEAN_HTTP`` (on when
    unset); :class:`ConfigurationError` naming the variable when it holds something else."""
    from greenroom.actors.providers.registry import lean_http_enabled

    try:
        return lean_http_enabled()
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


def _json_body(body: dict[str, Any]) -> bytes:
    # As the SDKs and httpx serialise a JSON body: compact, UTF-8, no NaN.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class LeanEndpoint:
    """One model endpoint (a URL and its headers) over a connection pool of its own,
    shared by every task of a provider. ``headers`` are sent with every request, after
    ``Host`` and before ``Content-Length`` and the JSON content type; ``url`` must be an
    http or https URL (:class:`~greenroom.actors.providers.lean_http.UnsupportedProtocol`
    otherwise)."""

    __slots__ = ("_headers", "_pool", "_target", "_timeouts", "_wording", "read_timeout", "url")

    def __init__(
        self,
        url: str,
        headers: Sequence[tuple[str, str]],
        timeouts: TimeoutSettings,
        wording: Wording,
        *,
        max_connections: int,
    ) -> None:
        self.url = url
        self._target = parse_url(url)
        self._headers = [
            (name.encode("ascii"), value.encode("latin-1")) for name, value in headers
        ]
        self._headers.append((b"Content-Type", b"application/json"))
        self._timeouts = timeouts
        self._wording = wording
        self._pool = ConnectionPool(max_connections=max_connections)
        self.read_timeout = timeouts.read

    async def stream(
        self,
        body: dict[str, Any],
        decoder: StreamDecoder,
        classify: ErrorClassifier,
        deliver: Deliver,
    ) -> None:
        """POST ``body`` as JSON and deliver what ``decoder`` makes of the response, one
        batch per network read, ending with exactly one terminal event (see the module
        docstring for the failures). Never raises but ``trio.Cancelled``, and a
        ``ValueError`` for a body JSON cannot carry (a NaN)."""
        content = _json_body(body)
        wording = self._wording
        try:
            response = await self._send(content)
            try:
                if wording.is_error_status(response.status):
                    data = await _error_body(response)
                    # The wall clock: an HTTP-date ``retry-after`` is an absolute time.
                    error = classify(response.status, data, response.header_map(), now=time.time())
                    await deliver([StreamFailed(error=error)])
                    return
                if await _read_body(response, decoder, deliver, self.read_timeout):
                    return
            finally:
                await response.aclose()
            await deliver(decoder.end_of_stream())
        except ConnectError as exc:
            await deliver([_failed(connect_failure(exc.url or self.url, exc))])
        except TimeoutException as exc:
            url = exc.url or self.url
            await deliver([_failed(wording.timed_out(exc, url, self.read_timeout))])
        except TransportError as exc:
            await deliver([_failed(transport_failure(exc))])

    async def _send(self, content: bytes) -> Response:
        """POST ``content``, following a redirect that keeps the method (307, 308) as the
        libraries do, up to :data:`MAX_REDIRECTS` times (the credentials are not sent to
        another origin); the last response."""
        target = self._target
        headers = self._headers
        hops = 0
        while True:
            response = await self._pool.request(b"POST", target, headers, content, self._timeouts)
            if response.status not in REDIRECTS or hops == MAX_REDIRECTS:
                return response
            location = response.header(b"location")
            if not location:
                return response
            hops += 1
            await response.aclose()
            following = redirect_target(target, location)
            if not same_origin(following, target):
                headers = [h for h in headers if h[0].lower() not in CREDENTIALS]
            target = following

    async def aclose(self) -> None:
        """Close the pool's idle connections."""
        await self._pool.aclose()


async def _read_body(
    response: Response, decoder: StreamDecoder, deliver: Deliver, read_timeout: float | None
) -> bool:
    """Feed the body to ``decoder`` and deliver what each read completes. True when the
    stream has ended (its terminal event, a cut or a stall delivered as such); False when
    the body ended first. The body's one read deadline moves on only when a read decodes
    to events (marking that costs an attribute store): keep-alives alone end the stream
    after the read timeout (R-SEC-10)."""
    body = response.body
    keepalives = False
    try:
        with body.read_deadline(progress=True) as deadline:
            pieces = aiter(body)
            try:
                async for chunk in pieces:
                    events = decoder.feed(chunk)
                    if events:
                        deadline.progressed = True
                        keepalives = False
                        await deliver(events)
                        if decoder.finished:
                            return True
                    else:
                        keepalives = True
            except TimeoutException:
                raise
            except TransportError as exc:
                # The body had begun: a stream cut short, judged by what arrived.
                await deliver(cut_short(decoder.end_of_stream(), exc))
                return True
            finally:
                await pieces.aclose()
    except ReadTimeout:
        # Only the held deadline raises it here, and only for a finite timeout.
        read = math.inf if read_timeout is None else read_timeout
        await deliver([_failed(stalled_message(read, keepalives=keepalives))])
        return True
    return False


async def _error_body(response: Response) -> bytes:
    """At most :data:`MAX_ERROR_BODY` of an error response's body, read within one read
    timeout: a body trickled a byte at a time holds the request no longer than silence
    would (R-SEC-10), and the words that came by then are classified."""
    pieces: list[bytes] = []
    size = 0
    body = response.body
    with contextlib.suppress(ReadTimeout), body.read_deadline(progress=True):
        # Progress is never marked: the deadline runs from the first read, whatever comes.
        reads = aiter(body)
        try:
            async for piece in reads:
                pieces.append(piece)
                size += len(piece)
                if size >= MAX_ERROR_BODY:
                    break
        finally:
            await reads.aclose()
    return b"".join(pieces)[:MAX_ERROR_BODY]


def _failed(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))


__all__ = [
    "CREDENTIALS",
    "MAX_REDIRECTS",
    "REDIRECTS",
    "ErrorClassifier",
    "LeanEndpoint",
    "RequestBuilder",
    "StreamDecoder",
    "Wording",
    "lean_by_default",
    "redirect_target",
    "same_origin",
]
