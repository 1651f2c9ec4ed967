"""The provider seam: what a model service adapter is to the runtime, and the words every
adapter uses for a request that failed on the way.

An adapter (:class:`ModelProvider`) is shared by the sessions of a host; each task opens
its own :class:`ProviderTask`, which streams one request at a time and turns every error of
its own and of its libraries into a ``StreamFailed`` event. Adapters import this module
and ``protocols/`` — never the runtime, which drives them through these two protocols only.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import attrs

from greenroom.protocols.context import ModelRequest
from greenroom.protocols.stream import StreamEvent, StreamFailed

__all__ = [
    "Deliver",
    "IdentifiedEndpoint",
    "ModelProvider",
    "ProviderTask",
    "connect_failure",
    "cut_short",
    "endpoint_identity",
    "exception_words",
    "sole_exception",
    "transport_failure",
]

Deliver = Callable[[list[StreamEvent]], Awaitable[None]]


_CONNECT_REASONS: tuple[tuple[type[OSError], str], ...] = (
    (ConnectionRefusedError, "connection refused by {where}"),
    (ConnectionResetError, "connection reset by {where}"),
    (TimeoutError, "connecting to {where} timed out"),
)

# What an HTTP library's transport error (httpx's and httpx2's share their class names)
# means to someone reading a failed request, most specific class first along the MRO.
_TRANSPORT_WORDS: dict[str, str] = {
    "ReadError": "connection dropped while reading the response",
    "WriteError": "connection dropped while sending the request",
    "RemoteProtocolError": "bad HTTP from the server",
    "LocalProtocolError": "the request could not be sent as HTTP",
    "ProxyError": "the proxy refused the request",
    "UnsupportedProtocol": "unsupported URL scheme",
    "ConnectError": "cannot connect to the server",
    "ReadTimeout": "timed out reading the response",
    "WriteTimeout": "timed out sending the request",
    "ConnectTimeout": "timed out connecting to the server",
    "PoolTimeout": "timed out waiting for a free connection",
    "NetworkError": "network error",
    "TimeoutException": "timed out",
}
_ERRNO_PREFIX = re.compile(r"^\[Errno -?\d+\] ")
_DROPPED = ("peer closed connection", "Server disconnected")


def exception_words(exc: BaseException) -> str:
    """An exception's own words, without an ``[Errno N]`` prefix; "" when it has none."""
    return _ERRNO_PREFIX.sub("", " ".join(str(exc).split()))


def sole_exception(group: BaseExceptionGroup[Any]) -> BaseException:
    """The one exception ``group`` holds, out of nested groups of one (``except*``
    wraps even a lone exception, and each nursery adds a level); ``group`` itself when
    it holds several. What a reader is told about names the failure, not its wrapping."""
    found: BaseException = group
    while isinstance(found, BaseExceptionGroup) and len(found.exceptions) == 1:
        found = found.exceptions[0]
    return found


def transport_failure(exc: BaseException) -> str:
    """What a reader of a failed request is told about a transport error of an HTTP
    library: what happened in words (``connection dropped while reading the response``),
    then the library's own detail in parentheses when it has one — never a class name
    alone, never a repr."""
    words = "connection failed"
    for cls in type(exc).__mro__:
        found = _TRANSPORT_WORDS.get(cls.__name__)
        if found is not None:
            words = found
            break
    detail = exception_words(exc)
    if detail.startswith(_DROPPED):
        # httpcore's words for a body or response the server cut off.
        words = "connection dropped by the server"
    return f"{words} ({detail})" if detail and detail.lower() != words else words


def cut_short(events: list[StreamEvent], exc: BaseException) -> list[StreamEvent]:
    """The decoder's final events for a body the connection dropped part-way
    (``decoder.end_of_stream()``): a stream cut short is ``malformed`` (R-RETRY-1) unless it
    had already proven complete; the failure names the drop."""
    if events and isinstance(events[-1], StreamFailed):
        error = events[-1].error
        failed = StreamFailed(
            error=attrs.evolve(error, message=f"{error.message}; {transport_failure(exc)}")
        )
        return [*events[:-1], failed]
    return events


def _where(url: str) -> str:
    """``host:port`` of ``url`` (the scheme's port when it names none), IPv6 in brackets."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        return url
    if not host:
        return url
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}" if port else host


def connect_failure(url: str, exc: BaseException) -> str:
    """What the user reads when a connection to ``url`` could not be opened: what happened,
    naming the operating system's reason found anywhere in the exception's causes (exception
    groups included), then the URL: ``connection refused by 127.0.0.1:8080 (cannot connect
    to http://127.0.0.1:8080/v1/messages)``; else the library's own words. Such a failure
    stays retryable: a server may be starting up."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    gai = False
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for cls, reason in _CONNECT_REASONS:
            if isinstance(current, cls):
                return f"{reason.format(where=_where(url))} (cannot connect to {url})"
        if current.__class__.__name__ == "gaierror":
            gai = True
        pending.extend(getattr(current, "exceptions", ()) or ())
        for link in (current.__cause__, current.__context__):
            if link is not None:
                pending.append(link)
    if gai:
        host = urllib.parse.urlsplit(url).hostname or url
        return f"unknown host {host} (cannot connect to {url})"
    return f"cannot connect to {url} ({exception_words(exc) or 'connection failed'})"


class ProviderTask(Protocol):
    """A provider bound to one task: holds per-task state such as the request encoder
    that reuses earlier turns' encodings (dropped with the task, so idle sessions keep no
    copy of their history in wire form).

    ``stream`` sends ``request`` and delivers the parsed events in batches (one batch per
    network read: it amortises the cost per event). It delivers exactly one terminal
    event (``MessageCompleted`` or ``StreamFailed``) as the last event and never raises,
    except ``trio.Cancelled`` when the task is interrupted.
    """

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """Send ``request`` and deliver its events through ``deliver`` (see the class docstring)."""


class ModelProvider(Protocol):
    """A model service adapter, shared by the sessions of a host (one client, one pool)."""

    name: str

    def open_task(self) -> ProviderTask:
        """A new per-task adapter; the task drops it when it ends."""

    async def aclose(self) -> None:
        """Close the provider's clients; the host does when it shuts down."""


@runtime_checkable
class IdentifiedEndpoint(Protocol):
    """An adapter that can say which endpoint and credential it sends to, so that hosts
    which share limits (a cluster's, R-SHARE-1) know their clients meet at one endpoint.
    An adapter without it (the scripted model, a program's own) is admitted by its host
    alone."""

    @property
    def endpoint_identity(self) -> str:
        """The provider's name, its base URL and a hash of its credential
        (:func:`endpoint_identity`): the same for every client of one endpoint and key,
        on any host; never the credential itself."""
        ...


def endpoint_identity(provider: str, base_url: str, credential: str | None) -> str:
    """``provider``, ``base_url`` (without a trailing slash) and the first 16 hex digits
    of the SHA-256 of ``credential`` ("-" without one), space-separated. The hash tells
    two keys apart without letting the key be read back from a log line or a NATS
    subject."""
    digest = hashlib.sha256(credential.encode()).hexdigest()[:16] if credential else "-"
    return f"{provider} {base_url.rstrip('/')} {digest}"


